"""Reference vectors from torchao's MXFP8 grouped-GEMM training path (a mixture of experts' expert bank).

Writes ``tests/recipes/vectors/grouped/<recipe>_<case>.npz`` for ``y = grouped_mm(x, w_t, offs)``:
tokens x [M, K] in consecutive groups (``sizes``, one per expert), expert weights w_t [G, K, N]
(JAX's ``lax.ragged_dot(x, w_t, sizes)``), upstream gradient dy [M, N], run through
``torchao.prototype.moe_training.mxfp8_grouped_mm._to_mxfp8_then_scaled_grouped_mm`` with
``kernel_preference=KernelPreference.EMULATED`` on CPU (the path ``MXFP8TrainingOpConfig`` takes
for ``torch._grouped_mm``), FLOOR and RCEIL scales, groups aligned to 32 rows or padded to them
(``pad_token_groups_for_grouped_mm=True``, as torchao requires for groups that are not).

Run it in the venv of ``scripts/make_recipe_vectors.py`` (torch is not a dependency of this repository)::

    ~/.cache/qformats-peers/torchao-venv/bin/python scripts/make_grouped_recipe_vectors.py [--out DIR]

(the committed vectors were made with torch 2.14.1, torchao 0.18.0). torch's CPU ``_grouped_mm``
returns its first operand's dtype, so torchao's emulated y, dx and dw are bfloat16 here (stored as
float32); the operands are the reference.

The script wraps ``to_mx`` as the grouped-GEMM module calls it and records its six calls in order:
fwd_lhs (x, padded), fwd_rhs (w_t transposed to [G, N, K], blocked along K), dgrad_lhs (dy, padded),
dgrad_rhs (w_t [G, K, N] blocked along N), wgrad_lhs (padded dy transposed, blocked along the
tokens), wgrad_rhs (padded x transposed). Each npz holds x, w, dy, sizes, y, dx, dw, each role's
``<role>_data`` (E4M3 bits) and ``<role>_scale`` (E8M0 bits) as torchao stored them, the padded
group starts ``padded_starts`` (torchao's row of each group's first token in the padded operands),
and ``meta`` (versions, calls, layouts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torchao.prototype.moe_training.mxfp8_grouped_mm as grouped_mm
from make_recipe_vectors import ROLES, patched, versions
from torchao.prototype.moe_training.kernels.mxfp8 import torch_pad_token_groups
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

# (name, group sizes, pad): sizes sum to M = 128 rows
CASES = {
    "aligned": ([32, 0, 64, 32], False),
    "padded": ([37, 0, 67, 24], True),
}
K, N = 64, 96
OPERANDS = ("x (padded)", "w_t.transpose(-2, -1)", "dy (padded)", "w_t", "dy (padded).T", "x (padded).T")


def make_inputs(sizes, seed: int):
    """randn x, w_t * 0.05, dy * 1e-3 with planted cases: outliers, an all-zero 32-block of one
    token, a zero token row of dy, an amax of exactly 448 and one float32 ulp above it."""
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    x = torch.randn(m, K, generator=g)
    w = torch.randn(len(sizes), K, N, generator=g) * 0.05
    dy = torch.randn(m, N, generator=g) * 1e-3
    x[3, 5], x[m // 2, K - 1], w[2, 9, 7] = 48.0, -300.0, 1.5
    x[10, 32:64] = 0.0
    x[12, 0] = 448.0
    x[14, 0] = float(np.nextafter(np.float32(448), np.float32(449)))
    dy[5, :] = 0.0
    dy[m - 3, N // 2] = -0.0625
    return x, w, dy


def capture(calls: list):
    def factory(orig):
        def to_mx(data_hp, *args, **kwargs):
            scale, data = orig(data_hp, *args, **kwargs)
            calls.append(dict(input=data_hp.detach().clone(), scale=scale, data=data, kwargs=kwargs))
            return scale, data

        return to_mx

    return patched(grouped_mm, "to_mx", factory)


def run(sizes, pad: bool, mode: ScaleCalculationMode, seed: int):
    x, w, dy = make_inputs(sizes, seed)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    # torchao takes w_t [G, K, N] "per group column-major": a transposed view of [G, N, K] storage
    xr, w_nk = x.clone().requires_grad_(True), w.transpose(-2, -1).contiguous().requires_grad_(True)
    calls: list = []
    with capture(calls):
        y = grouped_mm._to_mxfp8_then_scaled_grouped_mm(
            xr,
            w_nk.transpose(-2, -1),
            offs,
            out_dtype=torch.bfloat16,
            kernel_preference=KernelPreference.EMULATED,
            scale_calculation_mode=mode,
            pad_token_groups_for_grouped_mm=pad,
        )
        y.backward(dy.bfloat16())
    assert len(calls) == len(ROLES), len(calls)
    if pad:
        xp, starts, _ = torch_pad_token_groups(x, offs, alignment_size=32)
        dyp, _, _ = torch_pad_token_groups(dy, offs, alignment_size=32)
    else:
        xp, dyp, starts = x, dy, offs - torch.tensor(sizes, dtype=torch.int32)
    expected = (xp, w.transpose(-2, -1), dyp.bfloat16().float(), w, dyp.bfloat16().float().t(), xp.t())
    arrays, roles = {}, {}
    for role, c, expr, ref in zip(ROLES, calls, OPERANDS, expected, strict=True):
        assert torch.equal(c["input"].float(), ref), role
        assert c["kwargs"]["block_size"] == 32 and c["kwargs"]["scaling_mode"] == mode
        arrays[f"{role}_data"] = c["data"].view(torch.uint8).contiguous().numpy()
        arrays[f"{role}_scale"] = c["scale"].view(torch.uint8).contiguous().numpy()
        roles[role] = dict(operand=expr, stored_shape=list(ref.shape), block_axis=-1, block_size=32)
    meta = dict(
        call=(
            "torchao.prototype.moe_training.mxfp8_grouped_mm._to_mxfp8_then_scaled_grouped_mm(x, w_t, offs, "
            "out_dtype=torch.bfloat16, kernel_preference=KernelPreference.EMULATED, "
            f"scale_calculation_mode=ScaleCalculationMode.{mode.name}, pad_token_groups_for_grouped_mm={pad}); "
            "y.backward(dy.bfloat16())"
        ),
        roles=roles,
        dy_dtype="bfloat16 (torchao's emulated path runs the backward in y's dtype)",
        layout="every stored operand is blocked along its last axis, one E8M0 scale per 32 elements",
        versions=versions(),
    )
    outs = dict(y=y.detach().float(), dx=xr.grad.detach().float(), dw=w_nk.grad.detach().float().transpose(-2, -1))
    inputs = dict(x=x, w=w, dy=dy.bfloat16().float(), sizes=torch.tensor(sizes), padded_starts=starts)
    return {**{k: v.numpy() for k, v in {**inputs, **outs}.items()}, **arrays}, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "tests" / "recipes" / "vectors" / "grouped"
    ap.add_argument("--out", default=str(default))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for seed, (case, (sizes, pad)) in enumerate(CASES.items()):
        for mode in (ScaleCalculationMode.FLOOR, ScaleCalculationMode.RCEIL):
            arrays, meta = run(sizes, pad, mode, seed)
            path = out / f"mxfp8_{mode.name.lower()}_{case}.npz"
            np.savez_compressed(path, **arrays, meta=np.array(json.dumps(meta, indent=1)))
            print(f"{path.name}: {path.stat().st_size // 1024} KiB", flush=True)


if __name__ == "__main__":
    main()
