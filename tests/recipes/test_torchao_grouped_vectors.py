"""Grouped GEMMs under the MXFP8 recipes against torchao's grouped-GEMM training path (vectors made by
scripts/make_grouped_recipe_vectors.py: x [128, 64] in 4 groups, one empty, w_t [4, 64, 96]).

Every quantized operand must be bit-identical to the one torchao produced (element and E8M0 scale
bits): each token's row for the forward and input-gradient operands, each group's blocks along the
tokens for the weight-gradient ones (torchao's rows of that group in its padded operand, ours in
:func:`by_group`'s layout). ``y``, ``dx`` and ``dw`` from ``recipes.apply`` under ``jax.vjp`` must
equal torchao's, which its CPU ``_grouped_mm`` rounds to bfloat16, within half a bfloat16 ulp of
torchao's value plus ``K * 2**-24 * (|A| @ |B|)`` (float32 summation order). (Measured: ours rounded
to bfloat16 is torchao's value in every element of the committed vectors.)
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from scalify import recipes
from scalify.recipes import _grouped
from scalify.recipes._gemm import Contraction, quantize_operand

FILES = sorted((Path(__file__).parent / "vectors" / "grouped").glob("*.npz"))
RECIPES = {"mxfp8_floor": recipes.MXFP8, "mxfp8_rceil": recipes.MXFP8_RCEIL}


def _recipe(path):
    return RECIPES[path.stem.rsplit("_", 1)[0]]


def _expert(x, w, sizes):
    """The grouped GEMM's expert and its roles' axes, as the recipe finds them in ``lax.ragged_dot``."""
    eqn = jax.make_jaxpr(lax.ragged_dot)(x, w, sizes).eqns[0]
    expert = _grouped.Expert.of(Contraction(eqn.primitive, tuple(sorted(eqn.params.items()))), x.ndim)
    return expert, expert.aims(x.ndim, w.ndim)


def _bits(fmt, v, per_group=False):
    """``fmt``'s element and scale bits of ``v`` (of each ``v[g]`` with ``per_group``)."""
    quantize = fmt.replace(packed=False).quantize
    data, scale = jax.jit(jax.vmap(quantize) if per_group else quantize)(v)
    return np.asarray(data).view(np.uint8), np.asarray(scale).view(np.uint8)


def _ours(recipe, z):
    """Our operands' ``(data, scale)`` bits, in torchao's stored layouts (tokens: torchao's padded rows)."""
    x, w, dy, sizes = z["x"], z["w"], z["dy"], jnp.asarray(z["sizes"], jnp.int32)
    _, aims = _expert(x, w, sizes)
    aimed = {role: recipe.format_of(role).aim(aims[role].contracted[-1], aims[role].free[-1]) for role in aims}
    out = {role: _bits(aimed[role], v) for role, v in (("fwd_lhs", x), ("dgrad_lhs", dy))}
    out["fwd_rhs"] = tuple(np.swapaxes(a, -1, -2) for a in _bits(aimed["fwd_rhs"], w, per_group=True))
    out["dgrad_rhs"] = _bits(aimed["dgrad_rhs"], w, per_group=True)
    for role, v in (("wgrad_lhs", dy), ("wgrad_rhs", x)):
        by_group = _grouped.by_group(jnp.asarray(v), 0, sizes)
        out[role] = tuple(np.swapaxes(a, -1, -2) for a in _bits(aimed[role], by_group, per_group=True))
    return out


def _mismatches(path, recipe=None):
    z = np.load(path)
    ours = _ours(recipe or _recipe(path), z)
    sizes, starts = z["sizes"], z["padded_starts"]
    tokens = np.concatenate([p + np.arange(s) for p, s in zip(starts, sizes, strict=True)])  # torchao row of each
    found = {}
    for role in recipes.ROLES:
        data, scale = ours[role]
        ref_data, ref_scale = z[f"{role}_data"], z[f"{role}_scale"]
        if role in ("fwd_lhs", "dgrad_lhs"):
            ref_data, ref_scale = ref_data[tokens], ref_scale[tokens]
        if role.startswith("wgrad"):  # group g: its rows rounded up to whole blocks, ours from row 0
            rows = [-(-int(s) // 32) * 32 for s in sizes]
            data = np.concatenate([data[g][..., :r] for g, r in enumerate(rows)], -1)
            scale = np.concatenate([scale[g][..., : r // 32] for g, r in enumerate(rows)], -1)
            ref_data = np.concatenate([ref_data[..., p : p + r] for p, r in zip(starts, rows, strict=True)], -1)
            ref_scale = np.concatenate(
                [ref_scale[..., p // 32 : (p + r) // 32] for p, r in zip(starts, rows, strict=True)], -1
            )
        assert data.shape == ref_data.shape and scale.shape == ref_scale.shape, (role, data.shape, ref_data.shape)
        found[role] = (int(np.sum(data != ref_data)), int(np.sum(scale != ref_scale)))
    return found


def test_the_vectors_cover_both_recipes_aligned_and_padded():
    stems = {p.stem for p in FILES}
    assert stems == {f"{r}_{c}" for r in RECIPES for c in ("aligned", "padded")}, stems
    meta = json.loads(str(np.load(FILES[0])["meta"]))
    assert meta["versions"]["torchao"].startswith("0.18")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_grouped_operands_are_bit_identical_to_torchao(path):
    found = _mismatches(path)
    assert all(n == (0, 0) for n in found.values()), found


def test_blocks_across_group_boundaries_would_not_be_torchao():
    """The check above is sharp: the weight-gradient operands quantized along all tokens at once
    (blocks from row 0 of the tensor, spanning the unaligned groups) differ from torchao's."""
    z = np.load(next(p for p in FILES if p.stem.endswith("_padded")))
    fmt = recipes.MXFP8_RCEIL.format_of("wgrad_lhs").aim(0, 1).replace(packed=False)
    data, _ = _bits(fmt, z["dy"])  # [M, N], blocks of 32 tokens from token 0
    sizes, starts = z["sizes"], z["padded_starts"]
    ref = z["wgrad_lhs_data"].T  # [padded M, N]
    tokens = np.concatenate([p + np.arange(s) for p, s in zip(starts, sizes, strict=True)])
    assert np.sum(data != ref[tokens]) > 100


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_grouped_forward_and_gradients_match_torchao(path):
    z = np.load(path)
    recipe = _recipe(path)
    x, w, dy, sizes = z["x"], z["w"], z["dy"], jnp.asarray(z["sizes"], jnp.int32)
    y, vjp = jax.vjp(jax.jit(recipes.apply(lambda a, b: lax.ragged_dot(a, b, sizes), recipe)), x, w)
    dx, dw = vjp(dy)
    expert, aims = _expert(x, w, sizes)
    q = lambda role, v, axis: np.asarray(_grouped._tokens(recipe, role, aims[role], jnp.asarray(v), axis, sizes))
    qw = lambda role: np.asarray(jax.vmap(lambda u: quantize_operand(recipe, role, u, aims[role]))(w))
    groups = np.repeat(np.arange(len(z["sizes"])), z["sizes"])
    xq, dyq, wf, wd = q("fwd_lhs", x, 0), q("dgrad_lhs", dy, 0), qw("fwd_rhs"), qw("dgrad_rhs")
    abs64 = lambda a: np.abs(a.astype(np.float64))
    bounds = {
        "y": x.shape[1] * np.einsum("mk,mkn->mn", abs64(xq), abs64(wf[groups])),
        "dx": dy.shape[1] * np.einsum("mn,mkn->mk", abs64(dyq), abs64(wd[groups])),
    }
    gq, xg = _grouped.wgrad_operands(recipe, expert, aims, jnp.asarray(dy), jnp.asarray(x), sizes, None)
    bounds["dw"] = x.shape[0] * np.einsum("gmk,gmn->gkn", abs64(np.asarray(xg)), abs64(np.asarray(gq)))
    for name, ours in (("y", y), ("dx", dx), ("dw", dw)):
        ref = z[name].astype(np.float64)
        err = np.abs(np.asarray(ours, np.float64) - ref)
        half_ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-126))) - 8)  # bfloat16: 8 bits
        bound = half_ulp + 2.0**-24 * bounds[name]
        assert np.all(err <= bound + 1e-30), f"{name}: max excess {np.max(err - bound)}"
