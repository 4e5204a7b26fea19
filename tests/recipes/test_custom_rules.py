"""A recipe around a program with its own derivative rules (``jax.custom_vjp``, ``jax.custom_jvp``),
differentiated outside ``recipes.apply``.

Found on diffrax (``tests/thirdparty/test_diffrax.py``): its default adjoint is equinox's
checkpointed ``while_loop``, a ``custom_vjp`` whose forward rule holds every step of the solve, and
its ``ImplicitAdjoint`` a ``custom_jvp`` whose JVP rule solves a linear system in the tangents.

* The forward rule's jaxpr is traced lazily, apart from the primal one, and was walked with every
  operand's source unknown: under ``weights_only`` no contraction in it had a weight, so a neural
  ODE's whole solve kept float32 under ``jax.grad`` (its gradient equal to float32's, cosine 1.0)
  while the same call without ``grad`` ran under the recipe. The rule's primals now keep their
  sources.
* A contraction on a tangent inside a JVP rule became the recipe's custom-VJP GEMM, which JAX
  cannot transpose for reverse mode ("Transpose rule ... for 'custom_vjp_call' not implemented").
  It now stays as the rule wrote it (JAX transposes it); the rule's primal part runs under the
  recipe.

References: the same layer written without the custom rule under the recipe (the forward values,
bit for bit), and the derivative the rule states, evaluated in NumPy on the recipe's forward output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalify import recipes


def _data(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


W, X = _data((64, 32), 0, 0.2), _data((32, 64), 1)


@jax.custom_vjp
def _vjp_layer(w, x):
    return jnp.tanh(x @ w)


def _vjp_fwd(w, x):
    y = jnp.tanh(x @ w)
    return y, (w, x, y)


def _vjp_bwd(res, g):
    w, x, y = res
    d = g * (1 - y**2)
    return x.T @ d, d @ w.T


_vjp_layer.defvjp(_vjp_fwd, _vjp_bwd)


def _plain_layer(w, x):
    return jnp.tanh(x @ w)


@pytest.mark.parametrize("weights_only", [False, True])
def test_a_custom_vjp_forward_rule_runs_under_the_recipe(weights_only):
    """Under ``jax.value_and_grad`` JAX evaluates the forward rule, not the primal: its value is the
    recipe's, bit for bit the layer's without the custom rule, and not float32's."""
    r = recipes.MXFP8.replace(weights_only=weights_only)
    loss = lambda layer: lambda w, x: jnp.sum(layer(w, x) ** 2)
    value = jax.value_and_grad(recipes.apply(loss(_vjp_layer), r))(W, X)[0]
    want = recipes.apply(loss(_plain_layer), r)(W, X)
    np.testing.assert_array_equal(value, want)
    assert float(value) != float(loss(_plain_layer)(W, X))


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("name", ["MXFP8", "FLOAT8_TENSORWISE", "NVFP4"])
def test_a_custom_vjp_backward_rule_runs_under_the_recipe(name, weights_only):
    """JAX calls the backward rule after the walk; it is walked then. Its contractions, written by
    hand (no forward partner), are the recipe's forward GEMMs on the rule's own operands: the
    gradient is ``mm(d^T, x)^T``, ``mm(d, w^T)`` with ``d = 2 y (1 - y^2)`` on the recipe's forward
    ``y`` and ``mm`` the recipe's matmul (to float32 summation order; in ``x^T d`` the operand
    computed from one input, ``x``, is the weight, bound as the rhs: NVFP4 tiles it 16x16), and bit
    for bit the gradient taken inside ``apply``. Before, the rule ran in float32 with the gradient
    outside."""
    r = getattr(recipes, name).replace(weights_only=weights_only)
    loss = lambda w, x: jnp.sum(_vjp_layer(w, x) ** 2)
    gw, gx = jax.grad(recipes.apply(loss, r), argnums=(0, 1))(W, X)
    y = recipes.apply(_plain_layer, r)(W, X)
    d = (2 * y) * (1 - y**2)
    mm = recipes.apply(jnp.matmul, r)
    for got, want in ((gw, mm(d.T, X).T), (gx, mm(d, W.T))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    inside = recipes.apply(jax.grad(loss, argnums=(0, 1)), r)(W, X)
    np.testing.assert_array_equal(gw, inside[0])
    np.testing.assert_array_equal(gx, inside[1])
    want32 = jax.grad(loss, argnums=(0, 1))(W, X)
    assert not np.allclose(gw, want32[0], rtol=1e-3) and not np.allclose(gx, want32[1], rtol=1e-3)


@jax.custom_vjp
def _recomputing_layer(w, x):
    return jnp.tanh(x @ w)


def _recomputing_fwd(w, x):
    return _recomputing_layer(w, x), (w, x)


def _recomputing_bwd(res, g):
    # As equinox's checkpointed loops do: recompute the forward and differentiate it with jax.vjp.
    return jax.vjp(_plain_layer, *res)[1](g)


_recomputing_layer.defvjp(_recomputing_fwd, _recomputing_bwd)


@pytest.mark.parametrize("name", ["MXFP8", "FLOAT8_TENSORWISE", "FLOAT8_ROWWISE"])
def test_a_backward_rule_that_differentiates_its_forward_gets_the_backward_gemms(name):
    """A backward rule that recomputes the forward and calls ``jax.vjp`` holds JAX's transposed
    contractions: walked, they are the dgrad and wgrad GEMMs of the recomputed forward's recipe
    (FLOAT8_TENSORWISE: ``dy`` in E5M2, not the forward's E4M3), so the gradient is the recipe's
    gradient of the layer without the custom rule."""
    r = getattr(recipes, name)
    loss = lambda layer: lambda w, x: jnp.sum(layer(w, x) * X[:, :32])
    got = jax.grad(recipes.apply(loss(_recomputing_layer), r), argnums=(0, 1))(W, X)
    want = jax.grad(recipes.apply(loss(_plain_layer), r), argnums=(0, 1))(W, X)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())


@jax.custom_jvp
def _jvp_layer(w, x):
    return jnp.tanh(x @ w)


@_jvp_layer.defjvp
def _jvp_rule(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    y = _jvp_layer(w, x)
    return y, (1 - y**2) * (dx @ w + x @ dw)


@pytest.mark.parametrize("name", ["MXFP8", "FLOAT8_TENSORWISE", "NVFP4"])
def test_a_custom_jvp_rule_with_tangent_contractions_is_differentiable(name):
    """``jax.grad`` transposes the JVP rule's tangent part: its contractions stay transposable, and
    the gradient is the rule's derivative on the recipe's forward output
    (``dL/dw = x^T ((1 - y^2) g)``, ``dL/dx = ((1 - y^2) g) w^T``)."""
    r = getattr(recipes, name)
    loss = lambda layer: lambda w, x: jnp.sum(layer(w, x) * X[:, :32])
    value, (gw, gx) = jax.value_and_grad(recipes.apply(loss(_jvp_layer), r), argnums=(0, 1))(W, X)
    np.testing.assert_array_equal(value, recipes.apply(loss(_plain_layer), r)(W, X))
    y = np.asarray(recipes.apply(_plain_layer, r)(W, X), np.float64)
    d = (1 - y**2) * X[:, :32].astype(np.float64)
    np.testing.assert_allclose(gw, X.T.astype(np.float64) @ d, rtol=1e-5, atol=1e-5 * np.abs(gw).max())
    np.testing.assert_allclose(gx, d @ W.T.astype(np.float64), rtol=1e-5, atol=1e-5 * np.abs(gx).max())


def _outside_and_inside(loss, recipe, *args):
    outside = jax.jit(jax.grad(recipes.apply(loss, recipe), argnums=(0, 1)))(*args)
    inside = jax.jit(recipes.apply(jax.grad(loss, argnums=(0, 1)), recipe))(*args)
    return outside, inside


def test_a_backward_rule_of_a_custom_vjp_closing_over_a_traced_value():
    """A ``custom_vjp`` defined inside a jitted function over one of its traced values: the call
    takes that value as a closed-over operand before the primals, and JAX counts the forward rule's
    passed-through residuals (here ``w`` and ``x``) over all operands. (The first version of the
    backward rule's walk indexed the primals alone: IndexError.)"""

    def step(w, x, s):
        @jax.custom_vjp
        def f(w, x):
            return jnp.tanh(x @ w) * s

        def f_bwd(res, g):
            w, x = res
            d = g * s * (1 - jnp.tanh(x @ w) ** 2)
            return x.T @ d, d @ w.T

        f.defvjp(lambda w, x: (f(w, x), (w, x)), f_bwd)
        loss = lambda w, x: jnp.sum(f(w, x) ** 2)
        return _outside_and_inside(loss, recipes.MXFP8.replace(weights_only=True), w, x)

    outside, inside = jax.jit(step)(W, X, 2.0)
    for a, b in zip(outside, inside, strict=True):
        np.testing.assert_array_equal(a, b)


@jax.custom_vjp
def _product(a, b):
    return b @ a


def _product_fwd(a, b):
    # Residuals depend on which operands are differentiated (symbolic zeros).
    residuals = (a.value.T, b.value.T) if a.perturbed and b.perturbed else (b.value.T,) if a.perturbed else (a.value.T,)
    return b.value @ a.value, (residuals, a.perturbed, b.perturbed)


def _product_bwd(saved, g):
    residuals, da, db = saved
    if da and db:
        a_t, b_t = residuals
        return b_t @ g, g @ a_t
    return (residuals[0] @ g, None) if da else (None, g @ residuals[0])


_product.defvjp(_product_fwd, _product_bwd, symbolic_zeros=True)
_S = _data((64, 64), 5, 0.2)


@pytest.mark.parametrize("name", ["FLOAT8_TENSORWISE", "NVFP4"])
def test_one_jitted_rule_called_twice_with_other_residuals(name):
    """One jitted body holding a ``custom_vjp`` (walked once, its rebuilt equation cached) called
    twice, differentiated in ``a`` then in ``b``: its residuals differ between the calls. Each
    backward call gets the residual sources of its own forward call. (The first version gave
    both the last forward call's: the gradient outside differed from the one inside.)"""
    inner = jax.jit(lambda a, b: jnp.tanh(_product(a, b)))
    loss = lambda w, x: jnp.sum(inner(w, _S) ** 2) + jnp.sum(inner(_S, x) ** 2)
    outside, inside = _outside_and_inside(
        loss, getattr(recipes, name).replace(weights_only=True), _S.T, _data((64, 64), 1)
    )
    for a, b in zip(outside, inside, strict=True):
        np.testing.assert_array_equal(a, b)
