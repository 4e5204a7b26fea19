"""Second-order derivatives through a recipe: a gradient penalty (R1, WGAN-GP, StyleGAN2's path
length) and Hessian-vector products differentiate the recipe's GEMMs twice.

The recipe's quantizers are piecewise constant (integer codes, scales read from bits), so their own
derivative is zero, or, through a per-tensor amax, meaningless. The backward GEMMs read quantized
operands; differentiating them again must treat each quantizer as the value it approximates
(straight-through: ``d q(x) = dx``), as ``scalify.amp``'s quantizers do. Before that, the gradient of
an R1 penalty under ``jax.grad(recipes.apply(loss, r))`` was exactly zero under MXFP8 and per-tensor
FP8, and a vector of the wrong direction and 2.8 times float32's norm under NVFP4, with no error.

Reference: the same program in float32. The bound: the second-order results may be no further from
float32's than 1.5 times the first-order results of the same recipe on the same program (its
gradients ``dD/dx`` and ``dD/dparams``), relative L2 error per leaf. Measured on this program: about
0.9x to 1.3x the first-order error, which is itself about 6% (MXFP8 rceil) to 30% (MXFP4); the
second-order quantities are products of the first-order ones' factors, so their error is of the
same order. A zero gradient (relative error 1) is about 3 (MXFP4) to 16 (MXFP8 rceil) times the
first-order error. The quantized values themselves are unchanged: ``test_torchao_vectors.py`` pins
the quantized operands of the recipes torchao runs on CPU (all but NVFP4) bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalify import recipes

BUILT_INS = (
    "MXFP8",
    "MXFP8_RCEIL",
    "MXFP4",
    "MXFP4_RCEIL",
    "FLOAT8_TENSORWISE",
    "FLOAT8_TENSORWISE_POW2",
    "FLOAT8_ROWWISE",
    "NVFP4",
)
RATIO = 1.5


def _data(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


PARAMS = {"W1": _data((64, 128), 0, 1 / 8), "W2": _data((128, 64), 1, 1 / 11)}
X = _data((32, 64), 2)
V = {"W1": _data((64, 128), 3), "W2": _data((128, 64), 4)}


def critic(p, x):
    """A two-layer critic, one score per example (both widths multiples of NVFP4's 16x16 tiles)."""
    return jnp.sum(jnp.tanh(jax.nn.gelu(x @ p["W1"]) @ p["W2"]), axis=-1)


def score(p, x):
    return critic(p, x).sum()


def input_gradient(p, x):
    return jax.grad(score, argnums=1)(p, x)


def r1_penalty(p, x):
    """R1 (Mescheder et al. 2018): the squared norm of the critic's gradient at the data."""
    return jnp.sum(input_gradient(p, x) ** 2)


def _rel(got, want) -> float:
    """The largest relative L2 error over the leaves."""
    return max(
        float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / np.linalg.norm(np.asarray(w)))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def _hvp_rev_rev(f):
    """``H v`` as the gradient of ``<grad f, v>`` (reverse over reverse)."""
    inner = lambda p: sum(jax.tree.leaves(jax.tree.map(jnp.vdot, jax.grad(f)(p, X), V)))
    return jax.grad(inner)(PARAMS)


def _hvp_fwd_rev(f):
    """``H v`` as the JVP of ``grad f`` along ``v`` (forward over reverse, as ``jax.hessian``)."""
    return jax.jvp(lambda p: jax.grad(f)(p, X), (PARAMS,), (V,))[1]


@pytest.fixture(scope="module", params=BUILT_INS)
def case(request):
    """(recipe, first-order error bound) for each built-in recipe."""
    r = getattr(recipes, request.param)
    first = max(
        _rel(jax.jit(recipes.apply(input_gradient, r))(PARAMS, X), input_gradient(PARAMS, X)),
        _rel(jax.jit(jax.grad(recipes.apply(score, r)))(PARAMS, X), jax.grad(score)(PARAMS, X)),
    )
    return r, RATIO * first


def test_gradient_penalty_taken_outside(case):
    """``jax.grad(recipes.apply(loss, r))`` with the penalty's own gradient inside ``loss``."""
    r, bound = case
    got = jax.jit(jax.grad(recipes.apply(r1_penalty, r)))(PARAMS, X)
    assert _rel(got, jax.grad(r1_penalty)(PARAMS, X)) <= bound


def test_gradient_penalty_taken_inside(case):
    """``recipes.apply(jax.grad(loss), r)``: both gradients inside, as a training step writes it."""
    r, bound = case
    got = jax.jit(recipes.apply(jax.grad(r1_penalty), r))(PARAMS, X)
    assert _rel(got, jax.grad(r1_penalty)(PARAMS, X)) <= bound


@pytest.mark.parametrize("hvp", [_hvp_rev_rev, _hvp_fwd_rev], ids=["rev-over-rev", "fwd-over-rev"])
def test_hessian_vector_product(case, hvp):
    r, bound = case
    assert _rel(hvp(recipes.apply(score, r)), hvp(score)) <= bound


@pytest.mark.parametrize("name", BUILT_INS)
def test_hessian_of_a_one_layer_function(name):
    """``jax.hessian`` (``jacfwd(jacrev)``) through the recipe's custom VJP, against float32's, within
    1.5 times the recipe's error on the same function's gradient (measured 1.05x to 1.38x)."""
    r = getattr(recipes, name)
    w = PARAMS["W1"][:, :32]
    f = lambda w: jnp.sum(jnp.tanh(X @ w) ** 2)
    first = _rel(jax.grad(recipes.apply(f, r))(w), jax.grad(f)(w))
    got, want = jax.hessian(recipes.apply(f, r))(w), jax.hessian(f)(w)
    assert got.shape == want.shape == (*w.shape, *w.shape)
    assert _rel(got, want) <= RATIO * first


def test_forward_mode_outside_is_refused_by_jax_and_runs_inside(case):
    """Forward mode alone (``jax.jvp``, ``jax.jacfwd``) cannot enter a ``custom_vjp``: JAX refuses
    it. Taken inside the recipe, its tangent contractions run as forward GEMMs of the recipe: the
    primal is the recipe's forward value, the tangent (one per example) near float32's."""
    r, bound = case
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(lambda p: recipes.apply(critic, r)(p, X), (PARAMS,), (V,))
    inside = recipes.apply(lambda p, x, v: jax.jvp(lambda q: critic(q, x), (p,), (v,)), r)
    value, tangent = jax.jit(inside)(PARAMS, X, V)
    np.testing.assert_allclose(value, jax.jit(recipes.apply(critic, r))(PARAMS, X), rtol=1e-5, atol=1e-5)
    assert _rel(tangent, jax.jvp(lambda q: critic(q, X), (PARAMS,), (V,))[1]) <= bound


SQUARE = {"A": _data((32, 32), 5, 1 / 6), "B": _data((32, 32), 6, 1 / 6)}
Z, NOISE = _data((32, 32), 7), _data((32, 32), 8)


def generator(p, z):
    return jnp.tanh(jax.nn.leaky_relu(z @ p["A"]) @ p["B"])


def path_length(p, z):
    """StyleGAN2's path-length regulariser: the norm of the output's gradient by the latent."""
    g = jax.grad(lambda z: jnp.sum(generator(p, z) * NOISE))(z)
    return jnp.mean(jnp.sqrt(jnp.sum(g**2, axis=1)))


def test_penalty_inside_pmap_with_square_weights():
    """StyleGAN2's ``regul_step_G`` (flaxmodels' training code) under ``pmap``: with square weights a
    contraction the outer transposition emits looks like a forward one, and JAX's transposition binds
    it with the mapped axis's ``out_sharding`` where the forward has none. Both are quantized alike,
    so the pairing must not call them different outcomes (it raised ``ValueError`` before)."""
    add = lambda t: jax.tree.map(lambda a: a[None], t)
    step = lambda p, z: jax.lax.pmean(jax.grad(path_length)(p, z), "batch")
    r = recipes.MXFP8
    got = jax.pmap(recipes.apply(step, r), axis_name="batch")(add(SQUARE), add(Z))
    want = jax.pmap(step, axis_name="batch")(add(SQUARE), add(Z))
    score = lambda p, z: jnp.sum(generator(p, z) * NOISE)
    first = max(
        _rel(jax.grad(recipes.apply(score, r), argnums=(0, 1))(SQUARE, Z), jax.grad(score, argnums=(0, 1))(SQUARE, Z)),
        _rel(recipes.apply(jax.grad(score, argnums=(0, 1)), r)(SQUARE, Z), jax.grad(score, argnums=(0, 1))(SQUARE, Z)),
    )
    assert _rel(got, want) <= RATIO * first
