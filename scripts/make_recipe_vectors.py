"""Reference vectors from torchao's low-precision training recipes (issue #15).

Writes ``tests/recipes/vectors/<recipe>_<M>x<K>x<N>.npz`` for a bias-free linear layer ``y = x @ w.T``
(x [M, K], w [N, K], upstream gradient dy [M, N], all float32) run through torchao's emulated training
paths on CPU: MX training (MXFP8 / MXFP4, FLOOR and RCEIL scales), float8 training (tensorwise,
tensorwise with power-of-2 scales, rowwise, rowwise_with_gw_hp) and blockwise float8 training (DeepSeek-V3's
recipe: its autograd function with torchao's PyTorch reference quantizers in place of its GPU-only Triton
kernels, see ``capture_blockwise``).

torch and torchao are NOT dependencies of this repository; run the script in its own venv::

    python -m venv ~/.cache/qformats-peers/torchao-venv
    ~/.cache/qformats-peers/torchao-venv/bin/pip install torch   # the CPU-only build (PyTorch's CPU wheel index)
    ~/.cache/qformats-peers/torchao-venv/bin/pip install torchao==0.18.0 numpy
    ~/.cache/qformats-peers/torchao-venv/bin/python scripts/make_recipe_vectors.py [--out DIR]

(the committed vectors were made with torch 2.13.0+cpu, torchao 0.18.0, numpy 2.x).

The committed vectors are small. To check the recipes at training sizes, write vectors of any shape and
input distribution to another folder and point the same tests at it (the files are large: keep them out
of the repository)::

    .../torchao-venv/bin/python scripts/make_recipe_vectors.py --out /tmp/big --shape 1024 2048 1536 \
        --inputs edges normal rows bf16 student_t
    QFORMATS_RECIPE_VECTORS=/tmp/big python -m pytest tests/recipes/test_torchao_vectors.py

How operands are captured: the script runs the real end-to-end path (the converted ``nn.Linear`` forward
and backward, or the ``mx_mm`` autograd function for MXFP4) and wraps torchao's own quantizer
(``torchao.prototype.mx_formats.mx_tensor.to_mx`` resp. ``torchao.float8.float8_linear.hp_tensor_to_float8_dynamic``)
to record every call's input and result in call order. Each captured input is checked to equal the expected
operand (x, w, dy or a transpose), the recorded GEMMs are recomputed from the captured bits and scales alone,
and the difference to torchao's y/dx/dw is stored in ``meta`` (``check``).

Each npz holds x, w, dy, y, dx, dw (float32) and, per quantized GEMM operand ``<role>`` in
(fwd_lhs, fwd_rhs, dgrad_lhs, dgrad_rhs, wgrad_lhs, wgrad_rhs): ``<role>_data`` (uint8: fp8 bit pattern, or one
unpacked fp4 e2m1 code per element) and ``<role>_scale`` (uint8 E8M0 bits for MX, float32 for float8), plus
``meta``: a JSON string (versions, calls, axes, scale convention, dtypes, checks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import inspect
import json
from pathlib import Path

import numpy as np
import torch
import torchao
import torchao.float8.float8_linear as f8_linear
import torchao.prototype.blockwise_fp8_training.kernels as bw_kernels
import torchao.prototype.blockwise_fp8_training.linear as bw_linear
import torchao.prototype.mx_formats.mx_tensor as mx_tensor
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
from torchao.prototype.moe_training.mxfp8_linear import mx_mm
from torchao.prototype.mx_formats.config import (
    MXFP8Dim0CastKernelChoice,
    MXFP8Dim1CastKernelChoice,
    ScaleCalculationMode,
)
from torchao.prototype.mx_formats.kernels import unpack_uint4
from torchao.quantization import quantize_
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

ROLES = ("fwd_lhs", "fwd_rhs", "dgrad_lhs", "dgrad_rhs", "wgrad_lhs", "wgrad_rhs")
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP4 = torch.float4_e2m1fn_x2
E4M3 = torch.float8_e4m3fn


def make_inputs(
    m: int, k: int, n: int, seed: int, kind: str = "edges"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """randn x, w * 0.05, dy * 1e-3, then shaped by ``kind``.

    ``edges`` (the committed vectors): outliers, an all-zero MX block, zero rows/columns (EPS path),
    tiny values and amaxes one ulp off the RCEIL / pow2 boundaries. ``normal``: nothing more.
    ``rows``: rows of x and dy and columns of w scaled by 2**j, j uniform in [-12, 12] (a wide range
    between the scales of one tensor). ``bf16``: every value rounded to bfloat16 (exact ties of the
    element grids are common). ``student_t``: x heavy-tailed (3 degrees of freedom).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g) * 1e-3
    if kind == "normal":
        return x, w, dy
    if kind == "rows":
        octaves = [torch.randint(-12, 13, shape, generator=g).float() for shape in ((m, 1), (1, k), (m, 1))]
        return x * torch.exp2(octaves[0]), w * torch.exp2(octaves[1]), dy * torch.exp2(octaves[2])
    if kind == "bf16":
        return x.bfloat16().float(), w.bfloat16().float(), dy.bfloat16().float()
    if kind == "student_t":
        chi2 = torch.distributions.Chi2(torch.tensor(3.0)).sample((m, k))  # uses torch's global generator
        return x / torch.sqrt(chi2 / 3), w, dy
    if kind != "edges":
        raise ValueError(f"unknown --inputs {kind!r}: use one of {INPUT_KINDS}")
    x[3, 5] = 48.0  # outliers
    x[m // 2, k - 1] = -300.0
    w[7, 9] = 1.5
    # one float32 ulp above e4m3_max * 2**k (k != 0): torch's float32 log2 rounds the exponent to exactly k, so
    # ceil(log2(amax / 448)) (MX RCEIL) and floor(log2(fp8_max / amax)) (float8 pow2 scales) miss the exact
    # result and the element saturates to +-fp8_max
    w[n - 1, 0] = -float(np.nextafter(np.float32(3.5), np.float32(4)))  # 448 * 2**-7
    dy[1, 2] = float(np.nextafter(np.float32(0.4375), np.float32(1)))  # 448 * 2**-10
    dy[m - 3, n // 2] = -0.0625
    x[10, 32:64] = 0.0  # one all-zero 32-block along K
    x[11, :32] *= 1e-5  # a block of tiny values
    x[12, 0] = 448.0  # amax exactly the e4m3 max (RCEIL boundary)
    x[13, 0] = 449.0  # just above it
    x[14, 0] = float(np.nextafter(np.float32(448), np.float32(449)))  # one ulp above it
    w[:, 20] = 0.0  # a zero row of w.T -> EPS clamp in rowwise dgrad
    dy[5, :] = 0.0  # a zero row of dy -> EPS clamp / zero MX blocks
    return x, w, dy


@contextlib.contextmanager
def patched(module, name: str, wrapper_factory):
    orig = getattr(module, name)
    setattr(module, name, wrapper_factory(orig))
    try:
        yield
    finally:
        setattr(module, name, orig)


def _caller() -> str:
    frame = inspect.stack()[2]
    return f"{Path(frame.filename).stem}.{frame.function}"


def capture_mx(calls: list):
    def factory(orig):
        def to_mx(data_hp, elem_dtype, block_size, scaling_mode=ScaleCalculationMode.FLOOR, is_swizzled_scales=False):
            scale, data = orig(data_hp, elem_dtype, block_size, scaling_mode, is_swizzled_scales)
            calls.append(
                dict(
                    input=data_hp.detach().clone(),
                    elem_dtype=elem_dtype,
                    block_size=block_size,
                    scaling_mode=scaling_mode,
                    is_swizzled_scales=is_swizzled_scales,
                    scale=scale.detach().clone(),
                    data=data.detach().clone(),
                    caller=_caller(),
                )
            )
            return scale, data

        return to_mx

    return patched(mx_tensor, "to_mx", factory)


def capture_f8(calls: list):
    def factory(orig):
        def hp_tensor_to_float8_dynamic(hp_tensor, float8_dtype, linear_mm_config, **kw):
            out = orig(hp_tensor, float8_dtype, linear_mm_config, **kw)
            calls.append(
                dict(
                    input=hp_tensor.detach().clone(),
                    float8_dtype=float8_dtype,
                    kwargs={k: str(v) for k, v in kw.items()},
                    axiswise_dim=kw.get("axiswise_dim"),
                    scale=out._scale.detach().clone(),
                    data=out._data.detach().clone(),
                    caller=_caller(),
                )
            )
            return out

        return hp_tensor_to_float8_dynamic

    return patched(f8_linear, "hp_tensor_to_float8_dynamic", factory)


def versions() -> dict:
    return dict(
        torch=torch.__version__,
        torchao=torchao.__version__,
        numpy=np.__version__,
        torchao_dist=importlib.metadata.version("torchao"),
    )


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------- MX


def mx_deq(data: np.ndarray, scale: np.ndarray, fp4: bool, block: int = 32) -> np.ndarray:
    """Dequantize captured MX operand (elements blocked along the last axis)."""
    if fp4:
        mag = FP4_VALUES[data & 7]
        vals = np.where(data & 8, -mag, mag).astype(np.float32)
    else:
        vals = torch.from_numpy(data).view(E4M3).float().numpy()
    s = np.exp2(scale.astype(np.float32) - 127.0).astype(np.float32)
    return (vals.reshape(*vals.shape[:-1], -1, block) * s[..., None]).reshape(vals.shape)


def run_mx(x, w, dy, elem: torch.dtype, mode: ScaleCalculationMode, wgrad_with_hp: bool = False):
    calls: list = []
    xr = x.clone().requires_grad_(True)
    if elem == E4M3:
        cfg = MXFP8TrainingOpConfig(
            kernel_preference=KernelPreference.EMULATED, scale_calculation_mode=mode, wgrad_with_hp=wgrad_with_hp
        )
        lin = nn.Linear(x.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        model = nn.Sequential(lin)
        quantize_(model, cfg)
        with capture_mx(calls):
            y = model(xr)
            y.backward(dy)
        dw = lin.weight.grad
        call = (
            "m = nn.Sequential(nn.Linear(K, N, bias=False)); "
            f"torchao.quantization.quantize_(m, torchao.prototype.moe_training.config.MXFP8TrainingOpConfig("
            f"kernel_preference=KernelPreference.EMULATED, scale_calculation_mode=ScaleCalculationMode.{mode.name}, "
            f"wgrad_with_hp={wgrad_with_hp})); y = m(x); y.backward(dy)"
        )
    else:
        wr = w.clone().requires_grad_(True)
        args = (
            elem, elem, elem, 32, KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TRITON,
            MXFP8Dim1CastKernelChoice.CUDA, mode, wgrad_with_hp,
        )  # fmt: skip
        with capture_mx(calls):
            y = mx_mm.apply(xr, wr, *args)
            y.backward(dy)
        dw = wr.grad
        call = (
            "y = torchao.prototype.moe_training.mxfp8_linear.mx_mm.apply(x, w, torch.float4_e2m1fn_x2, "
            "torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2, 32, KernelPreference.EMULATED, "
            "MXFP8Dim0CastKernelChoice.TRITON, MXFP8Dim1CastKernelChoice.CUDA, "
            f"ScaleCalculationMode.{mode.name}, {wgrad_with_hp}); y.backward(dy)  "
            "# the argument list _to_mxfp8_then_scaled_mm (MXFP8Linear / MXFP8TrainingOpConfig) passes, "
            "with fp4 element dtypes: torchao has no fp4 training config, mx_mm itself is dtype-generic"
        )
    y, dx, dw = y.detach(), xr.grad.detach(), dw.detach()
    fp4 = elem == FP4
    expected = [("x", x), ("w", w), ("dy", dy), ("w.T", w.t()), ("dy.T", dy.t()), ("x.T", x.t())]
    roles = ROLES[:4] if wgrad_with_hp else ROLES
    assert len(calls) == len(roles), [c["caller"] for c in calls]
    arrays, role_meta, deq = {}, {}, {}
    for role, c, (expr, ref) in zip(roles, calls, expected, strict=False):
        assert torch.equal(c["input"], ref), (role, expr)
        assert c["block_size"] == 32 and c["scaling_mode"] == mode and not c["is_swizzled_scales"]
        data = unpack_uint4(c["data"]) if fp4 else c["data"].view(torch.uint8)
        data = data.contiguous().numpy()
        scale = c["scale"].view(torch.uint8).contiguous().numpy()
        assert data.shape == tuple(ref.shape) and scale.shape == (ref.shape[0], ref.shape[1] // 32)
        arrays[f"{role}_data"], arrays[f"{role}_scale"] = data, scale
        deq[role] = torch.from_numpy(mx_deq(data, scale, fp4))
        role_meta[role] = dict(
            operand=expr,
            stored_shape=list(ref.shape),
            block_axis=1,
            block_size=32,
            contracting_axis=1,
            elem_dtype="float4_e2m1fn (unpacked codes, sign=bit3)" if fp4 else "float8_e4m3fn (bits)",
            scale_dtype="float8_e8m0fnu (biased exponent bits, bias 127)",
            scale_shape=list(scale.shape),
            quantize_call=(
                f"torchao.prototype.mx_formats.mx_tensor.to_mx({expr}.contiguous(), {c['elem_dtype']}, 32, "
                f"ScaleCalculationMode.{mode.name}, False)"
            ),
            called_from=c["caller"],
        )
    # recompute the GEMMs from the captured bits: every GEMM is lhs @ rhs.T, both blocked along the contraction
    check = dict(y_max_abs_diff=_maxdiff(deq["fwd_lhs"] @ deq["fwd_rhs"].t(), y))
    check["dx_max_abs_diff"] = _maxdiff(deq["dgrad_lhs"] @ deq["dgrad_rhs"].t(), dx)
    if wgrad_with_hp:
        check["dw_max_abs_diff"] = _maxdiff(dy.t() @ x, dw)
    else:
        check["dw_max_abs_diff"] = _maxdiff(deq["wgrad_lhs"] @ deq["wgrad_rhs"].t(), dw)
    meta = dict(
        family="mx",
        end_to_end_call=call,
        elem_dtype_all_roles="float4_e2m1fn" if fp4 else "float8_e4m3fn",
        scale_calculation_mode=mode.name,
        roles=role_meta,
        gemms=dict(
            y="y = deq(fwd_lhs) @ deq(fwd_rhs).T  (torch.mm of float32 dequantized operands)",
            dx="dx = deq(dgrad_lhs) @ deq(dgrad_rhs).T",
            dw="dw = dy.T @ x in float32 (high precision)"
            if wgrad_with_hp
            else "dw = deq(wgrad_lhs) @ deq(wgrad_rhs).T",
        ),
        dw_precision="float32 (not quantized)" if wgrad_with_hp else "quantized",
        scale_convention=(
            "deq = element_value * 2**(scale_bits - 127) per 32-block along the stored last axis "
            "(torchao to_dtype: data.to(f32) * torch.pow(2, scale - 127)); scale_bits 255 = NaN"
        ),
        fp4_packing="torchao packs pairs along the last axis: byte = code[2i] | code[2i+1] << 4" if fp4 else None,
        check=check,
    )
    return dict(y=y, dx=dx, dw=dw), arrays, meta


# ---------------------------------------------------------------- float8


def run_f8(x, w, dy, recipe: str, pow2: bool = False):
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    if pow2:
        cfg = dataclasses.replace(cfg, round_scales_to_power_of_2=True)
    results = {}
    for emulate in (True, False):
        calls: list = []
        lin = nn.Linear(x.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        model = convert_to_float8_training(nn.Sequential(lin), config=dataclasses.replace(cfg, emulate=emulate))
        xr = x.clone().requires_grad_(True)
        with capture_f8(calls):
            y = model(xr)
            y.backward(dy)
        results[emulate] = (y.detach(), xr.grad.detach(), model[0].weight.grad.detach(), calls)
    y, dx, dw, calls = results[True]
    c = cfg
    specs = [  # role, expr, reference, cast config, gemm use
        ("fwd_lhs", "x", x, c.cast_config_input),
        ("fwd_rhs", "w.T", w.t(), c.cast_config_weight),
        ("dgrad_lhs", "dy", dy, c.cast_config_grad_output),
        ("dgrad_rhs", "w.T", w.t(), c.cast_config_weight_for_grad_input),
        ("wgrad_lhs", "dy", dy, c.cast_config_grad_output_for_grad_weight),
        ("wgrad_rhs", "x", x, c.cast_config_input_for_grad_weight),
    ]
    specs = [s for s in specs if s[3].scaling_type.name != "DISABLED"]
    assert len(calls) == len(specs), [k["caller"] for k in calls]
    arrays, role_meta, deq = {}, {}, {}
    for (role, expr, ref, cc), k in zip(specs, calls, strict=True):
        assert torch.equal(k["input"], ref), (role, expr)
        assert k["float8_dtype"] == cc.target_dtype
        data = k["data"].view(torch.uint8).contiguous().numpy()
        scale = k["scale"].contiguous().numpy().astype(np.float32)
        arrays[f"{role}_data"], arrays[f"{role}_scale"] = data, scale
        deq[role] = torch.from_numpy(data).view(cc.target_dtype).float() / torch.from_numpy(scale)
        ax = k["axiswise_dim"]
        role_meta[role] = dict(
            operand=expr,
            stored_shape=list(ref.shape),
            granularity=cc.scaling_granularity.name,
            amax_reduced_over_axis=None if ax is None else ax % 2,
            scale_shape=list(scale.shape),
            elem_dtype=f"{str(cc.target_dtype).removeprefix('torch.')} (bits)",
            scale_dtype="float32",
            round_scales_to_power_of_2=c.round_scales_to_power_of_2,
            quantize_call=(
                f"torchao.float8.float8_scaling_utils.hp_tensor_to_float8_dynamic({expr}, {cc.target_dtype}, "
                f"linear_mm_config, {', '.join(f'{a}={v}' for a, v in k['kwargs'].items())})"
            ),
            called_from=k["caller"],
        )
    check = dict(y_max_abs_diff=_maxdiff(deq["fwd_lhs"] @ deq["fwd_rhs"], y))
    check["dx_max_abs_diff"] = _maxdiff(deq["dgrad_lhs"] @ deq["dgrad_rhs"].t(), dx)
    if "wgrad_lhs" in deq:
        check["dw_max_abs_diff"] = _maxdiff(deq["wgrad_lhs"].t() @ deq["wgrad_rhs"], dw)
        dw_gemm = "dw = deq(wgrad_lhs).T @ deq(wgrad_rhs)"
    else:
        check["dw_max_abs_diff"] = _maxdiff(dy.t() @ x, dw)
        dw_gemm = "dw = dy.T @ x in float32 (high precision, cast configs DISABLED)"
    ys, dxs, dws, _ = results[False]
    check["cpu_scaled_mm_vs_emulate_max_abs_diff"] = dict(y=_maxdiff(ys, y), dx=_maxdiff(dxs, dx), dw=_maxdiff(dws, dw))
    extra = ", round_scales_to_power_of_2=True" if pow2 else ""
    meta = dict(
        family="float8",
        end_to_end_call=(
            f"cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name({recipe!r}){extra}, emulate=True); "
            "m = torchao.float8.convert_to_float8_training(nn.Sequential(nn.Linear(K, N, bias=False)), config=cfg); "
            "y = m(x); y.backward(dy)"
        ),
        round_scales_to_power_of_2=c.round_scales_to_power_of_2,
        roles=role_meta,
        gemms=dict(
            y="y = deq(fwd_lhs) @ deq(fwd_rhs)  (fwd_rhs stored as w.T [K, N])",
            dx="dx = deq(dgrad_lhs) @ deq(dgrad_rhs).T  (dgrad_rhs stored as w.T [K, N])",
            dw=dw_gemm + "  (torchao computes (dy.T @ x) and returns its .T as the grad of w.T)",
        ),
        dw_precision="quantized" if "wgrad_lhs" in deq else "float32 (not quantized)",
        scale_convention=(
            "scale = float32(float64(fp8_max) / clamp(float64(amax), min=1e-12)); pow2: exp2(floor(log2(scale))); "
            "quantize: bits = to_fp8(clamp(x_f32 * scale, -fp8_max, fp8_max)) (RNE); dequantize: bits.float() / scale"
        ),
        emulate_note="emulate=True: torch.mm(a._data.float() / a._scale, b._data.float() / b._scale) in float32; "
        "check.cpu_scaled_mm_vs_emulate_max_abs_diff compares emulate=False (torch._scaled_mm on CPU)",
        check=check,
    )
    return dict(y=y, dx=dx, dw=dw), arrays, meta


# ---------------------------------------------------------------- blockwise float8 (DeepSeek-V3)


def capture_blockwise(calls: list, deq: dict):
    """Run torchao's ``fp8_blockwise_mm`` autograd function on CPU: its five Triton quantizers are
    swapped for torchao's own PyTorch reference quantizers (``kernels.torch_blockwise_scale_*``,
    the same arithmetic: ``s = float32(448 / float64(max(amax, 1e-12)))``, ``q = fp8(clamp(x * s))``,
    scale ``1 / s``), each call recorded, and its GEMM for one float32 matmul of the recorded
    operands' dequantized values (``data.float() * scale`` per block). The role each tensor plays,
    and which quantizer it gets, is torchao's own code in ``fp8_blockwise_mm.forward/backward``."""

    def record(name, fn):
        def wrapped(t, block_size=128, *rest, **kw):
            data, scale = fn(t)
            if name.startswith("weight"):
                full = scale.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
            elif name == "act_quant_rhs":  # 128 x 1 blocks along rows, scale [M/128, K]
                full = scale.repeat_interleave(block_size, 0)
            else:  # 1 x 128 blocks along the last axis, scale [rows, cols/128]
                full = scale.repeat_interleave(block_size, 1)
            deq[id(data)] = data.float() * full
            calls.append(dict(name=name, input=t.detach().clone(), data=data, scale=scale))
            return data, scale

        return wrapped

    ref = bw_kernels

    def transposed(fn):
        return lambda t: fn(t.t().contiguous())

    refs = {
        "triton_fp8_blockwise_act_quant_lhs": record("act_quant_lhs", ref.torch_blockwise_scale_act_quant_lhs),
        "triton_fp8_blockwise_act_quant_transposed_lhs": record(
            "act_quant_transposed_lhs", transposed(ref.torch_blockwise_scale_act_quant_lhs)
        ),
        "triton_fp8_blockwise_act_quant_rhs": record("act_quant_rhs", ref.torch_blockwise_scale_act_quant_rhs),
        "triton_fp8_blockwise_weight_quant_rhs": record("weight_quant_rhs", ref.torch_blockwise_scale_weight_quant),
        "triton_fp8_blockwise_weight_quant_transposed_rhs": record(
            "weight_quant_transposed_rhs", transposed(ref.torch_blockwise_scale_weight_quant)
        ),
    }

    def run_mm(*, mat_a, mat_b, out_dtype, **_):
        return (deq[id(mat_a)] @ deq[id(mat_b)]).to(out_dtype)

    stack = contextlib.ExitStack()
    for name, fn in refs.items():
        stack.enter_context(patched(bw_linear, name, lambda orig, fn=fn: fn))
    stack.enter_context(patched(bw_linear, "_run_blockwise_mm", lambda orig: run_mm))
    return stack


def run_blockwise(x, w, dy):
    calls: list = []
    deq: dict = {}
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with capture_blockwise(calls, deq):
        y = bw_linear.fp8_blockwise_mm.apply(xr, wr, 128, torch.float32, False)
        y.backward(dy)
    y, dx, dw = y.detach(), xr.grad.detach(), wr.grad.detach()
    specs = [  # role, torchao quantizer, operand expr, reference, block description
        ("fwd_lhs", "act_quant_lhs", "x", x, "1x128 along K"),
        ("fwd_rhs", "weight_quant_transposed_rhs", "w.T", w.t(), "128x128 tiles"),
        ("dgrad_lhs", "act_quant_lhs", "dy", dy, "1x128 along N"),
        ("dgrad_rhs", "weight_quant_rhs", "w", w, "128x128 tiles"),
        ("wgrad_lhs", "act_quant_transposed_lhs", "dy.T", dy.t(), "1x128 along M"),
        ("wgrad_rhs", "act_quant_rhs", "x", x, "128x1 along M"),
    ]
    assert [c["name"] for c in calls] == [s[1] for s in specs], [c["name"] for c in calls]
    arrays, role_meta, deqs = {}, {}, {}
    for (role, qname, expr, ref, blocks), c in zip(specs, calls, strict=True):
        # the transposed quantizers were given the untransposed tensor; the recorded data is of expr
        given = ref.t() if qname.endswith("transposed_lhs") or qname.endswith("transposed_rhs") else ref
        assert torch.equal(c["input"], given), (role, expr)
        data = c["data"].view(torch.uint8).contiguous().numpy()
        scale = c["scale"].contiguous().numpy().astype(np.float32)
        assert data.shape == tuple(ref.shape), (role, data.shape)
        arrays[f"{role}_data"], arrays[f"{role}_scale"] = data, scale
        deqs[role] = deq[id(c["data"])]
        role_meta[role] = dict(
            operand=expr,
            stored_shape=list(ref.shape),
            blocks=blocks,
            scale_shape=list(scale.shape),
            elem_dtype="float8_e4m3fn (bits)",
            scale_dtype="float32 (1 / s: the multiplier)",
            torchao_kernel=f"torchao.prototype.blockwise_fp8_training.kernels.triton_fp8_blockwise_{qname}",
            reference_used=(
                "kernels.torch_blockwise_scale_"
                + {"act_quant_lhs": "act_quant_lhs(t)", "act_quant_transposed_lhs": "act_quant_lhs(t.t().contiguous())",
                   "act_quant_rhs": "act_quant_rhs(t)", "weight_quant_rhs": "weight_quant(t)",
                   "weight_quant_transposed_rhs": "weight_quant(t.t().contiguous())"}[qname]
            ),
        )  # fmt: skip
    check = dict(
        y_max_abs_diff=_maxdiff(deqs["fwd_lhs"] @ deqs["fwd_rhs"], y),
        dx_max_abs_diff=_maxdiff(deqs["dgrad_lhs"] @ deqs["dgrad_rhs"], dx),
        dw_max_abs_diff=_maxdiff(deqs["wgrad_lhs"] @ deqs["wgrad_rhs"], dw),
    )
    meta = dict(
        family="blockwise",
        end_to_end_call=(
            "y = torchao.prototype.blockwise_fp8_training.linear.fp8_blockwise_mm.apply(x, w, 128, torch.float32, "
            "False); y.backward(dy)  # the autograd function of Float8BlockwiseLinear, whose Triton quantizers "
            "need a GPU: each is replaced by torchao's PyTorch reference of it (kernels.torch_blockwise_scale_*) "
            "and the blockwise scaled GEMM by a float32 matmul of the dequantized operands"
        ),
        roles=role_meta,
        gemms=dict(
            y="y = deq(fwd_lhs) @ deq(fwd_rhs)  (fwd_rhs stored as w.T [K, N])",
            dx="dx = deq(dgrad_lhs) @ deq(dgrad_rhs)  (dgrad_rhs stored as w [N, K])",
            dw="dw = deq(wgrad_lhs) @ deq(wgrad_rhs)  (wgrad_lhs stored as dy.T [N, M], wgrad_rhs as x [M, K])",
        ),
        scale_convention=(
            "s = float32(fp8_max / float64(clamp(amax, min=1e-12))) per block; bits = to_fp8(clamp(x_f32 * s, "
            "-fp8_max, fp8_max)) (RNE); stored scale = 1 / s (float32); dequantize: bits.float() * scale"
        ),
        check=check,
    )
    return dict(y=y, dx=dx, dw=dw), arrays, meta


def plant_blockwise(x, w, dy):
    """Cases of the 128-blocks: a whole zero block of x along K, a block whose amax is below the
    1e-12 clamp (the scale comes from the clamp), a weight tile of tiny values, and a 128-block of
    dy along M that is all zero (rows 128..255 of one column)."""
    x[20, 128:256] = 0.0
    x[21, 0:128] = torch.linspace(-3e-13, 3e-13, 128)
    w[0:128, 128:256] *= 1e-6
    dy[128:256, 3] = 0.0
    return x, w, dy


# ---------------------------------------------------------------- main

RECIPES = {
    "mxfp8_floor": lambda x, w, dy: run_mx(x, w, dy, E4M3, ScaleCalculationMode.FLOOR),
    "mxfp8_rceil": lambda x, w, dy: run_mx(x, w, dy, E4M3, ScaleCalculationMode.RCEIL),
    "mxfp8_rceil_wgrad_hp": lambda x, w, dy: run_mx(x, w, dy, E4M3, ScaleCalculationMode.RCEIL, wgrad_with_hp=True),
    "mxfp4_floor": lambda x, w, dy: run_mx(x, w, dy, FP4, ScaleCalculationMode.FLOOR),
    "mxfp4_rceil": lambda x, w, dy: run_mx(x, w, dy, FP4, ScaleCalculationMode.RCEIL),
    "float8_tensorwise": lambda x, w, dy: run_f8(x, w, dy, "tensorwise"),
    "float8_tensorwise_pow2": lambda x, w, dy: run_f8(x, w, dy, "tensorwise", pow2=True),
    "float8_rowwise": lambda x, w, dy: run_f8(x, w, dy, "rowwise"),
    "float8_rowwise_with_gw_hp": lambda x, w, dy: run_f8(x, w, dy, "rowwise_with_gw_hp"),
    "float8_blockwise": run_blockwise,
}
BLOCKWISE = ("float8_blockwise",)  # every dimension a multiple of 128
CASES = [
    ((64, 128, 96), [r for r in RECIPES if r not in BLOCKWISE]),
    ((128, 256, 160), ["mxfp8_rceil"]),
    ((256, 256, 128), list(BLOCKWISE)),
]
INPUT_KINDS = ("edges", "normal", "rows", "bf16", "student_t")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "recipes" / "vectors"))
    ap.add_argument("--only", nargs="*", help="recipe names to (re)generate")
    ap.add_argument("--shape", nargs=3, type=int, metavar=("M", "K", "N"), help="one shape, every recipe")
    ap.add_argument("--inputs", nargs="*", default=["edges"], choices=INPUT_KINDS, help="input distributions")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    cases = [(tuple(args.shape), list(RECIPES))] if args.shape else CASES
    for (m, k, n), names in cases:
        seed = 1000 * m + n
        names = [r for r in names if not args.only or r in args.only]
        if any(d % 128 for d in (m, k, n)) and set(names) & set(BLOCKWISE):
            skipped = sorted(set(names) & set(BLOCKWISE))
            print(f"skipping {skipped} at {m}x{k}x{n}: every size must be a multiple of 128")
            names = [r for r in names if r not in BLOCKWISE]
        for kind in args.inputs:
            torch.manual_seed(seed)
            x, w, dy = make_inputs(m, k, n, seed, kind)
            if kind == "edges" and names and set(names) <= set(BLOCKWISE):
                x, w, dy = plant_blockwise(x, w, dy)
            for name in names:
                write(out, name, (m, k, n), kind, seed, x, w, dy)


def write(out: Path, name: str, mkn: tuple[int, int, int], kind: str, seed: int, x, w, dy) -> None:
    """Run one recipe and save its npz; a kind other than ``edges`` is named after the shape."""
    m, k, n = mkn
    outs, arrays, meta = RECIPES[name](x, w, dy)
    meta = dict(
        recipe=name,
        shapes=dict(M=m, K=k, N=n, x=[m, k], w=[n, k], dy=[m, n]),
        inputs=f"make_inputs({m}, {k}, {n}, seed={seed}, kind={kind!r}) in scripts/make_recipe_vectors.py",
        versions=versions(),
        torch_num_threads=1,
        **meta,
    )
    suffix = "" if kind == "edges" else f"-{kind}"
    path = out / f"{name}_{m}x{k}x{n}{suffix}.npz"
    np.savez_compressed(
        path,
        x=x.numpy(),
        w=w.numpy(),
        dy=dy.numpy(),
        **{key: v.numpy() for key, v in outs.items()},
        **arrays,
        meta=np.array(json.dumps(meta, indent=1)),
    )
    print(f"{path.name}: {path.stat().st_size // 1024} KiB check={meta['check']}", flush=True)


if __name__ == "__main__":
    main()
