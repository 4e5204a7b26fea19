"""torchao's NVFP4 on a GPU against ``qformats.NVFP4`` and ``scalify.recipes.NVFP4``, in one command.

What it checks (torchao 0.18 with torch 2.11; written for an H100, sm_90):

1. **Quantization, bit for bit.** torchao's ``NVFP4Tensor.to_nvfp4`` (its pure-PyTorch
   ``nvfp4_quantize``, the only NVFP4 quantizer of torchao that runs unpatched before Blackwell) on the
   GPU, two-level (``per_tensor_scale = per_tensor_amax_to_scale(amax|x|)``) and single-level, for
   float32 and bfloat16 inputs (1024x1024 randn; 512x2048 randn with a zero block, a tiny block, an
   outlier and a row of exact FP4 ties), against ``qformats.NVFP4.quantize`` under JAX on the same
   machine: E2M1 codes, E4M3 block-scale bits, the float32 tensor scale and the dequantized values.
   Each mismatch is classified: where the exact (float64) block scale or scaled element lies on a
   rounding tie, the order of float32 operations decides, and the implementations use different
   orders (torchao multiplies by ``(1 / tensor_scale) / block_scale``, its training kernels by
   ``2688 / amax``; XLA turns a division by a constant into a multiplication by its reciprocal).
   Also reported: torchao on CUDA against torchao on CPU, ours on the GPU against ours on the CPU.
2. **The NVFP4 training linear** (``torchao.prototype.moe_training.nvfp4_training.nvfp4_linear``:
   16x16 random Hadamard transform on both weight-gradient operands, 16x16 weight tiles, stochastic
   rounding of the output gradient). torchao gates it to SM100: its Triton kernels use the
   Blackwell-only PTX ``cvt.{rn,rs}.satfinite.e2m1x{2,4}.f32``, and its GEMMs are FP4
   ``F.scaled_mm``. The script first calls it as shipped (recording the refusal), then runs torchao's
   own autograd function and Triton kernels with three substitutions: the SM100 check passes; the FP4
   conversion is a Triton round-to-nearest-even of the already scaled and clamped value, also in place
   of the stochastic one (**stochastic rounding is off on both sides**); each FP4 ``scaled_mm`` is
   emulated (codes x E4M3 scale x tensor scale, float64 GEMM, cast to bf16) and its operands are
   captured. Each autotuned kernel gets one config, to keep compile time short. torchao is given the
   Hadamard sign vector of ``qformats.RandomHadamard(16, seed=0)`` (the recipe's), and the two 16x16
   matrices are checked to be bit-identical. Each captured GEMM operand (codes, block-scale bits,
   tensor scale) is compared with that of ``recipes.NVFP4.replace(stochastic_rounding=())``; y, dx and
   dw of ``jax.vjp(recipes.apply(linear, recipe))`` are compared with torchao's to float32 summation
   order plus one bf16 rounding, over all outputs and over those whose operand rows agree bit for bit.
   torchao rounds the Hadamard output to bfloat16 before quantizing and our recipe does not, so the
   weight-gradient operands are compared both ways.

Run (the repository root is put on ``sys.path``; torchao may come from a wheel folder)::

    python3 scripts/gpu_torchao_nvfp4.py --out DIR          # GPU: torch and JAX on CUDA, < 3 min
    python scripts/gpu_torchao_nvfp4.py --out DIR --cpu     # smoke test: CPU, Triton interpreter

It writes ``DIR/torchao_nvfp4.json`` (everything) and ``DIR/torchao_nvfp4.md`` (a summary), printing
results as it goes. Each comparison runs on its own; a failure prints its traceback, is recorded, and
the rest go on. The torch half runs in this process and hands its arrays (``--work``, by default a
temporary folder) to the JAX half, a child process (``--jax-python`` picks its interpreter), so the
two CUDA stacks never share a process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# The GEMM operand each scaled_mm call of torchao's nvfp4_mm_triton gets, in call order, as stored
# (blocks along the last axis): y = x . w^T, dx = dy . (w^T)^T, dw = (dy^T) . (x^T)^T.
TAO_GEMMS = (("y", "fwd_lhs", "fwd_rhs"), ("dx", "dgrad_lhs", "dgrad_rhs"), ("dw", "wgrad_lhs", "wgrad_rhs"))
HADAMARD_SEED = 0  # scalify.recipes.NVFP4.wgrad_hadamard is qformats.RandomHadamard(16), seed 0
FP4_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])

if "--cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _e2m1_rn(v):
        """E2M1 code of a float32 already in [-6, 6], round to nearest even (cvt.rn.satfinite)."""
        a = tl.abs(v)
        m = tl.where(a <= 0.25, 0, 1)
        m = tl.where(a >= 0.75, 2, m)
        m = tl.where(a > 1.25, 3, m)
        m = tl.where(a >= 1.75, 4, m)
        m = tl.where(a > 2.5, 5, m)
        m = tl.where(a >= 3.5, 6, m)
        m = tl.where(a > 5.0, 7, m)
        sign = (v.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
        return (m + sign * 8).to(tl.uint8)

    @triton.jit
    def _fp4x2_rn(x_pairs):
        """Stands in for torchao's convert_8xfp32_to_4xfp4_packed: element 2i low nibble, 2i+1 high."""
        return _e2m1_rn(x_pairs[0]) | (_e2m1_rn(x_pairs[1]) << 4)

    @triton.jit
    def _fp4x2_rs_as_rn(x_pairs, rbits):
        """Stands in for convert_8xfp32_to_4xfp4_packed_rs: round to nearest, random bits unused."""
        return _e2m1_rn(x_pairs[0]) | (_e2m1_rn(x_pairs[1]) << 4)


def _interpreter_fixes() -> None:
    """Bugs of Triton 3.6's interpreter (CPU smoke test only): it calls int() on a 1-element 1-D array
    (an error from NumPy 2.4 on), its tl.dot multiplies bfloat16 bit patterns as integers, its float32
    -> float8e4nv cast rounds half up without carrying into the exponent (31.8 -> 16), and its float32
    -> bfloat16 cast truncates. Casts between float32 and bfloat16 / float8e4nv go through ml_dtypes."""
    import ml_dtypes
    from triton.runtime import interpreter

    convert_float = interpreter._convert_float

    def patched_convert(data, src, dst, rounding_mode):
        small = {tl.float8e4nv: ml_dtypes.float8_e4m3fn, tl.bfloat16: ml_dtypes.bfloat16}
        if src == tl.float32 and dst in small:
            return np.asarray(data).view(np.float32).astype(small[dst]).view(f"u{np.dtype(small[dst]).itemsize}")
        if src in small and dst == tl.float32:
            return np.asarray(data).view(small[src]).astype(np.float32)
        return convert_float(data, src, dst, rounding_mode)

    interpreter._convert_float = patched_convert

    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])

    def as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_dot(self, a, b, d, *args):
        return create_dot(self, as_f32(a), as_f32(b), d, *args)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot


def log(*parts) -> None:
    print(*parts, flush=True)


def attempt(results: dict, name: str, fn, *args, **kwargs):
    """Run one comparison; on failure print the traceback, record it, and go on."""
    t0 = time.time()
    log(f"--- {name}")
    try:
        out = fn(*args, **kwargs)
        results[name] = out if isinstance(out, dict) else {"result": out}
        results[name]["seconds"] = round(time.time() - t0, 2)
        return out
    except Exception as e:  # every comparison is independent: report and continue
        traceback.print_exc()
        sys.stdout.flush()
        results[name] = {"error": f"{type(e).__name__}: {e}", "seconds": round(time.time() - t0, 2)}
        return None


def dist_version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------ inputs


def quant_inputs() -> dict[str, np.ndarray]:
    """1024x1024 randn; 512x2048 randn with a zero block, a tiny block, an outlier and exact FP4 ties."""
    rng = np.random.default_rng(20260824)
    plain = rng.standard_normal((1024, 1024)).astype(np.float32)
    x = rng.standard_normal((512, 2048)).astype(np.float32)
    x[0, :16] = 0.0
    x[1, 16:32] *= np.float32(1e-6)
    x[2, 5] = 300.0
    x[3, :16] = np.float32([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -6, -5, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25])
    return {"1024x1024": plain, "512x2048": x}


def train_inputs(m: int, k: int, n: int):
    rng = np.random.default_rng(1000 * m + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    dy = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
    x[3, 5], w[7, 9], dy[1, 2] = 48.0, 1.5, 0.02  # outliers
    return x, w, dy


def hadamard_signs(seed: int = HADAMARD_SEED) -> list[int]:
    """The sign vector of qformats.RandomHadamard(16, seed) (checked against it in the JAX half)."""
    return [int(s) for s in np.where(np.random.default_rng(seed).random(16) < 0.5, -1, 1)]


# ------------------------------------------------------------------------------------- torch half


def torch_half(args) -> None:
    import torch

    results: dict = {}
    arrays: dict[str, np.ndarray] = {}
    dev = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torchao": dist_version("torchao"),
        "triton": getattr(triton, "__version__", None),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "torch_device": str(dev),
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(dev))
    results["torch_env"] = env
    log("torch half:", json.dumps(env))
    try:
        import torchao  # noqa: F401  (logs a warning if its C++ extensions do not load: not needed here)
        from torchao.prototype.mx_formats.kernels import unpack_uint4
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    except Exception as e:
        traceback.print_exc()
        results["torchao_import"] = {"error": f"{type(e).__name__}: {e}"}
        return save_torch_half(args, results, arrays)

    def tao_quantize(xt, two_level):
        pts = per_tensor_amax_to_scale(torch.max(torch.abs(xt))) if two_level else None
        t = NVFP4Tensor.to_nvfp4(xt.contiguous(), per_tensor_scale=pts)
        codes = unpack_uint4(t.qdata.view(torch.uint8).contiguous())
        return {
            "codes": codes.cpu().numpy(),
            "scale": t.scale.view(torch.uint8).cpu().numpy(),
            "tensor": np.float32(np.nan if pts is None else pts.float().cpu().item()),
            "deq": t.dequantize(torch.float32).cpu().numpy(),
        }

    def quant_case(x, dtype, two_level, key):
        xt = torch.from_numpy(x).to(dev).to(dtype)
        out = tao_quantize(xt, two_level)
        info = {"device": str(dev)}
        if dev.type != "cpu":  # the same pure-PyTorch code on the CPU, for reference
            ref = tao_quantize(xt.cpu(), two_level)
            info["cuda_vs_cpu_code_mismatches"] = int((ref["codes"] != out["codes"]).sum())
            info["cuda_vs_cpu_scale_mismatches"] = int((ref["scale"] != out["scale"]).sum())
        for name, value in out.items():
            arrays[f"q__{key}__{name}"] = value
        arrays[f"q__{key}__x"] = xt.float().cpu().numpy()
        return info

    for shape, x in quant_inputs().items():
        for dtype in (torch.float32, torch.bfloat16):
            for two_level in (True, False):
                key = f"{shape}_{str(dtype).removeprefix('torch.')}_{'two_level' if two_level else 'single_level'}"
                attempt(results, f"torchao to_nvfp4 {key}", quant_case, x, dtype, two_level, key)

    if dev.type == "cuda":
        attempt(results, "probe: torchao nvfp4_linear as shipped", probe_training_as_shipped, dev)
        attempt(results, "probe: torchao NVFP4 GEMM (torch._scaled_mm FP4)", probe_fp4_gemm, dev)
    if not args.skip_train:
        m, k, n = args.train_shape or ((128, 256, 384) if dev.type == "cpu" else (512, 1024, 768))
        attempt(results, "torchao nvfp4_linear, Hopper-patched", run_training_patched, dev, m, k, n, arrays)
    save_torch_half(args, results, arrays)


def save_torch_half(args, results, arrays) -> None:
    work = Path(args.work)
    np.savez(work / "torchao_nvfp4_torch.npz", **arrays)
    (work / "torchao_nvfp4_torch.json").write_text(json.dumps(results, indent=1, default=str))


def probe_training_as_shipped(dev):
    """torchao's NVFP4 training linear, unpatched (expected: refused before SM100)."""
    import torch
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_linear import nvfp4_linear

    x = torch.randn(128, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = nvfp4_linear(x, w, None, sign_vector=hadamard_signs())
    y.sum().backward()
    return {"ran": True}


def probe_fp4_gemm(dev):
    """torchao's NVFP4 inference GEMM (NVFP4Tensor x NVFP4Tensor, torch._scaled_mm with FP4)."""
    import torch
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    a = NVFP4Tensor.to_nvfp4(torch.randn(128, 128, device=dev, dtype=torch.bfloat16))
    b = NVFP4Tensor.to_nvfp4(torch.randn(128, 128, device=dev, dtype=torch.bfloat16))
    from torchao.prototype.mx_formats.nvfp4_tensor import _addmm_nvfp4_dispatch

    _addmm_nvfp4_dispatch(a, b.t(), torch.ops.aten.mm.default)
    return {"ran": True}


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _one_config(kernel, **want):
    """Restrict a triton.autotune kernel to its first config matching ``want`` (no autotuning)."""
    for c in kernel.configs:
        if all(c.kwargs.get(k, getattr(c, k, None)) == v for k, v in want.items()):
            return [c]
    return kernel.configs[:1]


def run_training_patched(dev, m, k, n, arrays):
    """torchao's nvfp4_mm_triton forward + backward with the three Hopper substitutions (module doc)."""
    import torch
    import torch.nn.functional as F
    import torch.utils._triton

    if triton is None:
        raise RuntimeError("triton is not installed")
    stack = contextlib.ExitStack()
    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpreter_fixes()
    if dev.type == "cpu":  # interpreter: let torchao define its Triton kernels without a GPU
        stack.enter_context(_patched(torch.utils._triton, "has_triton", lambda: True))
        props = type("Props", (), {"multi_processor_count": 4})()
        stack.enter_context(_patched(torch.cuda, "get_device_properties", lambda *a, **k: props))
    with stack:
        from torchao.prototype.moe_training import nvfp4_training

        for name in ("hadamard_amax_triton", "hadamard_quantize_row_col_triton", "quantize_2d_triton", "nvfp4_linear"):
            importlib.import_module(f"{nvfp4_training.__name__}.{name}")
        nt = nvfp4_training
        amax_mod, rowcol_mod, q2d_mod = (
            nt.hadamard_amax_triton,
            nt.hadamard_quantize_row_col_triton,
            nt.quantize_2d_triton,
        )
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
        from torchao.prototype.mx_formats.utils import from_blocked

        calls: list[dict] = []

        def unpack(t):  # float4_e2m1fn_x2 [rows, cols/2] -> uint8 codes [rows, cols]
            return unpack_uint4(t.view(torch.uint8).contiguous())

        def scaled_mm(
            mat_a,
            mat_b,
            *,
            scale_a,
            scale_recipe_a,
            scale_b,
            scale_recipe_b,
            swizzle_a=None,
            swizzle_b=None,
            bias=None,
            output_dtype=torch.bfloat16,
            **unused,
        ):
            """F.scaled_mm for two-level NVFP4 operands (1x16 E4M3 swizzled + float32 tensor scales)."""
            for recipe, swz in ((scale_recipe_a, swizzle_a), (scale_recipe_b, swizzle_b)):
                assert [r.name for r in recipe] == ["BlockWise1x16", "TensorWise"], recipe
                assert swz[0].name == "SWIZZLE_32_4_4", swz
            ops = []
            for codes, scales in ((unpack(mat_a), scale_a), (unpack(mat_b.t()), scale_b)):
                rows, cols = codes.shape
                block = from_blocked(scales[0].view(torch.uint8), rows, cols // 16).contiguous()
                vals = f4_unpacked_to_f32(codes) * block.view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
                ops.append((codes, block, scales[1].float().reshape(()), vals))
            (ac, ab, ag, av), (bc, bb, bg, bv) = ops
            calls.append(dict(a=(ac, ab, ag), b=(bc, bb, bg)))
            acc = (av.double() @ bv.double().T).float()
            out = (acc * (ag * bg)).to(output_dtype)
            return out if bias is None else out + bias

        picks = {
            amax_mod._hadamard_amax_kernel: dict(BLOCK_M=64, BLOCK_N=64, num_stages=2, num_warps=4),
            rowcol_mod._hadamard_quantize_row_col_kernel: dict(BLOCK_M=128, BLOCK_N=128, num_stages=2, num_warps=8),
            q2d_mod.triton_quantize_2d_weight: dict(BLOCK_M=128, BLOCK_N=128, num_stages=1, num_warps=4),
        }
        with contextlib.ExitStack() as patches:
            for mod in (amax_mod, rowcol_mod, q2d_mod):
                patches.enter_context(_patched(mod, "is_sm_at_least_100", lambda: True))
            patches.enter_context(_patched(nt.hadamard_utils, "convert_8xfp32_to_4xfp4_packed", _fp4x2_rn))
            patches.enter_context(_patched(nt.hadamard_utils, "convert_8xfp32_to_4xfp4_packed_rs", _fp4x2_rs_as_rn))
            patches.enter_context(_patched(q2d_mod, "convert_8xfp32_to_4xfp4_packed", _fp4x2_rn))
            for kernel, want in picks.items():
                patches.enter_context(_patched(kernel, "configs", _one_config(kernel, **want)))
            patches.enter_context(_patched(F, "scaled_mm", scaled_mm))

            x, w, dy = train_inputs(m, k, n)
            xt = torch.from_numpy(x).to(dev, torch.bfloat16).requires_grad_(True)
            wt = torch.from_numpy(w).to(dev, torch.bfloat16).requires_grad_(True)
            dyt = torch.from_numpy(dy).to(dev, torch.bfloat16)
            signs = hadamard_signs()
            hu = nt.hadamard_utils
            rht = hu.get_rht_matrix(tuple(signs), hu._device_key(dev), torch.bfloat16, 16)
            arrays.update(
                t__x=x_np(xt), t__w=x_np(wt), t__dy=x_np(dyt), t__signs=np.array(signs, np.int8), t__rht=x_np(rht)
            )
            info = {
                "shape": {"M": m, "K": k, "N": n},
                "sign_vector": signs,
                "configs": {kern.fn.__name__: str(kern.configs[0]) for kern in picks},
                "substituted": [
                    "is_sm_at_least_100 -> True in the three kernel modules",
                    "convert_8xfp32_to_4xfp4_packed (cvt.rn.satfinite.e2m1x2.f32) -> Triton RNE",
                    "convert_8xfp32_to_4xfp4_packed_rs (cvt.rs.satfinite.e2m1x4.f32) -> the same RNE (SR off)",
                    "torch.nn.functional.scaled_mm (FP4) -> dequantize, float64 GEMM, cast; operands captured",
                    "each triton.autotune restricted to one config",
                ],
            }
            sr_seed = torch.tensor([1234], dtype=torch.int64, device=dev)
            for step in ("forward", "backward"):
                t0 = time.time()
                if step == "forward":
                    y = nt.nvfp4_linear.nvfp4_linear(xt, wt, None, sign_vector=signs, sr_seed=sr_seed)
                    outs = {"y": y}
                else:
                    y.backward(dyt)
                    outs = {"dx": xt.grad, "dw": wt.grad}
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                info[f"{step}_seconds_incl_compile"] = round(time.time() - t0, 2)
                for (name, lhs, rhs), call in zip(TAO_GEMMS, calls, strict=False):
                    if name in outs:
                        arrays[f"t__{name}"] = x_np(outs[name])
                        for role, (codes, block, gs) in ((lhs, call["a"]), (rhs, call["b"])):
                            arrays[f"t__{role}__codes"] = codes.cpu().numpy()
                            arrays[f"t__{role}__scale"] = block.cpu().numpy()
                            arrays[f"t__{role}__tensor"] = np.float32(gs.cpu().item())
                log(f"{step}: {info[f'{step}_seconds_incl_compile']} s")
        assert len(calls) == 3, f"expected 3 GEMMs, captured {len(calls)}"
        return info


def x_np(t) -> np.ndarray:
    """A torch tensor as a float32 NumPy array (bfloat16 values are exact in float32)."""
    return t.detach().float().cpu().numpy()


# --------------------------------------------------------------------------------------- JAX half


def jax_half(args) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(ROOT))
    out, work = Path(args.out), Path(args.work)
    torch_results = json.loads((work / "torchao_nvfp4_torch.json").read_text())
    z = dict(np.load(work / "torchao_nvfp4_torch.npz"))
    results: dict = {}
    import jax

    import qformats as qf

    env = {
        "jax": jax.__version__,
        "jaxlib": dist_version("jaxlib"),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "numpy": np.__version__,
        "ml_dtypes": dist_version("ml_dtypes"),
        "qformats": getattr(qf, "__version__", None),
        "repo_commit": _git_head(),
    }
    results["jax_env"] = env
    log("JAX half:", json.dumps(env))
    keys = sorted({k.split("__")[1] for k in z if k.startswith("q__")})
    for key in keys:
        attempt(results, f"quantize {key}", compare_quantize, qf, z, key)
    if "t__rht" in z:
        attempt(results, "hadamard matrix", compare_hadamard, z)
        attempt(results, "training operands", compare_training_operands, z)
        attempt(results, "training y/dx/dw", compare_training_outputs, z)
    write_report(out, torch_results, results)


def _git_head():
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return None


def _on_cpu(x):
    import jax

    return jax.device_put(x, jax.devices("cpu")[0])


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _near_tie(exact: np.ndarray, dtype) -> np.ndarray:
    """True where rounding ``exact`` (float64) to ``dtype`` flips within a relative 2**-20 of it."""
    eps = 2.0**-20
    lo = (exact * (1 - eps)).astype(dtype).astype(np.float64)
    hi = (exact * (1 + eps)).astype(dtype).astype(np.float64)
    return lo != hi


def classify(v, codes, codes_t, scale, scale_t, two_level: bool) -> dict:
    """Mismatches between our and torchao's quantization of ``v`` [rows, cols] (float64, blocks of 16
    along the last axis; codes per element, E4M3 scale bits per block), with their likely cause.

    A scale mismatch is "at an E4M3 tie" when the exact block scale ``amax_block / 6 * 2688 / amax``
    lies within a relative 2**-20 of an E4M3 rounding boundary; a code mismatch in a block whose
    scales agree is "at an FP4 tie" when the exact scaled element ``v * 2688 / (amax * scale)`` does.
    There, the order of float32 operations decides, and the two implementations use different orders.
    For mismatches at a tie it also counts which side rounded the exact value to nearest even.
    """
    import ml_dtypes

    rows, cols = v.shape
    amax = float(np.max(np.abs(v)))
    g = 2688.0 / amax if two_level and amax > 0 else 1.0
    scale_bad = scale != scale_t
    code_bad = codes != codes_t
    in_bad_block = np.repeat(scale_bad, 16, axis=1)
    exact_bs = np.abs(v).reshape(rows, cols // 16, 16).max(-1) / 6.0 * g
    exact_bs = np.clip(exact_bs, 2.0**-6, 448.0)
    scaled = v * g / np.repeat(scale_t.view(ml_dtypes.float8_e4m3fn).astype(np.float64), 16, axis=1)
    at_tie = np.isin(np.abs(scaled), FP4_TIES) | _near_tie(np.clip(scaled, -6, 6), ml_dtypes.float4_e2m1fn)
    plain = code_bad & ~in_bad_block
    code_tie, scale_tie = plain & at_tie, scale_bad & _near_tie(exact_bs, ml_dtypes.float8_e4m3fn)
    rne_code = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    rne_scale = exact_bs.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return {
        "code_mismatches": int(code_bad.sum()),
        "of_codes": int(code_bad.size),
        "code_mismatches_at_fp4_tie": int(code_tie.sum()),
        "fp4_ties_ours_rne": int((code_tie & (_fp4_value(codes) == rne_code)).sum()),
        "fp4_ties_torchao_rne": int((code_tie & (_fp4_value(codes_t) == rne_code)).sum()),
        "code_mismatches_in_mismatched_blocks": int((code_bad & in_bad_block).sum()),
        "code_mismatches_unexplained": int((plain & ~at_tie).sum()),
        "scale_mismatches": int(scale_bad.sum()),
        "of_scales": int(scale_bad.size),
        "scale_mismatches_at_e4m3_tie": int(scale_tie.sum()),
        "e4m3_ties_ours_rne": int((scale_tie & (_e4m3_value(scale) == rne_scale)).sum()),
        "e4m3_ties_torchao_rne": int((scale_tie & (_e4m3_value(scale_t) == rne_scale)).sum()),
        "examples": [
            dict(
                at=[int(i), int(j)],
                v=float(v[i, j]),
                exact_scaled=float(scaled[i, j]),
                ours=int(codes[i, j]),
                torchao=int(codes_t[i, j]),
            )
            for i, j in np.argwhere(plain)[:3]
        ],
    }


def _fp4_value(codes) -> np.ndarray:
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes & 7]
    return np.where(codes & 8, -mag, mag)


def _e4m3_value(bits) -> np.ndarray:
    import ml_dtypes

    return bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _tensor_scale(ours, theirs) -> dict:
    ulps = int(_bits(np.float32(ours)).astype(np.int64) - _bits(np.float32(theirs)).astype(np.int64))
    return {"tensor_scale_ours": float(ours), "tensor_scale_torchao": float(theirs), "tensor_scale_ulps": ulps}


def _summary(name, r) -> str:
    return (
        f"{name}: codes {r['code_mismatches']}/{r['of_codes']} (FP4 tie {r['code_mismatches_at_fp4_tie']} [RNE: ours "
        f"{r['fp4_ties_ours_rne']}, torchao {r['fp4_ties_torchao_rne']}], in "
        f"mismatched blocks {r['code_mismatches_in_mismatched_blocks']}, unexplained "
        f"{r['code_mismatches_unexplained']}), scales {r['scale_mismatches']}/{r['of_scales']} (E4M3 tie "
        f"{r['scale_mismatches_at_e4m3_tie']}), tensor scale ulps {r.get('tensor_scale_ulps', '-')}"
    )


def compare_quantize(qf, z, key):
    import jax
    import jax.numpy as jnp

    p = f"q__{key}__"
    x, codes_t, scale_t, tensor_t, deq_t = (z[p + s] for s in ("x", "codes", "scale", "tensor", "deq"))
    two_level = key.endswith("two_level")
    dtype = jnp.bfloat16 if "bfloat16" in key else jnp.float32
    fmt = qf.NVFP4.replace(tensor_scale=two_level, packed=False)
    quantize = jax.jit(lambda v: fmt.quantize(v))
    xin = jnp.asarray(x, dtype)
    data, scale = quantize(xin)
    codes, block = _bits(data), _bits(scale.block)
    deq = np.asarray(fmt.dequantize(data, scale, jnp.float32))
    res = {"shape": list(x.shape), "input_dtype": str(np.dtype(dtype)), "two_level": two_level}
    res |= classify(x.astype(np.float64), codes, codes_t, block, scale_t, two_level)
    if two_level:
        res |= _tensor_scale(scale.tensor, tensor_t)
    res["dequant_bit_mismatches"] = int((_bits(deq.astype(np.float32)) != _bits(deq_t)).sum())
    res["dequant_max_abs_diff"] = float(np.max(np.abs(deq.astype(np.float64) - deq_t)))
    if jax.default_backend() != "cpu":
        d_cpu, s_cpu = quantize(_on_cpu(xin))
        res["ours_gpu_vs_cpu_code_mismatches"] = int((_bits(d_cpu) != codes).sum())
        res["ours_gpu_vs_cpu_scale_mismatches"] = int((_bits(s_cpu.block) != block).sum())
    log(_summary(key, res) + f", dequant max diff {res['dequant_max_abs_diff']:.3g}")
    return res


def compare_hadamard(z):
    import jax
    import jax.numpy as jnp

    h = _recipe().wgrad_hadamard
    ours = h.matrix()
    # torchao right-multiplies row blocks by R = diag(s) H / 4; we left-multiply column blocks by
    # H diag(s) / 4: the same transform iff R equals our matrix transposed (H is symmetric)
    equal = bool(np.array_equal(_bits(ours.T.astype(np.float32)), _bits(z["t__rht"].astype(np.float32))))
    # our transform on this backend (default matmul precision) against float64
    v = np.random.default_rng(7).standard_normal((256, 64)).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: h.apply(a, 0))(jnp.asarray(v)), np.float64)
    ref = np.einsum("ij,bjk->bik", ours.astype(np.float64), v.astype(np.float64).reshape(16, 16, 64)).reshape(256, 64)
    rel = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    log(f"hadamard: matrices bit-identical {equal}; our apply on float32 vs float64: max rel err {rel:.3g}")
    return {"matrix_bits_equal": equal, "apply_float32_input_max_rel_err_vs_float64": rel}


def _linear(x, w):
    from jax import lax

    return lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def _recipe():
    from scalify import recipes

    return recipes.NVFP4.replace(stochastic_rounding=())


def _operands(z):
    import jax.numpy as jnp

    x, w, dy = (jnp.asarray(z[k], jnp.bfloat16) for k in ("t__x", "t__w", "t__dy"))
    return {"fwd_lhs": x, "fwd_rhs": w, "dgrad_lhs": dy, "dgrad_rhs": w, "wgrad_lhs": dy, "wgrad_rhs": x}


def ours_stored(role: str, operand, rht_to_bf16: bool = False):
    """Our quantization of one GEMM operand in torchao's stored orientation (blocks along the last
    axis): (operand values as quantized, float64; codes; block-scale bits per 1x16 block; tensor scale)."""
    import jax
    import jax.numpy as jnp

    from scalify.recipes._gemm import dot_aims

    recipe = _recipe()
    aim = dot_aims({"dimension_numbers": (((1,), (1,)), ((), ()))}, 2, 2)[role]
    axis = aim.contracted[-1]
    fmt = recipe.format_of(role).aim(axis, aim.free[-1]).replace(packed=False)
    v = operand.astype(jnp.float32)
    if role.startswith("wgrad") and recipe.wgrad_hadamard is not None:
        v = jax.jit(lambda a: recipe.wgrad_hadamard.apply(a, axis))(v)
        if rht_to_bf16:
            v = v.astype(jnp.bfloat16).astype(jnp.float32)
    data, scale = jax.jit(fmt.quantize)(v)
    rb, cb = fmt.block_shape(v.shape)
    codes, block = _bits(data), np.repeat(np.repeat(_bits(scale.block), rb, 0), cb, 1)
    v = np.asarray(v, np.float64)
    if axis == 0:  # torchao stores this operand transposed
        codes, block, v = codes.T, block.T, v.T
    return v, codes, block[:, ::16], np.float32(scale.tensor)


def compare_training_operands(z):
    res = {}
    for role, operand in _operands(z).items():
        if f"t__{role}__codes" not in z:
            continue
        variants = {"": False}
        if role.startswith("wgrad"):
            variants = {
                " (Hadamard output rounded to bf16, as torchao)": True,
                " (float32 Hadamard, our recipe)": False,
            }
        for label, to_bf16 in variants.items():
            v, codes, scale, tensor = ours_stored(role, operand, to_bf16)
            r = {"stored_shape": list(codes.shape)}
            r |= classify(v, codes, z[f"t__{role}__codes"], scale, z[f"t__{role}__scale"], two_level=True)
            r |= _tensor_scale(tensor, z[f"t__{role}__tensor"])
            res[role + label] = r
            log(_summary(role + label, r))
    return res


def compare_training_outputs(z):
    """y, dx, dw of our recipe against torchao's, over all outputs and over the outputs whose two
    operand rows (as torchao stores them) quantized bit-identically (codes and block scales)."""
    import jax

    from scalify import recipes

    ops = _operands(z)
    x, w, dy = ops["fwd_lhs"], ops["fwd_rhs"], ops["dgrad_lhs"]
    y, vjp = jax.vjp(jax.jit(recipes.apply(_linear, _recipe())), x, w)
    dx, dw = vjp(dy)
    res = {}
    for (name, lhs, rhs), ours in zip(TAO_GEMMS, (y, dx, dw), strict=True):
        if f"t__{name}" not in z:
            continue
        deq, same_row = [], []
        for role in (lhs, rhs):  # every GEMM is lhs_stored @ rhs_stored.T
            _, codes, scale, tensor = ours_stored(role, ops[role])
            same = (codes == z[f"t__{role}__codes"]).all(1) & (scale == z[f"t__{role}__scale"]).all(1)
            same_row.append(same)
            deq.append(np.asarray(_dequantize(codes, scale, tensor), np.float64))
        a, b = deq
        ours = np.asarray(ours, np.float64)
        ref = z[f"t__{name}"].astype(np.float64)
        big = np.maximum(np.abs(ours), np.abs(ref))
        ulp = np.exp2(np.floor(np.log2(np.where(big > 0, big, 1.0))) - 7)  # one bf16 ulp
        bound = a.shape[1] * 2.0**-24 * (np.abs(a) @ np.abs(b).T) + ulp
        err = np.abs(ours - ref)
        clean = same_row[0][:, None] & same_row[1][None, :]
        r = {
            "shape": list(ref.shape),
            "beyond_bound": int((err > bound).sum()),
            "max_err_over_bound": float(np.max(err / bound)),
            "clean_outputs": int(clean.sum()),
            "clean_beyond_bound": int((clean & (err > bound)).sum()),
            "clean_max_err_over_bound": float(np.max(err / bound, where=clean, initial=0.0)),
            "max_abs_diff": float(err.max()),
            "rel_l2_diff": float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30)),
            "bf16_equal": int((ours == ref).sum()),
            "of": int(ref.size),
        }
        res[name] = r
        log(f"{name}: {r}")
    res["bound"] = "K * 2**-24 * (|A| @ |B|) + one bf16 ulp (A, B our dequantized operands)"
    return res


def _dequantize(codes, scale_bits, tensor):
    import ml_dtypes

    vals = _fp4_value(codes).astype(np.float32)
    block = scale_bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(tensor)
    return vals * np.repeat(block, 16, axis=1)


# ------------------------------------------------------------------------------------------ report


def _row(name, r) -> str:
    if "error" in r:
        return f"| {name} | error: {r['error']} | | | | |"
    return (
        f"| {name} | {r['code_mismatches']} / {r['of_codes']} | {r['code_mismatches_at_fp4_tie']} / "
        f"{r['code_mismatches_in_mismatched_blocks']} / {r['code_mismatches_unexplained']} | "
        f"{r['scale_mismatches']} / {r['of_scales']} ({r['scale_mismatches_at_e4m3_tie']}) | "
        f"{r['fp4_ties_ours_rne']} / {r['fp4_ties_torchao_rne']}; {r['e4m3_ties_ours_rne']} / "
        f"{r['e4m3_ties_torchao_rne']} | {r.get('tensor_scale_ulps', '-')} |"
    )


def write_report(out: Path, torch_results: dict, jax_results: dict) -> None:
    report = {"torch_half": torch_results, "jax_half": jax_results}
    (out / "torchao_nvfp4.json").write_text(json.dumps(report, indent=1, default=str))
    te, je = torch_results.get("torch_env", {}), jax_results.get("jax_env", {})
    head = (
        "| {} | code mismatches | at an FP4 tie / in a mismatched block / unexplained | "
        "scale mismatches (at an E4M3 tie) | ties rounded to nearest even, ours / torchao: FP4; E4M3 | "
        "tensor scale ulps |\n|---|---|---|---|---|---|"
    )
    lines = [
        "## torchao NVFP4 vs qformats / scalify",
        "",
        f"torch {te.get('torch')} (CUDA {te.get('torch_cuda')}), torchao {te.get('torchao')}, "
        f"triton {te.get('triton')}{' (interpreter)' if te.get('triton_interpret') else ''}, "
        f"jax {je.get('jax')} on {je.get('jax_backend')}; device: {te.get('gpu', te.get('torch_device'))} "
        f"{te.get('capability', '')}".rstrip(),
        "",
        "### Quantization: `NVFP4Tensor.to_nvfp4` vs `qformats.NVFP4.quantize`",
        "",
        "Inputs: 1024x1024 randn; 512x2048 randn with a zero block, a tiny block, an outlier (300) and a row "
        "of exact FP4 ties. Ties: the exact value lies on a rounding boundary, where the order of float32 "
        "operations decides.",
        "",
        head.format("case"),
    ]
    quant = {n.removeprefix("quantize "): r for n, r in jax_results.items() if n.startswith("quantize ")}
    lines += [_row(k, r) for k, r in quant.items()]
    deq = [f"{k}: {r['dequant_max_abs_diff']:.3g}" for k, r in quant.items() if "dequant_max_abs_diff" in r]
    lines += ["", "Dequantized values, max abs diff: " + "; ".join(deq)]
    gpu_cpu = {
        k: (r["ours_gpu_vs_cpu_code_mismatches"], r["ours_gpu_vs_cpu_scale_mismatches"])
        for k, r in quant.items()
        if "ours_gpu_vs_cpu_code_mismatches" in r
    }
    if gpu_cpu:
        lines += ["", f"Ours on the GPU backend vs ours on the CPU backend (code, scale mismatches): {gpu_cpu}"]
    cuda_cpu = {
        n.removeprefix("torchao to_nvfp4 "): (r["cuda_vs_cpu_code_mismatches"], r["cuda_vs_cpu_scale_mismatches"])
        for n, r in torch_results.items()
        if "cuda_vs_cpu_code_mismatches" in r
    }
    if cuda_cpu:
        lines += ["", f"torchao on CUDA vs torchao on CPU (code, scale mismatches): {cuda_cpu}"]
    lines += ["", "### Training linear (`torchao.prototype.moe_training.nvfp4_training.nvfp4_linear`)", ""]
    for name, r in torch_results.items():
        if name.startswith("probe:") or name.startswith("torchao nvfp4_linear"):
            lines.append(f"- {name}: {r.get('error') or 'ran'}")
    train = torch_results.get("torchao nvfp4_linear, Hopper-patched", {})
    if "shape" in train:
        lines += [
            f"- shape M, K, N = {train['shape']}; bf16 inputs; RHT sign vector {train['sign_vector']} "
            "(that of qformats.RandomHadamard(16, seed=0)); stochastic rounding off on both sides",
            "- substituted in torchao: " + "; ".join(train["substituted"]),
        ]
    if "hadamard matrix" in jax_results:
        lines.append(f"- Hadamard: {jax_results['hadamard matrix']}")
    ops = {k: r for k, r in jax_results.get("training operands", {}).items() if isinstance(r, dict)}
    if ops:
        lines += ["", "GEMM operands, ours (`recipes.NVFP4`, SR off) vs torchao's:", "", head.format("operand")]
        lines += [_row(k, r) for k, r in ops.items()]
    outs = jax_results.get("training y/dx/dw", {})
    if any(name in outs for name in ("y", "dx", "dw")):
        lines += [
            "",
            f"y, dx, dw of `jax.vjp(recipes.apply(linear, recipe))` vs torchao's; bound: {outs.get('bound')}; "
            "clean: outputs whose two operand rows quantized bit-identically:",
            "",
            "| output | beyond bound | clean outputs | clean beyond bound | clean max err / bound | "
            "max abs diff | rel L2 diff | bf16-equal |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in ("y", "dx", "dw"):
            r = outs.get(name)
            if r:
                lines.append(
                    f"| {name} {r['shape']} | {r['beyond_bound']} | {r['clean_outputs']} | "
                    f"{r['clean_beyond_bound']} | {r['clean_max_err_over_bound']:.3g} | {r['max_abs_diff']:.3g} | "
                    f"{r['rel_l2_diff']:.3g} | {r['bf16_equal']} / {r['of']} |"
                )
    errors = [
        f"{n}: {r['error']}"
        for part in (torch_results, jax_results)
        for n, r in part.items()
        if isinstance(r, dict) and "error" in r
    ]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in errors]
    (out / "torchao_nvfp4.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))


# -------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--cpu", action="store_true", help="run on CPU (Triton interpreter for the training path)")
    ap.add_argument("--phase", choices=("all", "torch", "jax"), default="all", help="both halves, or one")
    ap.add_argument("--jax-python", default=sys.executable, help="interpreter for the JAX half")
    ap.add_argument("--train-shape", type=int, nargs=3, metavar=("M", "K", "N"), help="multiples of 128")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--work", help="folder for the torch half's arrays (default: a temporary folder)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.work is None:
            args.work = args.out if args.phase != "all" else stack.enter_context(tempfile.TemporaryDirectory())
        run(args, out)


def run(args, out: Path) -> None:
    t0 = time.time()
    if args.phase == "torch":
        return torch_half(args)
    if args.phase == "jax":
        return jax_half(args)
    for name in ("torchao_nvfp4.json", "torchao_nvfp4.md"):
        (out / name).unlink(missing_ok=True)
    # each half in its own process: neither CUDA stack shares a process (or a GPU context) with the other
    common = ["--out", str(out), "--work", args.work] + (["--cpu"] if args.cpu else [])
    torch_cmd = [sys.executable, __file__, "--phase", "torch", *common]
    torch_cmd += ["--skip-train"] if args.skip_train else []
    torch_cmd += ["--train-shape", *map(str, args.train_shape)] if args.train_shape else []
    for cmd in (torch_cmd, [args.jax_python, __file__, "--phase", "jax", *common]):
        rc = subprocess.call(cmd)
        if rc:
            log(f"{' '.join(cmd[1:4])} exited with status {rc}")
    if not (out / "torchao_nvfp4.md").exists():
        torch_json = Path(args.work) / "torchao_nvfp4_torch.json"
        torch_results = json.loads(torch_json.read_text()) if torch_json.exists() else {}
        write_report(out, torch_results, {"JAX half": {"error": "it wrote no report (see the log)"}})
    log(f"done in {time.time() - t0:.1f} s; see {out / 'torchao_nvfp4.md'}")


if __name__ == "__main__":
    main()
