"""Shared helpers: which formats and shapes to benchmark, test data, and in-process ratio timing.

Formats are taken at import time from ``qformats.list_formats()`` (built-ins plus anything an
installed package registers through the ``qformats.formats`` entry-point group) and from the
environment variable ``QFORMATS_BENCH_FORMATS``, a comma-separated list of ``module:attr`` names
whose attribute is a ``ScaledFormat`` (or a callable returning one, or a list of them); ``module`` is
an importable dotted name or a path to a ``.py`` file (asv does not pass PYTHONPATH on), e.g.::

    QFORMATS_BENCH_FORMATS=mypkg.formats:MY_FP8 asv run --python=same --quick
    QFORMATS_BENCH_FORMATS=/path/to/my_formats.py:MY_FP8 asv run --python=same --quick

``QFORMATS_BENCH_SHAPES`` (e.g. ``2048x2048,1024x1024``) overrides the benchmarked shapes and
``QFORMATS_BENCH_ONLY`` (comma-separated names) restricts the formats, and
``QFORMATS_BENCH_SMALL=1`` makes every size tiny (a smoke run).

Nothing here touches a JAX backend at import time: asv forks benchmark processes from the
importing one, and JAX must not be initialised before a fork.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time

import numpy as np

import qformats as qf

# QFORMATS_BENCH_SMALL=1 shrinks every size (tests/test_benchmarks.py runs the suite that way).
SMALL = os.environ.get("QFORMATS_BENCH_SMALL", "") not in ("", "0")
DEFAULT_SHAPES = ("128x256",) if SMALL else ("1024x1024", "4096x1024", "2048x2048")
RATIO_SHAPE = "2048x2048"  # the shape the targets in docs/performance.md refer to
SQNR_SHAPE = "128x256" if SMALL else "256x1024"
MATMUL_SHAPES = ("128x256x256",) if SMALL else ("1024x1024x1024",)  # m x k x n
MODEL_DIMS = (32, 256, 256) if SMALL else (128, 256, 512)  # batch, d_model, d_hidden
DATA_KINDS = ("gaussian", "heavy_tailed_outliers", "log_uniform")


def _import(name: str):
    """A module by dotted name, or from a ``.py`` file path (asv drops PYTHONPATH in its runs)."""
    if name.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(name))
        spec = importlib.util.spec_from_file_location(f"_qformats_bench_{abs(hash(path))}", path)
        if spec is None or not os.path.exists(path):
            raise FileNotFoundError(f"QFORMATS_BENCH_FORMATS names {name!r}, which does not exist")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(name)


def _load_env_formats() -> dict:
    out = {}
    spec = os.environ.get("QFORMATS_BENCH_FORMATS", "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        mod_name, _, attr = item.partition(":")
        if not attr:
            raise ValueError(f"QFORMATS_BENCH_FORMATS entry {item!r} must look like 'module:attribute'")
        obj = getattr(_import(mod_name), attr)
        if callable(obj) and not isinstance(obj, qf.ScaledFormat):
            obj = obj()
        for fmt in [obj] if isinstance(obj, qf.ScaledFormat) else list(obj):
            if not isinstance(fmt, qf.ScaledFormat):
                raise TypeError(f"QFORMATS_BENCH_FORMATS entry {item!r} is not a qformats.ScaledFormat: {fmt!r}")
            out[fmt.name] = fmt
    return out


def _formats() -> dict:
    fmts = {name: qf.get_format(name) for name in qf.list_formats()}
    fmts.update(_load_env_formats())
    only = os.environ.get("QFORMATS_BENCH_ONLY", "").strip()
    if only:
        keep = {s.strip().lower() for s in only.split(",") if s.strip()}
        fmts = {k: v for k, v in fmts.items() if k.lower() in keep}
    return fmts


FORMATS = _formats()
FORMAT_NAMES = list(FORMATS)


def _shapes():
    spec = os.environ.get("QFORMATS_BENCH_SHAPES", "").strip()
    return [s.strip() for s in spec.split(",") if s.strip()] if spec else list(DEFAULT_SHAPES)


SHAPES = _shapes()


def parse_shape(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in s.lower().split("x"))


def get_format(name: str, shape=None):
    """The format called ``name``; with ``shape``, skip (asv's NotImplementedError) if it cannot hold it."""
    fmt = FORMATS[name] if name in FORMATS else qf.get_format(name)
    if shape is not None:
        try:
            fmt.block_shape(tuple(shape))
        except ValueError as e:
            raise NotImplementedError(f"{name} cannot quantize shape {shape}: {e}") from e
    return fmt


def make_data(kind: str, shape, seed: int = 0) -> np.ndarray:
    """Test data, float32. ``kind`` is one of :data:`DATA_KINDS`."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        x = rng.standard_normal(shape)
    elif kind == "heavy_tailed_outliers":
        # Student-t (3 degrees of freedom) with a few channels (last axis) 100x larger, as in LLM
        # activations.
        x = rng.standard_t(3, size=shape)
        n = shape[-1]
        outliers = rng.choice(n, size=max(1, n // 128), replace=False)
        x[..., outliers] *= 100.0
    elif kind == "log_uniform":
        x = np.exp2(rng.uniform(-30.0, 0.0, size=shape)) * rng.choice([-1.0, 1.0], size=shape)
    else:
        raise ValueError(f"unknown data kind {kind!r}; choose one of {DATA_KINDS}")
    return x.astype(np.float32)


def sqnr_db(x, y) -> float:
    """Signal-to-quantization-noise ratio in dB (capped at 300 dB for an exact round trip)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    noise = np.sum((x - y) ** 2)
    signal = np.sum(x**2)
    if not np.isfinite(noise):
        return float("nan")
    if noise == 0:
        return 300.0
    return float(min(300.0, 10.0 * np.log10(signal / noise)))


def block(out):
    import jax

    return jax.block_until_ready(out)


def interleaved_ratio(fn, args, ref, ref_args, repeats: int = 31) -> float:
    """Median time of ``fn(*args)`` over median time of ``ref(*ref_args)``, runs interleaved.

    Both are warmed first; interleaving makes both see the same machine load, so the ratio
    compares across machines of different speed.
    """
    if SMALL:
        repeats = 1
    for _ in range(1 if SMALL else 3):
        block(fn(*args))
        block(ref(*ref_args))
    t_fn, t_ref = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn(*args))
        t1 = time.perf_counter()
        block(ref(*ref_args))
        t2 = time.perf_counter()
        t_fn.append(t1 - t0)
        t_ref.append(t2 - t1)
    return float(np.median(t_fn) / np.median(t_ref))


def times_two():
    """The reference pass: ``x * 2`` under jit (read 4 bytes, write 4 bytes per element)."""
    import jax

    return jax.jit(lambda a: a * 2)


def scalify_or_skip():
    """``(scalify, as_scaled_array)``, or raise asv's NotImplementedError (a clean skip)."""
    try:
        import scalify
    except ImportError as e:  # pragma: no cover
        raise NotImplementedError(f"scalify is not importable: {e}") from e
    fn = getattr(scalify, "scalify", None)
    as_scaled = getattr(scalify, "as_scaled_array", None)
    if fn is None or as_scaled is None:
        raise NotImplementedError("scalify.scalify / scalify.as_scaled_array are not available yet")
    return fn, as_scaled
