"""A grouped GEMM (``lax.ragged_dot``, a mixture of experts' expert bank) under every recipe.

The reference is the same program written one expert at a time: expert ``g``'s tokens (its rows,
zero-padded to whole 32-row blocks) through a dense linear layer with weight ``w[g]`` under the
same recipe. Its quantized operands are the grouped GEMM's, so ``y``, ``dx`` and ``dw`` must agree
up to float32 summation order; the dense recipes themselves are torchao's bit for bit
(test_torchao_vectors.py), and the grouped MXFP8 ones too (test_torchao_grouped_vectors.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from scalify import recipes
from scalify.amp._transposes import Transposes
from scalify.recipes import _grouped
from scalify.recipes._gemm import Contraction, quantize_operand

M, K, N, G = 128, 64, 96, 4
RECIPES = {
    "mxfp8": recipes.MXFP8,
    "mxfp8_rceil": recipes.MXFP8_RCEIL,
    "mxfp4": recipes.MXFP4,
    "mxfp4_rceil": recipes.MXFP4_RCEIL,
    "float8_tensorwise": recipes.FLOAT8_TENSORWISE,
    "float8_tensorwise_pow2": recipes.FLOAT8_TENSORWISE_POW2,
    "float8_rowwise": recipes.FLOAT8_ROWWISE,
    # NVIDIA's recipe (2-D weight tiles, per-tensor second-level scales, the Hadamard transform on the
    # weight gradient) without its stochastic rounding, whose draws depend on the layout
    "nvfp4_nearest": recipes.NVFP4.replace(stochastic_rounding=()),
}
SIZES = {"unaligned": [37, 0, 67, 24], "short": [5, 40, 30, 20]}  # "short": 33 rows no group takes


def _data(shape, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale * np.exp2(rng.integers(-3, 4, shape[-1:]))).astype(np.float32)


def _inputs():
    return _data((M, K), 0), _data((G, K, N), 1, 0.05), _data((M, N), 2, 1e-3)


def _per_expert(recipe, x, w, dy, sizes):
    """``y, dx, dw`` of the experts as dense layers, one at a time, under ``recipe``."""
    dense = jax.jit(recipes.apply(lambda a, b: a @ b, recipe))
    y, dx, dw = np.zeros((M, N), np.float32), np.zeros((M, K), np.float32), np.zeros_like(w)
    start = 0
    for g, s in enumerate(sizes):
        rows = -(-s // 32) * 32
        if rows:
            pad = lambda a, lo=start, s=s, rows=rows: np.concatenate([a[lo : lo + s], np.zeros((rows - s, a.shape[1]))])
            yg, vjp = jax.vjp(dense, pad(x).astype(np.float32), w[g])
            dxg, dw[g] = vjp(pad(dy).astype(np.float32))
            y[start : start + s], dx[start : start + s] = yg[:s], dxg[:s]
        start += s
    return y, dx, dw


def _expert(x, w, gs):
    eqn = jax.make_jaxpr(lax.ragged_dot)(x, w, gs).eqns[0]
    expert = _grouped.Expert.of(Contraction(eqn.primitive, tuple(sorted(eqn.params.items()))), x.ndim)
    return expert, expert.aims(x.ndim, w.ndim)


def _grouped_vjp(recipe, x, w, dy, sizes):
    gs = jnp.asarray(sizes, jnp.int32)
    y, vjp = jax.vjp(jax.jit(recipes.apply(lambda a, b: lax.ragged_dot(a, b, gs), recipe)), x, w)
    return (y, *vjp(dy))


def _close(ours, ref, summed: int):
    """Equal up to float32 summation order: within ``summed * 2**-24`` of the largest output."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=summed * 2.0**-24 * float(np.max(np.abs(ref))) + 1e-30)


@pytest.mark.parametrize("case", SIZES)
@pytest.mark.parametrize("name", RECIPES)
def test_grouped_gemm_is_each_expert_under_the_recipe(name, case):
    x, w, dy = _inputs()
    recipe, sizes = RECIPES[name], SIZES[case]
    ours, ref = _grouped_vjp(recipe, x, w, dy, sizes), _per_expert(recipe, x, w, dy, sizes)
    for o, r, summed in zip(ours, ref, (K, N, M), strict=True):
        _close(o, r, summed)
    taken = sum(sizes)
    assert not np.any(np.asarray(ours[0])[taken:]) and not np.any(np.asarray(ours[1])[taken:])


@pytest.mark.parametrize("name", ["mxfp8", "float8_rowwise", "float8_tensorwise", "nvfp4_nearest"])
def test_a_gradient_taken_inside_pairs_the_grouped_gemms(name):
    """A training step that takes its gradient inside: JAX's transposition emits the grouped GEMM's
    input gradient (a ragged_dot) and weight gradient (a ragged_dot summing over each group's rows);
    both pair with the forward one and equal the custom VJP's, bit for bit (FLOAT8_TENSORWISE's
    E5M2 gradients tell an unpaired input gradient, run in the forward roles, apart)."""
    x, w, dy = _inputs()
    gs = jnp.asarray(SIZES["unaligned"], jnp.int32)
    f = lambda a, b: lax.ragged_dot(a, b, gs)
    step = lambda a, b: jax.vjp(f, a, b)[1](dy)
    assert Transposes(jax.make_jaxpr(step)(x, w)).counts == (2, 2)
    inside = jax.jit(recipes.apply(step, RECIPES[name]))(x, w)
    outside = jax.vjp(recipes.apply(f, RECIPES[name]), x, w)[1](dy)
    for i, o in zip(inside, outside, strict=True):
        np.testing.assert_array_equal(i, o)


def test_stochastic_rounding_draws_per_group_and_is_unbiased():
    """NVIDIA's recipe rounds the gradients stochastically: each group draws its own bits (two
    experts with the same tokens round them differently), and the mean over draws of the
    quantized input gradient approaches the unrounded one (each draw unbiased)."""
    x, w, dy = _inputs()
    same = np.concatenate([dy[:32], dy[:32], dy[64:]])
    gs = jnp.asarray([32, 32, 64, 0], jnp.int32)
    expert, aims = _expert(x, w, gs)
    operand = lambda r: _grouped.dgrad_operands(r, expert, aims, jnp.asarray(same), jnp.asarray(w), gs, None)[0]
    quantized = jax.jit(operand, static_argnums=0)
    gq = np.asarray(quantized(recipes.NVFP4))
    assert np.sum(gq[:32] != gq[32:64]) > 100
    # 24 seeds in one program (the seed traced, vmapped): one compilation, not 24; seed 0's draw is
    # the one compiled with the seed static.
    by_seed = jax.jit(jax.vmap(lambda s: operand(recipes.NVFP4.replace(seed=s))))
    all_draws = np.asarray(by_seed(jnp.arange(24)))
    np.testing.assert_array_equal(all_draws[0], gq)
    draws = all_draws.mean(0)
    nearest = np.asarray(quantized(recipes.NVFP4.replace(stochastic_rounding=())))
    assert np.abs(draws - same).mean() < 0.5 * np.abs(nearest - same).mean()


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=5), st.integers(0, 3))
def test_by_group_and_back_is_the_identity_on_the_groups_rows(sizes, extra):
    """Property: ``from_groups(by_group(x))`` is ``x`` on every row a group takes and zero after;
    ``by_group(x)[g]`` holds group ``g``'s rows first, zeros after."""
    m = sum(sizes) + extra
    x = np.arange(1, m * 3 + 1, dtype=np.float32).reshape(m, 3)
    gs = jnp.asarray(sizes, jnp.int32)
    groups = np.asarray(_grouped.by_group(jnp.asarray(x), 0, gs))
    start = 0
    for g, s in enumerate(sizes):
        np.testing.assert_array_equal(groups[g, :s], x[start : start + s])
        assert not np.any(groups[g, s:])
        start += s
    back = np.asarray(_grouped.from_groups(jnp.asarray(groups), 0, gs))
    np.testing.assert_array_equal(back[: sum(sizes)], x[: sum(sizes)])
    assert not np.any(back[sum(sizes) :])


def test_grouped_gemm_errors_name_the_problem():
    x, w, _ = _inputs()
    gs = jnp.asarray(SIZES["unaligned"], jnp.int32)
    grad = lambda f, a: jax.grad(lambda u, v: jnp.sum(f(u, v)), argnums=(0, 1))(a, w)
    f = recipes.apply(lambda a, b: lax.ragged_dot(a, b, gs), recipes.MXFP8)
    with pytest.raises(ValueError, match=r"wgrad_lhs.*ragged_dot_general.*rows of a grouped GEMM"):
        grad(f, x[:100])  # 100 tokens: no whole 32-row blocks for the weight gradient
    with pytest.raises(ValueError, match=r"fwd_lhs.*ragged_dot_general"):
        f(x[:, :40], w[:, :40])  # 40 features: no whole 32-blocks along K
    dims = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    summed = recipes.apply(lambda a, b: lax.ragged_dot_general(a, b, gs, dims), recipes.MXFP8)
    with pytest.raises(ValueError, match=r"ragged along a summed axis.*high_precision_scopes"):
        summed(x, _data((M, N), 3))


def test_a_grouped_gemm_kept_by_scope_is_the_program():
    x, w, _ = _inputs()
    gs = jnp.asarray(SIZES["unaligned"], jnp.int32)

    def experts(a, b):
        with jax.named_scope("experts"):
            return lax.ragged_dot(a, b, gs)

    kept = recipes.apply(experts, recipes.MXFP8.replace(high_precision_scopes=("experts",)))
    np.testing.assert_array_equal(kept(x, w), experts(x, w))
    grad = lambda f: jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1))(x, w)
    for g, r in zip(grad(kept), grad(experts), strict=True):
        np.testing.assert_array_equal(g, r)
    quantized = recipes.apply(experts, recipes.MXFP8)(x, w)
    assert not np.array_equal(quantized, experts(x, w))


def test_a_users_own_grouped_backward_is_not_taken_for_the_input_gradient():
    """A ``custom_vjp`` whose backward writes its own ``ragged_dot(g, w)`` summing over the experts'
    K axis (square experts, so the shapes fit) is not JAX's input gradient, which sums over N: it
    is not paired (its dimension numbers are not the transpose rule's)."""
    gs = jnp.asarray([20, 44], jnp.int32)
    x, w, dy = _data((64, 32), 0), _data((2, 32, 32), 1), _data((64, 32), 2)

    @jax.custom_vjp
    def f(a, b):
        return lax.ragged_dot(a, b, gs)

    f.defvjp(lambda a, b: (f(a, b), (a, b)), lambda r, g: (lax.ragged_dot(g, r[1], gs), jnp.zeros_like(r[1])))
    assert Transposes(jax.make_jaxpr(lambda a, b: jax.vjp(f, a, b)[1](dy))(x, w)).counts[0] == 0


@pytest.mark.parametrize("sizes", [[20, 30], [20, 60], [64, 0], [0, 0], [0, 64], [60, 60, 0]], ids=str)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8])
def test_grouped_gemm_is_ragged_dot_on_exact_values(sizes, dtype):
    """On integers in [-8, 8] (exact in E4M3 with any power-of-two block scale, and their sums in
        float32) the MXFP8 grouped GEMM is ``ragged_dot`` itself, for groups that leave rows over, run
        past the last row (JAX drops those rows), or are empty; group sizes in int8 too (with 160 rows,
    more than int8 counts, for three groups)."""
    rng = np.random.default_rng(0)
    m, g = (160, 3) if len(sizes) == 3 else (64, 2)
    x, w, dy = (jnp.asarray(rng.integers(-8, 9, s), jnp.float32) for s in ((m, 32), (g, 32, 32), (m, 32)))
    gs = jnp.asarray(sizes, dtype)
    f = lambda a, b: lax.ragged_dot(a, b, gs)
    y, vjp = jax.vjp(recipes.apply(f, recipes.MXFP8), x, w)
    y0, vjp0 = jax.vjp(f, x, w)
    for ours, ref in zip((y, *vjp(dy)), (y0, *vjp0(dy)), strict=True):
        np.testing.assert_array_equal(ours, ref)


def _shapes(jaxpr):
    """The shapes of every value a jaxpr and its nested jaxprs compute."""
    for eqn in jaxpr.eqns:
        yield from (tuple(v.aval.shape) for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _shapes(inner)


@pytest.mark.parametrize(
    ("name", "once"),
    [
        ("mxfp8", True),
        ("mxfp4", True),
        ("float8_rowwise", True),
        ("float8_tensorwise", False),
        ("nvfp4_nearest", False),
    ],
)
def test_forward_token_operands_whose_rows_quantize_alone_are_quantized_once(name, once):
    """MX blocks and row-wise scales along the features see one token each, so the forward's token
    operand is quantized once (no copy per group); a tensor-wide scale is one per group, so it
    quantizes group by group, laid out by group. Either way each token operand is the per-group
    formula's: every group's rows laid out by group, quantized as a tensor of their own, put back."""
    recipe, sizes = RECIPES[name], jnp.asarray(SIZES["short"], jnp.int32)
    x, w, dy = _inputs()
    expert, aims = _expert(x, w, sizes)
    forward = recipes.apply(lambda u, v: lax.ragged_dot(u, v, sizes), recipe)
    assert ((G, M, K) not in set(_shapes(jax.make_jaxpr(forward)(x, w).jaxpr))) is once  # x laid out by group
    for role, v, axis in (("fwd_lhs", x, expert.x_axis), ("dgrad_lhs", dy, expert.y_axis)):
        by_group = _grouped.by_group(jnp.asarray(v), axis, sizes)
        each = jax.vmap(lambda u, role=role: quantize_operand(recipe, role, u, aims[role]))(by_group)
        ref = np.asarray(_grouped.from_groups(each, axis, sizes))
        tokens = _grouped._forward_tokens if role == "fwd_lhs" else _grouped._tokens
        np.testing.assert_array_equal(np.asarray(tokens(recipe, role, aims[role], v, axis, sizes)), ref)
        assert not np.any(ref[sum(SIZES["short"]) :])
