"""Which format fits my tensors? The analysis behind ``python -m qformats compare``.

For every tensor and format, :func:`compare` quantizes the tensor, dequantizes it and measures
(``x`` is the tensor as float32, ``y`` its round trip ``dequantize(*quantize(x))``):

* ``bits_per_element``: storage bits of ``data`` plus every scale leaf, per element;
* ``sqnr_db``: ``10 * log10(sum(x**2) / sum((x - y)**2))``, computed in float64; ``None`` (and
  ``exact: True``) when the round trip is exact;
* ``max_rel_error``: ``max |x - y| / |x|`` over the nonzero elements;
* ``saturated_fraction``: fraction of all elements that were clipped at the element's largest
  magnitude: the element came out as ``+-max_value`` and ``|x| > |y| * (1 + h / max_value)``, where
  ``h`` is half the grid spacing at ``max_value``; i.e. with an unbounded range ``x`` would have
  rounded to something beyond the maximum;
* ``flushed_fraction``: fraction of all elements that are nonzero but dequantize to 0;
* ``quantize_seconds``: the median wall time of a few warm runs of ``jax.jit(fmt.quantize)``.

The recommendation for a tensor is the format with the fewest bits per element whose SQNR is at
least ``min_sqnr`` (ties go to the higher SQNR); the overall recommendation is the format with the
fewest total bits over all tensors among those that clear ``min_sqnr`` on every tensor.

A format that cannot hold a tensor (for example a blocked format whose block size does not divide
the tensor's axis) yields a record with ``applicable: False`` and the reason.
"""

from __future__ import annotations

import concurrent.futures
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qformats import _safetensors
from qformats._format import ScaledFormat
from qformats._registry import get_format, list_formats

__all__ = ["CompareResult", "InputProblem", "Tensor", "compare", "default_tensors", "load_tensors"]

DEFAULT_MIN_SQNR = 25.0


class InputProblem(Exception):
    """A problem with the user's input (file, tensor, format name); the CLI exits with status 2."""


@dataclass
class Tensor:
    """One tensor to analyse: ``name`` (unique in a run), ``source`` (file or ``"default set"``)."""

    name: str
    array: np.ndarray
    source: str = ""
    description: str = ""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


# -- the embedded default set -------------------------------------------------------------------


def default_tensors(seed: int = 0) -> list[Tensor]:
    """A small, deterministic set of tensors typical of training a 512-wide transformer.

    All have shape (2048, 512) (so each format compiles once):

    * ``weights``: Gaussian, std 0.02 (an MLP projection at init);
    * ``activations``: 2048 tokens of Student-t (3 degrees of freedom) features, with 6 outlier
      channels scaled by 20..60 (the outlier features of LLM activations);
    * ``gradients``: Gaussian times ``2**N(-20, 4)`` per element, spread over ~30 binades;
    * ``embedding``: 2048 rows of an embedding table, unit Gaussians times a log-normal row norm
      (frequent tokens have larger rows).
    """
    rng = np.random.default_rng(seed)
    shape = (2048, 512)
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    a = rng.standard_t(3, size=shape).astype(np.float32)
    outliers = rng.choice(shape[1], size=6, replace=False)
    a[:, outliers] *= rng.uniform(20, 60, size=6).astype(np.float32)

    g = rng.standard_normal(shape, dtype=np.float32)
    g *= np.exp2(rng.normal(-20.0, 4.0, size=shape)).astype(np.float32)

    e = rng.standard_normal(shape, dtype=np.float32)
    e *= rng.lognormal(0.0, 0.75, size=(shape[0], 1)).astype(np.float32) * np.float32(0.1)

    src = "default set"
    return [
        Tensor("weights", w, src, "Gaussian weights, std 0.02"),
        Tensor("activations", a, src, "heavy-tailed (Student-t) activations with 6 outlier channels"),
        Tensor("gradients", g, src, "gradients spread over ~30 binades"),
        Tensor("embedding", e, src, "embedding rows with log-normal norms"),
    ]


# -- reading files ------------------------------------------------------------------------------


def _read_safetensors(path: Path):
    """Yield ``(key, thunk)`` for each tensor of a ``.safetensors`` file (header validated first).

    Reading goes through :mod:`qformats._safetensors`, the project's one reader (bfloat16 and fp8
    through ml_dtypes, one tensor at a time).
    """
    header, _ = _safetensors.read_header(path)
    for key in header:
        if key != _safetensors.METADATA_KEY:
            yield key, (lambda key=key: _safetensors.read_tensor(path, key))


def _read_checkpoint_tensors(path: Path):
    """Yield ``(name, thunk)`` for each tensor of a checkpoint (see :func:`qformats.read_checkpoint`);
    a quantized tensor's thunk gives its float32 values."""
    from qformats._checkpoint import QuantizedTensor, read_checkpoint

    for key, t in read_checkpoint(path).items():
        if isinstance(t, QuantizedTensor):
            yield key, (lambda t=t: np.asarray(t.fmt.dequantize(t.data, t.scale, jnp.float32)))
        else:
            yield key, (lambda t=t: t)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def load_tensors(paths: Iterable[str | Path], names: Sequence[str] | None = None):
    """Read every floating-point tensor of ``.npy`` / ``.npz`` / ``.safetensors`` files.

    Files are read without pickle. Returns ``(tensors, problems)``: the problems are messages (one
    per bad file or tensor, each naming it and saying how to fix it); the other tensors are still
    returned. ``names`` keeps only the tensors whose name (or ``file:name``) is listed.
    Non-floating tensors are skipped (a file that holds only such tensors is a problem).
    """
    found: list[tuple[Path, str, object]] = []  # (path, key, thunk)
    problems: list[str] = []
    for p in map(Path, paths):
        if not p.exists():
            problems.append(f"{p}: no such file. Check the path (it is relative to {Path.cwd()}).")
            continue
        if p.is_dir() or p.suffix.lower() == ".gguf":
            # a published checkpoint (folder with config.json / hf_quant_config.json, or .gguf):
            # quantized weights are analysed as the values the checkpoint holds (dequantized)
            try:
                for key, thunk in _read_checkpoint_tensors(p):
                    found.append((p, key, thunk))
            except Exception as e:
                problems.append(
                    f"{p}: cannot read it as a checkpoint folder or .gguf file: {_reason(e)}. "
                    f"Pass a checkpoint folder, a .gguf file, or .npy/.npz/.safetensors files."
                )
            continue
        suffix = p.suffix.lower()
        try:
            if suffix == ".npy":
                arr = np.load(p, allow_pickle=False)
                found.append((p, p.stem, lambda arr=arr: arr))
            elif suffix == ".npz":
                with np.load(p, allow_pickle=False) as z:
                    for key in z.files:
                        try:
                            arr = z[key]
                        except Exception as e:
                            problems.append(
                                f"{p}:{key}: cannot read this array ({_reason(e)}). Save it again with np.savez."
                            )
                            continue
                        found.append((p, key, lambda arr=arr: arr))
            elif suffix == ".safetensors":
                for key, thunk in _read_safetensors(p):
                    found.append((p, key, thunk))
            else:
                problems.append(
                    f"{p}: unsupported file type {suffix or '(none)'!r}; pass .npy, .npz or .safetensors files."
                )
        except Exception as e:
            kind = {".npy": "a .npy file (np.save)", ".npz": "a .npz archive (np.savez)"}.get(
                suffix, "a .safetensors file"
            )
            problems.append(f"{p}: cannot read it as {kind}: {_reason(e)}. Is the file complete and of that type?")

    counts: dict[str, int] = {}
    for _, key, _ in found:
        counts[key] = counts.get(key, 0) + 1
    wanted = set(names or ())
    matched: set[str] = set()
    tensors: list[Tensor] = []
    floats_per_file: dict[Path, int] = {}
    others_per_file: dict[Path, list[str]] = {}
    for p, key, thunk in found:
        qualified = f"{p.name}:{key}"
        name = key if counts[key] == 1 else qualified
        hit = {key, qualified, name, f"{p}:{key}"} & wanted
        if wanted and not hit:
            continue
        matched |= hit
        try:
            arr = np.asarray(thunk())
        except Exception as e:
            problems.append(f"{p}:{key}: cannot read this tensor: {_reason(e)}.")
            continue
        if not _is_float(arr.dtype):
            others_per_file.setdefault(p, []).append(f"{key} ({arr.dtype})")
            if wanted:
                problems.append(
                    f"{p}:{key}: has dtype {arr.dtype}, not floating point, so no format applies. "
                    f"Convert it (x.astype(np.float32)) or select a floating tensor with --tensor."
                )
            continue
        floats_per_file[p] = floats_per_file.get(p, 0) + 1
        tensors.append(Tensor(name, arr, str(p)))
    if not wanted:
        for p, others in others_per_file.items():
            if not floats_per_file.get(p):
                problems.append(
                    f"{p}: holds no floating-point tensor (found {', '.join(others)}), so there is nothing "
                    f"to analyse. Save the float weights/activations (x.astype(np.float32)) instead."
                )
    for missing in sorted(wanted - matched):
        available = ", ".join(sorted({k if counts[k] == 1 else f"{p.name}:{k}" for p, k, _ in found})) or "none"
        problems.append(f"--tensor {missing}: no tensor of that name in the given files. Available: {available}.")
    return tensors, problems


def _reason(e: BaseException) -> str:
    msg = str(e).strip() or type(e).__name__
    return msg.rstrip(".")


# -- formats ------------------------------------------------------------------------------------


def _has_axis(fmt) -> bool:
    return hasattr(fmt, "axis") and hasattr(fmt, "replace")


def resolve_formats(names: Iterable[str | ScaledFormat] | None = None, axis: int | None = None):
    """Formats for ``names`` (default: every registered one) with ``axis`` applied where they have
    one. Returns ``(formats, problems)``; an unknown name is a problem, the others are kept."""
    problems: list[str] = []
    formats: list[ScaledFormat] = []
    for n in list_formats() if names is None else names:
        try:
            fmt = get_format(n.strip() if isinstance(n, str) else n)
        except (KeyError, TypeError) as e:
            problems.append(f"--formats: {_reason(e)}.")
            continue
        if axis is not None and _has_axis(fmt):
            fmt = fmt.replace(axis=axis)
        if fmt not in formats:
            formats.append(fmt)
    return formats, problems


# -- measuring ----------------------------------------------------------------------------------


def _half_step_at_max(element) -> float:
    try:
        return float(np.max(element.half_step(np.float64(element.max_value))))
    except Exception:
        return 0.0


def _roundtrip_fn(fmt):
    def roundtrip(data, scale):
        return fmt.dequantize(data, scale), fmt.decode(data)

    return roundtrip


def _compile(fmt, shape):
    """AOT-compile ``quantize`` and the round trip for float32 ``shape`` (XLA compiles in parallel)."""
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    try:
        fmt.block_shape(shape)
        q = jax.jit(fmt.quantize).lower(spec)
        rt = jax.jit(_roundtrip_fn(fmt)).lower(*q.out_info)
        return q.compile(), rt.compile()
    except Exception as e:  # the format cannot hold this shape
        return e


def _reference(x):
    xd = np.asarray(x, np.float64).ravel()
    return xd, np.abs(xd), xd != 0, float(np.dot(xd, xd))


def measure(x: np.ndarray, fmt: ScaledFormat, *, repeats: int = 3, compiled=None, ref=None) -> dict:
    """The metrics of one float32 array under one format (see the module docstring)."""
    x = np.asarray(x, np.float32)
    if compiled is None:
        compiled = _compile(fmt, x.shape)
        if isinstance(compiled, Exception):
            raise compiled
    q, rt = compiled
    xj = jax.device_put(x)
    out = jax.block_until_ready(q(xj))
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(q(xj))
        times.append(time.perf_counter() - t0)
    nbytes = sum(np.dtype(leaf.dtype).itemsize * math.prod(leaf.shape) for leaf in jax.tree.leaves(out))
    y, elems = (np.asarray(a).ravel() for a in rt(*out))

    if ref is None:
        ref = _reference(x)
    xd, ax, nz, signal = ref
    err = xd - y
    noise = float(np.dot(err, err))
    exact = noise == 0.0
    if exact:
        sqnr = math.inf
    elif signal == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(signal / noise) if math.isfinite(noise) else math.nan
    ae = np.abs(err, out=err)
    max_rel = float(np.max(np.divide(ae, ax, out=np.zeros_like(ae), where=nz), initial=0.0))
    size = max(x.size, 1)
    mx = float(fmt.max_value)
    at_max = np.abs(elems) == np.float32(mx)
    sat = np.count_nonzero(ax[at_max] > np.abs(y[at_max]) * (1.0 + _half_step_at_max(fmt.element) / mx))
    flushed = np.count_nonzero(nz & (y == 0))
    return {
        "bits_per_element": 8.0 * nbytes / size,
        "sqnr_db": sqnr,
        "exact": exact,
        "max_rel_error": max_rel,
        "saturated_fraction": sat / size,
        "flushed_fraction": flushed / size,
        "quantize_seconds": statistics.median(times),
    }


# -- the comparison -----------------------------------------------------------------------------


@dataclass
class CompareResult:
    """Output of :func:`compare`.

    ``records``: one dict per (tensor, format) with keys ``tensor``, ``source``, ``shape``,
    ``dtype``, ``format``, ``axis``, ``applicable``, ``reason``, ``bits_per_element``, ``sqnr_db``,
    ``exact``, ``max_rel_error``, ``saturated_fraction``, ``flushed_fraction``,
    ``quantize_seconds``, ``recommended`` and ``recommended_overall``.
    ``recommendations``: tensor name -> recommended format name (or ``None``).
    ``overall``: the one format for every tensor (or ``None``). ``problems``: input problems.
    """

    records: list[dict]
    recommendations: dict[str, str | None]
    overall: str | None
    min_sqnr: float
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> list[dict]:
        """The records with non-finite SQNR as ``None`` (valid JSON); ``exact`` tells why."""
        out = []
        for r in self.records:
            r = dict(r)
            if r["sqnr_db"] is not None and not math.isfinite(r["sqnr_db"]):
                r["sqnr_db"] = None
            out.append(r)
        return out


def _clears(r, min_sqnr) -> bool:
    s = r["sqnr_db"]
    return r["applicable"] and s is not None and not math.isnan(s) and s >= min_sqnr


def compare(
    tensors: Sequence[Tensor] | dict | None = None,
    formats: Iterable[str | ScaledFormat] | None = None,
    *,
    axis: int | None = None,
    min_sqnr: float = DEFAULT_MIN_SQNR,
    repeats: int = 3,
    progress: bool = False,
) -> CompareResult:
    """Measure every tensor under every format and recommend the cheapest format that is good enough.

    Args:
        tensors: :class:`Tensor` objects, or a dict name -> array; default: :func:`default_tensors`.
        formats: format names or :class:`ScaledFormat` values; default: every registered format.
        axis: the block / channel axis for formats that have one (default: each format's own).
        min_sqnr: the SQNR in dB a format must reach to be recommended.
        repeats: warm timed runs of ``quantize`` (the median is reported).
        progress: show a tqdm progress bar (if tqdm is installed).

    Returns:
        A :class:`CompareResult`. Unknown format names are listed in ``problems``.
    """
    if tensors is None:
        tensors = default_tensors()
    elif isinstance(tensors, dict):
        tensors = [Tensor(k, np.asarray(v)) for k, v in tensors.items()]
    fmts, problems = resolve_formats(formats, axis)
    tensors = list(tensors)

    prepared = []
    for t in tensors:
        arr = np.asarray(t.array)
        if not _is_float(arr.dtype):
            problems.append(f"{t.name}: dtype {arr.dtype} is not floating point; convert it with x.astype(np.float32).")
            continue
        x = arr.astype(np.float32)
        bad = ~np.isfinite(x)
        if bad.any():
            problems.append(
                f"{t.name}: holds {int(bad.sum())} NaN/Inf value(s); they were replaced by 0 for the analysis. "
                f"Fix the tensor at its source (or clip it) to analyse it as is."
            )
            x = np.where(bad, np.float32(0), x)
        prepared.append((t, arr.dtype, x))

    # Compile every (format, shape) pair up front, two at a time: XLA compiles outside the GIL.
    pairs = list(dict.fromkeys((f, x.shape) for _, _, x in prepared for f in fmts))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        compiled = dict(zip(pairs, pool.map(lambda p: _compile(*p), pairs), strict=True))

    items = prepared
    if progress:
        try:
            from tqdm import tqdm

            items = tqdm(prepared, desc="tensors", unit="tensor", leave=False, disable=None)
        except ImportError:
            pass
    records = []
    for t, dtype, x in items:
        ref = None
        for fmt in fmts:
            rec = {
                "tensor": t.name,
                "source": t.source,
                "shape": list(x.shape),
                "dtype": str(dtype),
                "format": fmt.name,
                "axis": getattr(fmt, "axis", None),
                "applicable": True,
                "reason": None,
            }
            c = compiled[(fmt, x.shape)]
            if isinstance(c, Exception):
                reason = f"{fmt.name} does not fit {t.name} {tuple(x.shape)}: {_reason(c)}"
                rec.update(applicable=False, reason=reason, bits_per_element=None, sqnr_db=None, exact=False)
                rec.update(max_rel_error=None, saturated_fraction=None, flushed_fraction=None, quantize_seconds=None)
                problems.append(reason + ".")
            else:
                if ref is None:
                    ref = _reference(x)
                rec.update(measure(x, fmt, repeats=repeats, compiled=c, ref=ref))
            rec["recommended"] = False
            rec["recommended_overall"] = False
            records.append(rec)

    recommendations: dict[str, str | None] = {}
    for t, _, _ in prepared:
        ok = [r for r in records if r["tensor"] == t.name and _clears(r, min_sqnr)]
        best = min(ok, key=lambda r: (r["bits_per_element"], -r["sqnr_db"]), default=None)
        recommendations[t.name] = best["format"] if best else None
        if best:
            best["recommended"] = True

    overall = None
    names = [t.name for t, _, _ in prepared]
    if names:
        totals = []
        for fmt in fmts:
            rs = [r for r in records if r["format"] == fmt.name and r["axis"] == getattr(fmt, "axis", None)]
            if len(rs) == len(names) and all(_clears(r, min_sqnr) for r in rs):
                bits = sum(r["bits_per_element"] * math.prod(r["shape"]) for r in rs)
                totals.append((bits, -min(r["sqnr_db"] for r in rs), fmt.name))
        if totals:
            overall = min(totals)[2]
            for r in records:
                r["recommended_overall"] = r["format"] == overall
    return CompareResult(records, recommendations, overall, float(min_sqnr), problems)
