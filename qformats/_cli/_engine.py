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
* ``overflow_fraction``: fraction of all elements (all finite) whose round trip is ``inf`` or NaN;
* ``quantize_seconds``: the median wall time of a few warm runs of ``jax.jit(fmt.quantize)``.

A format is *acceptable* for a tensor when its SQNR is at least ``min_sqnr``, it flushes at most
``max_flushed`` and saturates at most ``max_saturated`` of the elements, and nothing overflows;
otherwise ``rejected_because`` says why. SQNR alone is not enough: it is dominated by the largest
values, so a format can reach it while flushing most small values to zero (NVFP4 on gradients that
span many decades). The recommendation for a tensor is the acceptable format with the fewest bits
per element (ties go to the higher SQNR); the overall recommendation is the format with the fewest
total bits over all tensors among those acceptable on every tensor.

A format that cannot hold a tensor (for example a blocked format whose block size does not divide
the tensor's axis) yields a record with ``applicable: False`` and the reason.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import jax
import jax.numpy as jnp
import numpy as np

from qformats import _safetensors
from qformats._format import ScaledFormat
from qformats._registry import get_format, list_formats

__all__ = ["CompareResult", "InputProblem", "Tensor", "compare", "default_tensors", "load_tensors"]

DEFAULT_MIN_SQNR = 25.0
#: Largest share of the elements a recommended format may flush to zero (5%) / saturate (1%). An
#: 8-bit uniform grid (int8, MXINT8) rounds ~1% of Gaussian weights to zero and MXFP6 E2M3 ~2%: that
#: is ordinary rounding, so the flush limit sits above it, and far below the 40-80% that FP8 / FP4
#: formats flush on gradients spread over many decades.
DEFAULT_MAX_FLUSHED = 0.05
DEFAULT_MAX_SATURATED = 0.01


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


def _npy_header(fp, where):
    """``(shape, dtype)`` from the header of the ``.npy`` stream ``fp`` (left just after the header), or
    ``None`` for a header version NumPy has no public reader for. Raises :class:`InputProblem`."""
    from numpy.lib import format as npf

    try:
        version = npf.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = npf.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = npf.read_array_header_2_0(fp)
        else:
            return None
    except (ValueError, SyntaxError, TypeError) as e:
        raise InputProblem(
            f"{where}: cannot read it: not a valid .npy array header ({_reason(e)}). Save it again with np.save."
        ) from None
    return tuple(shape), np.dtype(dtype)


def _check_npy(fp, nbytes: int, where: str) -> None:
    """Refuse a ``.npy`` stream of ``nbytes`` whose header declares more (or fewer) data bytes than it
    holds, before NumPy allocates the declared array (it allocates first, then reads)."""
    header = _npy_header(fp, where)
    if header is None:
        return
    shape, dtype = header
    if dtype.hasobject:
        return  # np.load(allow_pickle=False) refuses it with its own message
    want = math.prod(shape) * dtype.itemsize
    have = nbytes - fp.tell()
    if want != have:
        raise InputProblem(
            f"{where}: cannot read it: the array header says shape {shape} of {dtype} ({want} bytes of data) but "
            f"the file holds {have} bytes after it. The file is corrupted or was not written completely; save it again."
        )


# deflate expands at most ~1032:1; a member declaring more is corrupted (or a zip bomb)
_MAX_DEFLATE_RATIO = 1100


def _npz_problems(path: Path) -> dict[str, str]:
    """``{key: message}`` for the members of a ``.npz`` archive whose declared sizes do not add up."""
    import zipfile

    out = {}
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            key = info.filename[: -len(".npy")]
            where = f"{path}:{key}"
            if (info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size) or (
                info.compress_type == zipfile.ZIP_DEFLATED
                and info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 4096
            ):
                out[key] = (
                    f"{where}: cannot read it: the archive says this member expands from {info.compress_size} to "
                    f"{info.file_size} bytes, which its compression cannot do. The archive is corrupted; save it "
                    "again with np.savez."
                )
                continue
            try:
                with zf.open(info) as fp:
                    _check_npy(fp, info.file_size, where)
            except InputProblem as e:
                out[key] = str(e)
    return out


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
    seen: dict[tuple[int, int], str] = {}  # file identity -> the path it was first given as
    for given in paths:
        p = Path(given)
        if not p.exists():
            problems.append(f"{p}: no such file. Check the path (it is relative to {Path.cwd()}).")
            continue
        st = p.stat()
        ident = (st.st_dev, st.st_ino)
        if ident in seen:
            problems.append(
                f"{seen[ident]}: given more than once (again as {os.fspath(given)}); it is analysed once. "
                f"Pass each file once."
            )
            continue
        seen[ident] = os.fspath(given)
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
                with open(p, "rb") as fp:
                    _check_npy(fp, os.fstat(fp.fileno()).st_size, str(p))
                arr = np.load(p, allow_pickle=False)
                found.append((p, p.stem, lambda arr=arr: arr))
            elif suffix == ".npz":
                bad = _npz_problems(p)
                with np.load(p, allow_pickle=False) as z:
                    for key in z.files:
                        if key in bad:
                            problems.append(bad[key])
                            continue
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
        except InputProblem as e:
            problems.append(str(e))
        except Exception as e:
            kind = {".npy": "a .npy file (np.save)", ".npz": "a .npz archive (np.savez)"}.get(
                suffix, "a .safetensors file"
            )
            problems.append(f"{p}: cannot read it as {kind}: {_reason(e)}. Is the file complete and of that type?")

    display = _tensor_names([(p, key) for p, key, _ in found])
    wanted = set(names or ())
    matched: set[str] = set()
    tensors: list[Tensor] = []
    floats_per_file: dict[Path, int] = {}
    others_per_file: dict[Path, list[str]] = {}
    for (p, key, thunk), name in zip(found, display, strict=True):
        hit = {key, name, f"{p.name}:{key}", f"{p}:{key}"} & wanted
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
        available = ", ".join(sorted(set(display))) or "none"
        problems.append(f"--tensor {missing}: no tensor of that name in the given files. Available: {available}.")
    return tensors, problems


def _tensor_names(found: Sequence[tuple[Path, str]]) -> list[str]:
    """A distinct display name for each ``(file, key)``.

    A key held by one file is the name. A key held by several files is qualified by the shortest
    trailing part of the file paths that tells them apart (``a/w.npy`` and ``b/w.npy``, or
    ``x.npz:w`` and ``y.npz:w``); for ``.npy`` files, whose key is their stem, the path alone.
    """
    groups: dict[str, list[Path]] = {}
    for p, key in found:
        groups.setdefault(key, []).append(p)
    suffix: dict[tuple[str, Path], str] = {}
    for key, files in groups.items():
        if len(files) < 2:
            continue
        parts = [p.resolve().parts for p in files]
        for k in range(1, max(map(len, parts)) + 1):
            tails = [PurePosixPath(*ps[-k:]).as_posix() for ps in parts]
            if len(set(tails)) == len(tails):
                break
        for p, tail in zip(files, tails, strict=True):
            suffix[(key, p)] = tail
    names, taken = [], set()
    for p, key in found:
        if (key, p) not in suffix:
            name = key
        elif p.suffix.lower() == ".npy":
            name = suffix[(key, p)]
        else:
            name = f"{suffix[(key, p)]}:{key}"
        base, i = name, 2
        while name in taken:  # a key that happens to equal another tensor's qualified name
            name, i = f"{base} ({i})", i + 1
        taken.add(name)
        names.append(name)
    return names


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
    elif signal == 0.0 or noise == math.inf:  # nothing to measure against, or the round trip overflowed
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(signal / noise)  # NaN if the round trip produced NaN
    ae = np.abs(err, out=err)
    max_rel = float(np.max(np.divide(ae, ax, out=np.zeros_like(ae), where=nz), initial=0.0))
    size = max(x.size, 1)
    mx = float(fmt.max_value)
    at_max = np.abs(elems) == np.float32(mx)
    # in float64, so that |y| near float32's maximum does not overflow
    limit = np.abs(y[at_max]).astype(np.float64) * (1.0 + _half_step_at_max(fmt.element) / mx)
    sat = np.count_nonzero(ax[at_max] > limit)
    flushed = np.count_nonzero(nz & (y == 0))
    overflowed = np.count_nonzero(~np.isfinite(y))
    return {
        "bits_per_element": 8.0 * nbytes / size,
        "sqnr_db": sqnr,
        "exact": exact,
        "max_rel_error": max_rel,
        "saturated_fraction": sat / size,
        "flushed_fraction": flushed / size,
        "overflow_fraction": overflowed / size,
        "quantize_seconds": statistics.median(times),
    }


# -- the comparison -----------------------------------------------------------------------------


@dataclass
class CompareResult:
    """Output of :func:`compare`.

    ``records``: one dict per (tensor, format) with keys ``tensor``, ``source``, ``shape``,
    ``dtype``, ``format``, ``axis``, ``applicable``, ``reason``, ``bits_per_element``, ``sqnr_db``,
    ``exact``, ``max_rel_error``, ``saturated_fraction``, ``flushed_fraction``,
    ``overflow_fraction``, ``quantize_seconds``, ``rejected_because`` (why an applicable format is
    not acceptable, else ``None``), ``recommended`` and ``recommended_overall``.
    ``recommendations``: tensor name -> recommended format name (or ``None``).
    ``overall``: the one format for every tensor (or ``None``). ``problems``: input problems.
    """

    records: list[dict]
    recommendations: dict[str, str | None]
    overall: str | None
    min_sqnr: float
    problems: list[str] = field(default_factory=list)
    max_flushed: float = DEFAULT_MAX_FLUSHED
    max_saturated: float = DEFAULT_MAX_SATURATED

    def to_json(self) -> list[dict]:
        """The records as strict JSON data (``json.dumps(..., allow_nan=False)`` works).

        ``sqnr_db`` is ``None`` when the round trip is exact (``exact`` says so); every other
        non-finite number is the string ``"inf"``, ``"-inf"`` or ``"nan"`` (``float()`` reads them back).
        """
        out = []
        for r in self.records:
            r = {k: _json_number(v) for k, v in r.items()}
            if r["exact"]:
                r["sqnr_db"] = None
            out.append(r)
        return out


def _json_number(v):
    """``v`` with non-finite floats as ``"inf"``, ``"-inf"`` or ``"nan"`` (strict JSON has no such numbers)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list | tuple):
        return [_json_number(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_number(x) for k, x in v.items()}
    return v


def _pct(f: float) -> str:
    return f"{100 * f:.3g}%"


def _rejection(r: dict, min_sqnr: float, max_flushed: float, max_saturated: float) -> str | None:
    """Why the applicable record ``r`` is not acceptable (``None`` if it is); each criterion says which
    limit it broke and the flag that sets it."""
    if not r["applicable"]:
        return None
    why = []
    if r["overflow_fraction"] > 0:
        why.append(f"its round trip overflows to inf/NaN on {_pct(r['overflow_fraction'])} of the values")
    s = r["sqnr_db"]
    if not r["exact"] and not (s >= min_sqnr):  # NaN fails too
        why.append(f"SQNR {s:.2f} dB is below {min_sqnr:g} dB (--min-sqnr)")
    if r["flushed_fraction"] > max_flushed:
        why.append(
            f"flushes {_pct(r['flushed_fraction'])} of the values to zero, more than {_pct(max_flushed)} "
            "(--max-flushed)"
        )
    if r["saturated_fraction"] > max_saturated:
        why.append(
            f"saturates {_pct(r['saturated_fraction'])} of the values at its largest magnitude, more than "
            f"{_pct(max_saturated)} (--max-saturated)"
        )
    return "; ".join(why) or None


def _acceptable(r) -> bool:
    return r["applicable"] and r["rejected_because"] is None


def compare(
    tensors: Sequence[Tensor] | dict | None = None,
    formats: Iterable[str | ScaledFormat] | None = None,
    *,
    axis: int | None = None,
    min_sqnr: float = DEFAULT_MIN_SQNR,
    max_flushed: float = DEFAULT_MAX_FLUSHED,
    max_saturated: float = DEFAULT_MAX_SATURATED,
    repeats: int = 3,
    progress: bool = False,
) -> CompareResult:
    """Measure every tensor under every format and recommend the cheapest format that is good enough.

    Args:
        tensors: :class:`Tensor` objects, or a dict name -> array; default: :func:`default_tensors`.
        formats: format names or :class:`ScaledFormat` values; default: every registered format.
        axis: the block / channel axis for formats that have one (default: each format's own).
        min_sqnr: the SQNR in dB a format must reach to be recommended.
        max_flushed: the largest fraction of the elements (0..1) a recommended format may flush
            to zero (nonzero input, zero output); default 5%.
        max_saturated: the largest fraction of the elements a recommended format may clip at its
            largest magnitude; default 1%.
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
    names = [t.name for t in tensors]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tensor names must be unique, but {', '.join(map(repr, twice))} appear more than once")

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
                rec.update(max_rel_error=None, saturated_fraction=None, flushed_fraction=None)
                rec.update(overflow_fraction=None, quantize_seconds=None)
                problems.append(reason + ".")
            else:
                if ref is None:
                    ref = _reference(x)
                rec.update(measure(x, fmt, repeats=repeats, compiled=c, ref=ref))
            rec["rejected_because"] = _rejection(rec, min_sqnr, max_flushed, max_saturated)
            rec["recommended"] = False
            rec["recommended_overall"] = False
            records.append(rec)

    recommendations: dict[str, str | None] = {}
    for t, _, _ in prepared:
        ok = [r for r in records if r["tensor"] == t.name and _acceptable(r)]
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
            if len(rs) == len(names) and all(_acceptable(r) for r in rs):
                bits = sum(r["bits_per_element"] * math.prod(r["shape"]) for r in rs)
                totals.append((bits, -min(r["sqnr_db"] for r in rs), fmt.name))
        if totals:
            overall = min(totals)[2]
            for r in records:
                r["recommended_overall"] = r["format"] == overall
    return CompareResult(
        records, recommendations, overall, float(min_sqnr), problems, float(max_flushed), float(max_saturated)
    )
