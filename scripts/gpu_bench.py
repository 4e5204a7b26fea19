"""Scaled matmuls and quantize kernels on an accelerator, in one short run (a few minutes on an H100).

    PYTHONPATH=. python3 scripts/gpu_bench.py --out OUT_DIR          # 8192 x 8192 operands
    python scripts/gpu_bench.py --small --out OUT_DIR                 # tiny sizes: a smoke test (CPU)
    python scripts/gpu_bench.py --only quantize --n 4096 --out OUT_DIR

``--budget`` (default 270 s) skips whatever is left once that much time has passed (the section
under way finishes its current item), so a run stays within a device time limit.

What it measures, section by section (each is guarded: a failing section prints its traceback and
the run goes on to the next one):

1. **environment**: Python, jax / jaxlib and plugin versions, devices, ``nvidia-smi``'s driver and
   CUDA versions.
2. **per-tensor FP8 matmul** (``n x n x n``, default n = 8192): ``scalify.scalify(jnp.matmul)`` of
   two ``qformats.FP8_E4M3`` operands under ``ScalifyConfig(contraction="native")``, against a
   ``lax.dot_general`` of bfloat16 copies (float32 accumulation) and a raw ``float8_e4m3fn``
   ``dot_general`` (float32 accumulation). Median time, TFLOP/s (``2 n^3 / t``), ratio to bfloat16,
   whether the StableHLO JAX emits has a ``dot_general`` of float8 operands, and the GEMM lines of
   the optimized HLO: is there still an FP8 GEMM after XLA's rewrites (a cuBLAS-Lt ``$f8`` custom
   call, or a ``dot`` with ``f8e4m3fn`` operands, e.g. inside a Triton GEMM fusion)?
3. **MXFP8 matmul**: activations ``qformats.MXFP8``, weights ``MXFP8.replace(axis=0)`` (both blocked
   along K), under ``contraction="dequantize"``, ``"auto"`` and ``"scaled_dot"``, ratio to bfloat16.
   The scaled variants of sections 2-3 run under the default ``renormalize="amax"`` (the output
   leaving the program is settled on its measured amax: a reduction and a rescale of the output)
   and, marked ``static``, under ``renormalize="static"`` (no settle).
4. **quantize kernels**: ``jax.jit(fmt.quantize)`` and ``jax.jit(fmt.dequantize)`` of every format
   in ``qformats.list_formats()`` on an ``n x n`` float32 array, as a ratio to ``x * 2`` under jit
   on the same array (interleaved medians), with the bandwidth of ``x * 2`` (8 bytes per element).
   Each quantize is also compiled with the backend's own float32 division (qformats repairs it to
   the correctly rounded quotient off the CPU): its time against the repaired one (the repair's
   cost) and how many data/scale entries the repair moved.
5. **correctness**: for every matmul of sections 2-3, ``max|out - ref| / max|ref|`` where ``ref``
   is the float32 matmul (``Precision.HIGHEST``) of the dequantized operands (reported, not checked).

A ``ScalifyConfig`` that does not know ``contraction`` (an older checkout) falls back to the
default config; the results say so. Every compiled function is traced, lowered and compiled
inside its config's context; timings are medians of runs interleaved with their baseline, after
warm-up, around ``jax.block_until_ready``. Results are printed as they come and written to
``OUT/gpu_bench.json`` and ``OUT/gpu_bench.md`` (markdown tables) after every section, so a run
cut short still leaves what it measured; the optimized HLO of each matmul goes to ``OUT/hlo/``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

try:  # the environment and the raw GEMMs are still measured if the packages fail to import
    import qformats as qf
    import scalify
    from qformats import _fmt_common

    IMPORT_ERROR = None
except Exception:
    qf = scalify = _fmt_common = None
    IMPORT_ERROR = traceback.format_exc()

DIMS = (((1,), (0,)), ((), ()))  # a plain (m, k) x (k, n) matmul
FP8_DTYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e8m0", "f4e2m1fn")


class Bench:
    """Options, the results so far, and the shared operands (built on first use)."""

    def __init__(self, args):
        self.n = args.n or (256 if args.small else 8192)
        self.small = args.small
        self.repeats = args.repeats or (3 if args.small else 15)
        self.warmup = 1 if args.small else 3
        self.budget = args.budget
        self.variants = args.variants
        self.out = args.out
        self.t0 = time.perf_counter()
        self.results = {
            "meta": {
                "script": "scripts/gpu_bench.py",
                "argv": sys.argv[1:],
                "n": self.n,
                "repeats": self.repeats,
                "warmup": self.warmup,
                "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            },
            "sections": {},
        }
        self._cache = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.budget > 0 and self.elapsed() > self.budget

    def cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # Operands -------------------------------------------------------------------------------------

    def gaussians(self):
        def make():
            ka, kb = jax.random.split(jax.random.key(0))
            shape = (self.n, self.n)
            return jax.block_until_ready((jax.random.normal(ka, shape), jax.random.normal(kb, shape)))

        return self.cached("gaussians", make)

    def bf16_dot(self):
        """The baseline: a jitted bfloat16 ``dot_general`` accumulating in float32, and its operands."""

        def make():
            a, b = self.gaussians()
            fn = jax.jit(lambda x, y: jax.lax.dot_general(x, y, DIMS, preferred_element_type=jnp.float32))
            args = jax.block_until_ready((a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)))
            compiled = fn.lower(*args).compile()
            return compiled, args

        return self.cached("bf16_dot", make)

    def reference(self, key, A, B, rhs_transposed=False):
        """float32 ``A.to_array() @ B.to_array()`` (``@ B.to_array().T`` for an (N, K) rhs) at
        ``Precision.HIGHEST`` (one per operand pair)."""

        def make():
            def ref(x, y):
                y = y.to_array(jnp.float32)
                return jnp.matmul(x.to_array(jnp.float32), y.T if rhs_transposed else y, precision="highest")

            return jax.block_until_ready(jax.jit(ref)(A, B))

        return self.cached(("ref", key), make)

    # Output ---------------------------------------------------------------------------------------

    def save(self):
        os.makedirs(self.out, exist_ok=True)
        self.results["meta"]["elapsed_s"] = round(self.elapsed(), 2)
        with open(os.path.join(self.out, "gpu_bench.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        with open(os.path.join(self.out, "gpu_bench.md"), "w") as f:
            f.write(markdown(self.results))

    def save_hlo(self, name: str, text: str) -> str:
        d = os.path.join(self.out, "hlo")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".txt")
        with open(path, "w") as f:
            f.write(text)
        return os.path.relpath(path, self.out)


def log(*parts):
    print(*parts, flush=True)


# Timing ---------------------------------------------------------------------------------------------


def interleaved_times(calls: dict, repeats: int, warmup: int) -> dict:
    """Median wall time (s) of each ``name: (fn, args)``, runs interleaved, after ``warmup`` rounds."""
    for _ in range(warmup):
        for fn, args in calls.values():
            jax.block_until_ready(fn(*args))
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def compile_in(config_ctx, fn, *args):
    """``fn`` jitted, traced, lowered and compiled inside ``config_ctx``; (compiled, seconds, lowered).

    ``fn`` is wrapped in a fresh function first: ``jax.jit`` caches traces by function, and the
    config is no part of that cache's key, so a second config would otherwise get the first trace.
    """
    t = time.perf_counter()
    with config_ctx:
        lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
        compiled = lowered.compile()
    return compiled, time.perf_counter() - t, lowered


def emitted_dots(lowered) -> list:
    """Type signatures of the ``dot_general`` / GEMM custom calls in the StableHLO JAX emitted.

    This is the program before XLA's rewrites: whether the dot scalify built takes float8 operands,
    whatever the backend then makes of it (XLA:CPU upcasts them; XLA:GPU may call cuBLAS-Lt FP8).
    """
    sigs = []
    for line in lowered.as_text().splitlines():
        if "stablehlo.dot_general" in line or ("custom_call" in line and _GEMM_TARGET.search(line)):
            sig = line.rsplit(" : ", 1)[-1].strip()
            if sig not in sigs:
                sigs.append(sig[:300])
    return sigs


def f8_emitted(sigs: list) -> bool:
    """Whether an emitted dot takes a float8 / float4 operand (its input types, before ``->``)."""
    return any(re.search(r"x(f8|f4)E", sig.split("->", 1)[0]) for sig in sigs)


def scalify_config(contraction: str):
    """``(ScalifyConfig(...), note)`` for a spec ``"STRATEGY[+fast][+static]"``; the default config and
    a note where the checkout does not know an option. ``+fast`` sets ``fast_accumulation=True``,
    ``+static`` sets ``renormalize="static"`` (no measured settle of the outputs)."""
    strategy, *flags = contraction.split("+")
    kwargs = {"contraction": strategy}
    if "fast" in flags:
        kwargs["fast_accumulation"] = True
    if "static" in flags:
        kwargs["renormalize"] = "static"
    try:
        return scalify.ScalifyConfig(**kwargs), None
    except (TypeError, ValueError) as e:
        return scalify.ScalifyConfig(), f"ScalifyConfig({kwargs}) unsupported ({e}): default config used"


# HLO ------------------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z][a-z0-9]*)\[")
_OPERANDS = re.compile(r"\b(?:dot|custom-call|fusion)\(([^)]*)\)")
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas|cudnn|triton", re.IGNORECASE)


def gemm_lines(hlo: str, limit: int = 12, width: int = 300) -> list:
    """GEMM lines of an optimized HLO module, each with its operands' element types appended.

    A GEMM line is a ``dot``, a custom call to cuBLAS / cuDNN / a GEMM, or a fusion whose backend
    config names a GEMM (Triton, cuBLAS). Operand types are looked up from the defining lines
    (instruction names are unique in a module); metadata is stripped and lines trimmed to ``width``.
    """
    dtypes = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m:
            dtypes[m.group(1)] = m.group(2)
    out = []
    for line in hlo.splitlines():
        text = line.strip()
        if text.startswith(("HloModule", "//")) or not _OPERANDS.search(text):
            continue
        op = _OPERANDS.search(text)
        is_dot = " dot(" in text
        is_call = "custom-call(" in text and _GEMM_TARGET.search(text.split("custom_call_target=", 1)[-1][:80])
        is_fusion = "fusion(" in text and re.search(r"gemm|triton|cublas|cudnn", text, re.IGNORECASE)
        if not (is_dot or is_call or is_fusion):
            continue
        names = re.findall(r"%([\w.\-]+)", op.group(1)) or [o.strip() for o in op.group(1).split(",")]
        types = [dtypes.get(n, "?") for n in names]
        text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
        text = re.sub(r",?\s*backend_config=.*$", ", backend_config=...", text)
        text = text[:width] + (" ..." if len(text) > width else "")
        out.append(f"{text}  [operands: {' x '.join(types)}]")
        if len(out) >= limit:
            break
    return out


def fp8_gemm_found(lines: list) -> bool:
    """Whether a ``dot`` or GEMM custom call contracts FP8 (or FP4) operands (or is cuBLAS-Lt ``$f8``).

    Fusion lines are not counted: a Triton GEMM fusion may read f8 operands and convert them before
    its ``dot``, whose own line (inside the fused computation) tells.
    """
    for line in lines:
        if not (" dot(" in line or "custom-call(" in line):
            continue
        operands = line.rsplit("[operands: ", 1)[-1]
        if "$f8" in line or any(d in operands for d in FP8_DTYPES):
            return True
    return False


# Sections -------------------------------------------------------------------------------------------


def section_environment(bench: Bench) -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "jax": jax.__version__}
    if IMPORT_ERROR:
        env["import_error"] = IMPORT_ERROR[-2000:]
    try:
        import jaxlib

        env["jaxlib"] = getattr(jaxlib, "__version__", None) or importlib.metadata.version("jaxlib")
    except Exception as e:
        env["jaxlib"] = f"unknown ({e})"
    env["packages"] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax", "nvidia-", "ml-dtypes", "ml_dtypes", "numpy")):
            env["packages"][name] = dist.version
    env["packages"] = dict(sorted(env["packages"].items()))
    devices = jax.devices()
    env["backend"] = jax.default_backend()
    env["devices"] = [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '?')}" for d in devices]
    env["device_kind"] = getattr(devices[0], "device_kind", "?")
    with contextlib.suppress(Exception):
        env["platform_version"] = devices[0].client.platform_version
    with contextlib.suppress(Exception):
        stats = devices[0].memory_stats() or {}
        env["device_memory_gib"] = round(stats.get("bytes_limit", 0) / 2**30, 1)
    env["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        lines = [ln.strip(" |") for ln in smi.stdout.splitlines() if "Driver Version" in ln or "CUDA Version" in ln]
        env["nvidia_smi"] = lines or (smi.stderr.strip()[:300] or f"rc={smi.returncode}")
        query = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        env["nvidia_smi_gpu"] = query.stdout.strip() or query.stderr.strip()[:300]
    except Exception as e:
        env["nvidia_smi"] = f"not available ({type(e).__name__}: {e})"
    for k, v in env.items():
        log(f"  {k}: {v}")
    return env


def _time_matmuls(bench: Bench, variants: dict, pair_key, A, B, flops: float, rhs_transposed=False) -> list:
    """Compile, check and time the scaled ``variants`` (name -> (contraction, fn)) against bf16."""
    bf16, bf16_args = bench.bf16_dot()
    ref = bench.reference(pair_key, A, B, rhs_transposed)
    ref_max = float(jnp.max(jnp.abs(ref)))
    base = f"bf16 dot_general ({pair_key} section)"
    rows, calls = [], {base: (bf16, bf16_args)}
    seen = {}
    for name, (contraction, fn) in variants.items():
        row = {"variant": name, "contraction": contraction}
        rows.append(row)
        if bench.over_budget():
            row["error"] = "skipped: time budget spent"
            continue
        try:
            config, note = scalify_config(contraction)
            row["effective_contraction"] = "default" if note else contraction
            if note:
                row["note"] = note
                if "default" in seen:  # the same program as a variant already measured
                    row["same_as"] = seen["default"]
                    log(f"  {name}: same program as {seen['default']} ({note})")
                    continue
                seen["default"] = name
            compiled, row["compile_s"], lowered = compile_in(config, fn, A, B)
            row["emitted_dots"] = emitted_dots(lowered)
            row["f8_dot_emitted"] = f8_emitted(row["emitted_dots"])
            hlo = compiled.as_text()
            row["hlo_file"] = bench.save_hlo(f"{pair_key}_{name}", hlo)
            row["gemm_lines"] = gemm_lines(hlo)
            row["fp8_gemm"] = fp8_gemm_found(row["gemm_lines"])
            out = jax.block_until_ready(compiled(A, B))
            row["rel_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / ref_max
            del out
            calls[name] = (compiled, (A, B))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"  {name}: FAILED ({row['error'][:300]})")
            traceback.print_exc()
    if bench.over_budget():
        return rows
    times = interleaved_times(calls, bench.repeats, bench.warmup)
    t_bf16 = times.pop(base)
    rows.append({"variant": base, "time_s": t_bf16, "tflops": flops / t_bf16 / 1e12, "ratio": 1.0})
    for row in rows[:-1]:
        if row["variant"] in times:
            t = times[row["variant"]]
            row.update(time_s=t, tflops=flops / t / 1e12, ratio=t / t_bf16)
    for row in rows:
        if "time_s" in row:
            log(
                f"  {row['variant']:<28} {row['time_s'] * 1e3:9.3f} ms {row['tflops']:8.1f} TFLOP/s "
                f"ratio {row['ratio']:.3f}"
                + (f"  fp8_gemm={row['fp8_gemm']}" if "fp8_gemm" in row else "")
                + (f"  rel_err={row['rel_err']:.2e}" if "rel_err" in row else "")
            )
            for line in row.get("gemm_lines", [])[:4]:
                log(f"      {line[:200]}")
    return rows


def _scaled_matmul(x, y):
    return scalify.scalify(jnp.matmul)(x, y).to_array()


def _scaled_matmul_nt(x, w):
    """``x @ w.T`` with ``w`` stored (N, K), a linear layer's weight: the layout cuBLASLt's FP8
    GEMM takes without a transpose."""
    return scalify.scalify(lambda a, b: a @ b.T)(x, w).to_array()


def need_packages():
    if IMPORT_ERROR:
        last = IMPORT_ERROR.strip().splitlines()[-1]
        raise ImportError(f"qformats / scalify failed to import ({last}); traceback under environment")


def section_fp8_matmul(bench: Bench) -> dict:
    a, b = bench.gaussians()
    a8, b8 = jax.block_until_ready((a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)))
    flops = 2.0 * bench.n**3
    rows = []
    try:
        scaled = {
            "fp8_e4m3 scaled (native)": ("native", _scaled_matmul),
            "fp8_e4m3 scaled (native, fast accumulation)": ("native+fast", _scaled_matmul),
            "fp8_e4m3 scaled (native, static)": ("native+static", _scaled_matmul),
            "fp8_e4m3 scaled (native, fast accumulation, static)": ("native+fast+static", _scaled_matmul),
        }
        if bench.variants is not None:
            scaled = {k: v for k, v in scaled.items() if re.search(bench.variants, k)}
        need_packages()
        A = scalify.as_scaled_array(a, fmt=qf.FP8_E4M3)
        B = scalify.as_scaled_array(b, fmt=qf.FP8_E4M3)
        rows = _time_matmuls(bench, scaled, "fp8", A, B, flops) if scaled else []
        nt = {
            "fp8_e4m3 scaled NT (native)": ("native", _scaled_matmul_nt),
            "fp8_e4m3 scaled NT (native, static)": ("native+static", _scaled_matmul_nt),
            "fp8_e4m3 scaled NT (native, fast accumulation, static)": ("native+fast+static", _scaled_matmul_nt),
        }
        if bench.variants is not None:
            nt = {k: v for k, v in nt.items() if re.search(bench.variants, k)}
        if nt:
            Bt = scalify.as_scaled_array(b.T, fmt=qf.FP8_E4M3)
            rows += _time_matmuls(bench, nt, "fp8nt", A, Bt, flops, rhs_transposed=True)
    except Exception as e:  # the scaled operands or the reference failed: still time the raw GEMM
        rows = [{"variant": "fp8_e4m3 scaled (native)", "contraction": "native", "error": f"{type(e).__name__}: {e}"}]
        log(f"  fp8_e4m3 scaled (native): FAILED ({rows[0]['error'][:300]})")
        traceback.print_exc()

    # Raw FP8 GEMMs: float8_e4m3fn operands straight into dot_general (DEFAULT precision lets XLA use
    # the FP8 GEMM's fast accumulation, HIGHEST does not), with a float32 or bfloat16 result; the
    # rhs as (K, N) (XLA transposes it for cuBLAS) or already (N, K); and the dequantize pattern
    # (convert * scale, then a bf16 dot) that XLA's GEMM rewriter turns into a scaled FP8 GEMM.
    b8t = jax.block_until_ready(b8.T)
    hi = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    tn = (((1,), (1,)), ((), ()))
    s2 = jnp.float32(0.5)

    def pattern(x, y, sx, sy, dtype=jnp.bfloat16, precision=None):
        return jax.lax.dot_general(
            x.astype(dtype) * sx.astype(dtype),
            y.astype(dtype) * sy.astype(dtype),
            DIMS,
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    raws = {
        "raw f8 dot (DEFAULT, f32 out)": (
            lambda x, y: jax.lax.dot_general(x, y, DIMS, preferred_element_type=jnp.float32),
            (a8, b8),
            1.0,
        ),
        "raw f8 dot (HIGHEST, f32 out)": (
            lambda x, y: jax.lax.dot_general(x, y, DIMS, precision=hi, preferred_element_type=jnp.float32),
            (a8, b8),
            1.0,
        ),
        "raw f8 dot (HIGHEST, bf16 out)": (
            lambda x, y: jax.lax.dot_general(x, y, DIMS, precision=hi, preferred_element_type=jnp.bfloat16),
            (a8, b8),
            1.0,
        ),
        "raw f8 dot NT rhs (HIGHEST, f32 out)": (
            lambda x, y: jax.lax.dot_general(x, y, tn, precision=hi, preferred_element_type=jnp.float32),
            (a8, b8t),
            1.0,
        ),
        "raw f8 dot NT rhs (DEFAULT, bf16 out)": (
            lambda x, y: jax.lax.dot_general(x, y, tn, preferred_element_type=jnp.bfloat16),
            (a8, b8t),
            1.0,
        ),
        "f8 dequantize pattern (bf16 dot)": (lambda x, y: pattern(x, y, s2, s2), (a8, b8), 0.25),
        "f8 dequantize pattern (bf16 dot, HIGHEST)": (lambda x, y: pattern(x, y, s2, s2, precision=hi), (a8, b8), 0.25),
        "f8 dequantize pattern (f32 dot)": (lambda x, y: pattern(x, y, s2, s2, jnp.float32), (a8, b8), 0.25),
        "f8 dequantize pattern (f32 dot, HIGHEST)": (
            lambda x, y: pattern(x, y, s2, s2, jnp.float32, hi),
            (a8, b8),
            0.25,
        ),
    }
    if bench.variants is not None:
        raws = {k: v for k, v in raws.items() if re.search(bench.variants, k)}
    ref = jnp.matmul(a8.astype(jnp.float32), b8.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    ref_max = float(jnp.max(jnp.abs(ref)))
    bf16, bf16_args = bench.bf16_dot()
    for name, (fn, args, factor) in raws.items():
        raw = {"variant": name, "contraction": None}
        if bench.over_budget():
            raw["error"] = "skipped: time budget spent"
            rows.append(raw)
            continue
        try:
            compiled, raw["compile_s"], lowered = compile_in(contextlib.nullcontext(), fn, *args)
            raw["emitted_dots"] = emitted_dots(lowered)
            raw["f8_dot_emitted"] = f8_emitted(raw["emitted_dots"])
            hlo = compiled.as_text()
            raw["gemm_lines"] = gemm_lines(hlo)
            raw["fp8_gemm"] = fp8_gemm_found(raw["gemm_lines"])
            out = compiled(*args).astype(jnp.float32) / factor
            raw["rel_err"] = float(jnp.max(jnp.abs(out - ref)) / ref_max)
            del out
            t = interleaved_times({"raw": (compiled, args), "bf16": (bf16, bf16_args)}, bench.repeats, bench.warmup)
            raw.update(time_s=t["raw"], tflops=flops / t["raw"] / 1e12, ratio=t["raw"] / t["bf16"])
            log(
                f"  {raw['variant']:<28} {raw['time_s'] * 1e3:9.3f} ms {raw['tflops']:8.1f} TFLOP/s "
                f"ratio {raw['ratio']:.3f} (to a bf16 run interleaved with it)  fp8_gemm={raw['fp8_gemm']} "
                f"rel_err={raw['rel_err']:.2e}"
            )
            for line in raw["gemm_lines"][:4]:
                log(f"      {line[:200]}")
        except Exception as e:
            raw["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"  {name}: FAILED ({raw['error'][:300]})")
            traceback.print_exc()
        rows.append(raw)
    del ref
    return {"n": bench.n, "rows": rows}


def section_mxfp8_matmul(bench: Bench) -> dict:
    need_packages()
    a, b = bench.gaussians()
    A = scalify.as_scaled_array(a, fmt=qf.MXFP8)
    B = scalify.as_scaled_array(b, fmt=qf.MXFP8.replace(axis=0))
    specs = ("dequantize", "dequantize+static", "auto", "scaled_dot")
    variants = {f"mxfp8 scaled ({c.replace('+', ', ')})": (c, _scaled_matmul) for c in specs}
    if bench.variants is not None:
        variants = {k: v for k, v in variants.items() if re.search(bench.variants, k)}
    rows = _time_matmuls(bench, variants, "mxfp8", A, B, 2.0 * bench.n**3) if variants else []
    return {"n": bench.n, "rows": rows}


def compile_trusting_division(fn, *args):
    """``fn`` compiled with the backend's float32 division taken as it is (qformats repairs it to
    the correctly rounded quotient off the CPU; see docs/numerics.md, "GPU notes")."""
    saved = _fmt_common.IEEE_DIVISION_PLATFORMS
    _fmt_common.IEEE_DIVISION_PLATFORMS = (*saved, "cuda", "rocm")
    jax.clear_caches()  # traces hold the division they were made with
    try:
        return jax.jit(fn).lower(*args).compile()
    finally:
        _fmt_common.IEEE_DIVISION_PLATFORMS = saved
        jax.clear_caches()


def section_quantize(bench: Bench) -> dict:
    need_packages()
    x = bench.gaussians()[0]
    times_two = jax.jit(lambda v: v * 2).lower(x).compile()
    rows = []
    for name in qf.list_formats():
        row = {"format": name}
        rows.append(row)
        if bench.over_budget():
            row["error"] = "skipped: time budget spent"
            continue
        try:
            fmt = qf.get_format(name)
            quantize = jax.jit(fmt.quantize).lower(x).compile()
            data, scale = jax.block_until_ready(quantize(x))
            dequantize = jax.jit(fmt.dequantize).lower(data, scale).compile()
            # the same quantize with the backend's own division, which qformats repairs off the CPU
            trusted = compile_trusting_division(fmt.quantize, x)
            row["repair_moved"] = [
                int(np.sum(np.asarray(u) != np.asarray(v)))
                for u, v in zip(jax.tree.leaves((data, scale)), jax.tree.leaves(trusted(x)), strict=True)
            ]
            t = interleaved_times(
                {"quantize": (quantize, (x,)), "unrepaired": (trusted, (x,)), "x2": (times_two, (x,))},
                max(bench.repeats, 21),
                bench.warmup,
            )
            t2 = interleaved_times(
                {"dequantize": (dequantize, (data, scale)), "x2": (times_two, (x,))},
                max(bench.repeats, 21),
                bench.warmup,
            )
            row.update(
                quantize_s=t["quantize"],
                x2_s=t["x2"],
                quantize_ratio=t["quantize"] / t["x2"],
                unrepaired_s=t["unrepaired"],
                repair_cost=t["quantize"] / t["unrepaired"],
                x2_gbps=8.0 * x.size / t["x2"] / 1e9,
                dequantize_s=t2["dequantize"],
                x2_dq_s=t2["x2"],
                dequantize_ratio=t2["dequantize"] / t2["x2"],
            )
            log(
                f"  {name:<18} quantize {row['quantize_ratio']:6.2f}x  dequantize {row['dequantize_ratio']:6.2f}x"
                f"  division repair {row['repair_cost']:.2f}x (moved {row['repair_moved']})"
                f"  (x*2 {row['x2_s'] * 1e3:.3f} ms, {row['x2_gbps']:.0f} GB/s)"
            )
            del data, scale
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"  {name}: FAILED ({row['error'][:300]})")
            traceback.print_exc()
        bench.save()
    return {"n": bench.n, "rows": rows}


def section_correctness(bench: Bench) -> dict:
    rows = []
    for key in ("fp8_matmul", "mxfp8_matmul"):
        for row in (bench.results["sections"].get(key, {}).get("results") or {}).get("rows", []):
            if "rel_err" in row:
                rows.append({"variant": row["variant"], "rel_err": row["rel_err"]})
                log(f"  {row['variant']:<28} max|out - ref| / max|ref| = {row['rel_err']:.3e}")
    return {"rows": rows, "reference": "float32 jnp.matmul of the dequantized operands, Precision.HIGHEST"}


SECTIONS = {
    "environment": section_environment,
    "fp8_matmul": section_fp8_matmul,
    "mxfp8_matmul": section_mxfp8_matmul,
    "quantize": section_quantize,
    "correctness": section_correctness,
}


# Markdown -------------------------------------------------------------------------------------------


def _f(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def _cell(text: str, width: int = 160) -> str:
    """``text`` as one markdown table cell: one line, no pipes, at most ``width`` characters."""
    text = " ".join(str(text).split()).replace("|", "/")
    return text[:width] + ("..." if len(text) > width else "")


def markdown(results: dict) -> str:
    meta, secs = results["meta"], results["sections"]
    out = ["# gpu_bench results", ""]
    env = (secs.get("environment") or {}).get("results") or {}
    smi = env.get("nvidia_smi")
    out.append(
        f"Device: {env.get('device_kind', '?')} ({env.get('backend', '?')}), jax {env.get('jax', '?')}, "
        f"jaxlib {env.get('jaxlib', '?')}, Python {env.get('python', '?')}"
        + (f"; nvidia-smi: {'; '.join(smi) if isinstance(smi, list) else smi}" if smi else "")
        + f". n = {meta['n']}, median of {meta['repeats']} interleaved runs after {meta['warmup']} warm-up."
    )
    out.append("")
    mm_rows = []
    for key in ("fp8_matmul", "mxfp8_matmul"):
        mm_rows += ((secs.get(key) or {}).get("results") or {}).get("rows", [])
    if mm_rows:
        n = meta["n"]
        out += [
            f"Matmul {n} x {n} x {n} (ratio: median time over the median of the bf16 `dot_general`, "
            "float32 accumulation, interleaved; rel. error: max abs difference to the float32 matmul "
            "of the dequantized operands at HIGHEST precision, over its max):",
            "",
            "| variant | contraction (effective) | time (ms) | TFLOP/s | ratio to bf16 | f8 dot emitted | "
            "FP8 GEMM in optimized HLO | rel. error | compile (s) | note |",
            "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |",
        ]
        for r in mm_rows:
            c = r.get("contraction") or "-"
            eff = r.get("effective_contraction")
            if eff and eff != c:
                c += f" ({eff})"
            status = r.get("error") or (f"same program as {r['same_as']}" if "same_as" in r else "")
            yes_no = lambda v: {True: "yes", False: "no"}.get(v, "-")
            out.append(
                f"| {r['variant']} | {c} | {_f(r.get('time_s', 0) * 1e3 if 'time_s' in r else None, '.3f')} | "
                f"{_f(r.get('tflops'), '.1f')} | {_f(r.get('ratio'), '.2f')} | {yes_no(r.get('f8_dot_emitted'))} | "
                f"{yes_no(r.get('fp8_gemm'))} | "
                f"{_f(r.get('rel_err'), '.1e')} | {_f(r.get('compile_s'), '.1f')} | {_cell(status)} |"
            )
        notes = sorted({r["note"] for r in mm_rows if r.get("note")})
        out += [""] + [f"Note: {s}" for s in notes] + ([""] if notes else [])
    q_rows = ((secs.get("quantize") or {}).get("results") or {}).get("rows", [])
    if q_rows:
        out += [
            f"Quantize / dequantize of a {meta['n']} x {meta['n']} float32 array, ratio to `x * 2` under jit "
            f"(medians of {max(meta['repeats'], 21)} interleaved runs):",
            "",
            "| format | quantize ratio | dequantize ratio | quantize (ms) | dequantize (ms) | x * 2 (ms) "
            "| x * 2 GB/s | note |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in q_rows:
            ms = lambda k, r=r: r[k] * 1e3 if k in r else None
            out.append(
                f"| {r['format']} | {_f(r.get('quantize_ratio'), '.2f')} | {_f(r.get('dequantize_ratio'), '.2f')} | "
                f"{_f(ms('quantize_s'), '.3f')} | {_f(ms('dequantize_s'), '.3f')} | {_f(ms('x2_s'), '.3f')} | "
                f"{_f(r.get('x2_gbps'), '.0f')} | {_cell(r.get('error', ''))} |"
            )
        out.append("")
    failed = [k for k, v in secs.items() if v.get("status") != "ok"]
    if failed:
        listed = ", ".join(f"{k} ({secs[k].get('status')})" for k in failed)
        out += [f"Sections not completed: {listed}.", ""]
    gemm = [r for r in mm_rows if r.get("gemm_lines") or r.get("emitted_dots")]
    if gemm:
        out += ["<details><summary>Dots emitted (StableHLO) and GEMM lines of the optimized HLO</summary>", ""]
        for r in gemm:
            emitted = [f"emitted: {sig}" for sig in r.get("emitted_dots", [])]
            out += [f"{r['variant']}:", "", "```", *emitted, *r.get("gemm_lines", []), "```", ""]
        out += ["</details>", ""]
    return "\n".join(out)


# Main -----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_bench_out", help="folder for gpu_bench.json, gpu_bench.md, hlo/")
    p.add_argument("--small", action="store_true", help="tiny sizes (n = 256): a smoke test")
    p.add_argument("--n", type=int, default=None, help="matrix size (default 8192, 256 with --small)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per variant (default 15, 3 with --small)")
    p.add_argument("--budget", type=float, default=270.0, help="seconds after which remaining work is skipped")
    p.add_argument("--variants", default=None, help="regex: run only the matmul variants it matches")
    p.add_argument("--only", default="", help=f"comma-separated sections among {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    bench = Bench(args)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for i, (name, fn) in enumerate(SECTIONS.items(), 1):
        if only and name not in only:
            continue
        log(f"\n== {i}. {name} (t = {bench.elapsed():.1f} s)")
        entry = bench.results["sections"][name] = {"status": "running"}
        if bench.over_budget() and name != "correctness":
            entry["status"] = "skipped: time budget spent"
            log("  skipped: time budget spent")
            continue
        t = time.perf_counter()
        try:
            entry["results"] = fn(bench)
            entry["status"] = "ok"
        except Exception as e:
            entry["status"] = "error"
            entry["error"] = traceback.format_exc()[-4000:]
            log(f"  SECTION FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            sys.stderr.flush()
        entry["seconds"] = round(time.perf_counter() - t, 2)
        bench.save()
    log(f"\nDone in {bench.elapsed():.1f} s; results in {os.path.join(args.out, 'gpu_bench.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
