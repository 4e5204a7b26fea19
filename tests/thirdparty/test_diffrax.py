"""diffrax: neural differential equations, trained through diffrax's solvers and adjoints.

Each model is an ``eqx.nn.MLP`` vector field (the pattern of diffrax's own examples) solved by
``diffrax.diffeqsolve``; what scalify meets is diffrax's, not ours:

* ``neural_ode``: Tsit5, the solution saved at 8 times, differentiated by the default
  ``RecursiveCheckpointAdjoint`` (a checkpointed ``while_loop``, equinox's ``maybe_set`` writes);
* ``backsolve``: the same ODE differentiated by ``BacksolveAdjoint`` (a ``custom_vjp`` whose
  backward pass is a second ``diffeqsolve`` of the adjoint ODE, with VJPs of the vector field in it);
* ``cnf``: a continuous normalising flow, its log density from the exact Jacobian trace
  (``jax.vmap`` of the vector field's VJP over the identity, inside the ODE), so its training
  gradient differentiates a VJP again;
* ``neural_sde``: an SDE with a drift and a diffusion MLP driven by a ``VirtualBrownianTree``,
  solved by ``ReversibleHeun`` (``MultiTerm`` of an ``ODETerm`` and a ``ControlTerm``);
* ``steady_state``: the fixed point of ``dy/dt = tanh(W y + b) - y``, integrated with a PID
  step-size controller until ``steady_state_event`` fires, differentiated by ``ImplicitAdjoint``
  (the implicit function theorem through optimistix's root find and a lineax linear solve).

Steps are constant (``dt0``) except in ``steady_state``: an adaptive controller's accept/reject
decisions are discontinuous in the weights, so a program whose steps it picks moves by up to its
tolerance under a one-ulp change of the weights and the harness's rounding tolerance does not
apply (``scripts/run_diffrax_examples.py`` checks diffrax's adaptive notebooks against that
movement instead). The steady state is the exception that proves it: whatever steps reach it, the
fixed point is the same to the event's tolerance, which is far below the harness's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import Case, StepResults, check_grad, check_update, cosine, flat_values, run_loss

from scalify import recipes

diffrax = pytest.importorskip("diffrax", reason="diffrax is not installed (pip install -e '.[test]')")
eqx = pytest.importorskip("equinox", reason="equinox is not installed (pip install -e '.[test]')")

WIDTH = 64


def _mlp(d_in, d_out, key, depth=2, final=jnp.tanh):
    return eqx.nn.MLP(d_in, d_out, WIDTH, depth, activation=jax.nn.softplus, final_activation=final, key=key)


class Field(eqx.Module):
    """``dy/dt = scale * MLP(y)`` (diffrax's neural_ode example's vector field)."""

    mlp: eqx.nn.MLP
    scale: jax.Array

    def __init__(self, d, key):
        self.mlp = _mlp(d, d, key)
        self.scale = jnp.ones(())

    def __call__(self, t, y, args):
        return self.scale * self.mlp(y)


def _case(name, model, batch, per_example):
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, batch):
        m = eqx.combine(params, static)
        return jnp.mean(jax.vmap(lambda *ex: per_example(m, *ex))(*batch))

    return Case(name, loss, params, batch)


def _ode_case(name, adjoint):
    """Width-32 state, 8 series of 8 saved points, Tsit5 at dt 0.1 over [0, 1]."""
    d, n = 32, 8
    rng = np.random.default_rng(21)
    ts = jnp.linspace(0.0, 1.0, 8)
    y0 = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((n, 8, d)), jnp.float32)

    def per_example(field, y0, target):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field), diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, saveat=diffrax.SaveAt(ts=ts), adjoint=adjoint
        )
        return jnp.mean((sol.ys - target) ** 2)

    return _case(name, Field(d, jax.random.key(21)), (y0, target), per_example)


def neural_ode_case():
    return _ode_case("neural_ode", diffrax.RecursiveCheckpointAdjoint())


def backsolve_case():
    return _ode_case("backsolve", diffrax.BacksolveAdjoint())


def cnf_case():
    """FFJORD's log likelihood of 8 points in 32 dimensions under one flow block, t from 0.5 to 0."""
    d = 32
    rng = np.random.default_rng(22)
    x = jnp.asarray(rng.standard_normal((8, d)), jnp.float32)

    def exact_logp(t, state, field):
        y, _ = state
        f, vjp = jax.vjp(lambda y: field(t, y, None), y)
        (jac,) = jax.vmap(vjp)(jnp.eye(d))
        return f, jnp.trace(jac)

    def per_example(field, x):
        sol = diffrax.diffeqsolve(diffrax.ODETerm(exact_logp), diffrax.Tsit5(), 0.5, 0.0, -0.1, (x, 0.0), field)
        (z,), (delta,) = sol.ys
        return -(delta - 0.5 * jnp.sum(z**2))

    return _case("cnf", Field(d, jax.random.key(22)), (x,), per_example)


class SDE(eqx.Module):
    drift: eqx.nn.MLP
    diffusion: eqx.nn.MLP
    noise: int = eqx.field(static=True)

    def __init__(self, d, noise, key):
        k1, k2 = jax.random.split(key)
        self.drift = _mlp(d, d, k1, depth=1)
        self.diffusion = _mlp(d, d * noise, k2, depth=1)
        self.noise = noise

    def __call__(self, y0, key):
        d = y0.shape[0]
        bm = diffrax.VirtualBrownianTree(0.0, 1.0, tol=0.05, shape=(self.noise,), key=key)
        terms = diffrax.MultiTerm(
            diffrax.ODETerm(lambda t, y, args: self.drift(y)),
            diffrax.ControlTerm(lambda t, y, args: 0.3 * self.diffusion(y).reshape(d, self.noise), bm),
        )
        sol = diffrax.diffeqsolve(terms, diffrax.ReversibleHeun(), 0.0, 1.0, 0.1, y0)
        return sol.ys[-1]


def neural_sde_case():
    """Width-32 state, 4 Brownian channels, 32 paths (one key each: a recipe's weight gradient
    sums over them, in MX blocks of 32)."""
    d, n = 32, 32
    rng = np.random.default_rng(23)
    y0 = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    keys = jax.random.split(jax.random.key(23), n)
    target = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)

    def per_example(sde, y0, key, target):
        return jnp.mean((sde(y0, key) - target) ** 2)

    return _case("neural_sde", SDE(d, 4, jax.random.key(24)), (y0, keys, target), per_example)


class Relax(eqx.Module):
    """``dy/dt = tanh(W y + b) - y``: a contraction for ``|W| < 1``, its fixed point a deep
    equilibrium layer's output."""

    linear: eqx.nn.Linear

    def __init__(self, d, key):
        linear = eqx.nn.Linear(d, d, key=key)
        self.linear = eqx.tree_at(lambda m: m.weight, linear, 0.5 * linear.weight)

    def __call__(self, t, y, args):
        return jnp.tanh(self.linear(y) + args) - y


def steady_state_case():
    d = 32
    rng = np.random.default_rng(25)
    x = jnp.asarray(rng.standard_normal((8, d)), jnp.float32)
    target = jnp.asarray(0.5 * rng.standard_normal((8, d)), jnp.float32)

    def per_example(field, x, target):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Tsit5(),
            0.0,
            jnp.inf,
            None,
            jnp.zeros(d),
            x,
            max_steps=None,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-7),
            event=diffrax.Event(diffrax.steady_state_event()),
            adjoint=diffrax.ImplicitAdjoint(),
        )
        return jnp.mean((sol.ys[-1] - target) ** 2)

    return _case("steady_state", Relax(d, jax.random.key(25)), (x, target), per_example)


CASES = {
    "neural_ode": neural_ode_case,
    "backsolve": backsolve_case,
    "cnf": cnf_case,
    "neural_sde": neural_sde_case,
    "steady_state": steady_state_case,
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]()


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)


# A gradient under a recipe quantizes every GEMM operand, forward and backward: it points the way
# float32's does, not to rounding (the KerasHub and StyleGAN2 suites' floors, per narrowest element;
# 8-bit elements round to ~2**-4 relative, 4-bit to ~2**-2).
RECIPE_COSINE_FLOOR = {8: 0.95, 4: 0.8}
# Not steady_state: under a recipe the vector field quantizes its state, so it is piecewise
# constant in y and dy/dt need never fall below the event's tolerance; the solve, with no t1 and
# no max_steps, would not end.
RECIPE_CASES = ("neural_ode", "backsolve", "cnf", "neural_sde")


@functools.cache
def _recipe_case(name):
    return CASES[name]()


# The fast lane: the two adjoints (recursive checkpointing, backsolve); the CNF's and the SDE's
# solves under the recipe (46 s on 2 workers) in the slow lane.
@pytest.mark.parametrize("where", ["inside", pytest.param("outside", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "recipe_name",
    ["mxfp8", pytest.param("float8_tensorwise", marks=pytest.mark.slow), pytest.param("nvfp4", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize(
    "case_name", [*RECIPE_CASES[:2], *(pytest.param(c, marks=pytest.mark.slow) for c in RECIPE_CASES[2:])]
)
def test_grad_under_recipe(case_name, recipe_name, where):
    """The gradient under ``recipe.replace(weights_only=True)``, taken inside ``recipes.apply`` (a
    training step's form) or outside (``jax.grad(recipes.apply(loss))``: diffrax's adjoint's own
    backward rule, which JAX calls after the walk, is walked then): finite, at a cosine with
    float32's above the recipe's floor. ``weights_only``: a solver also contracts its stages with its
    tableau (Tsit5's 7 stages), no linear layer's GEMM, whose width no block fits."""
    case = _recipe_case(case_name)
    recipe = recipes.BUILTINS[recipe_name].replace(weights_only=True)
    grad = (
        recipes.apply(jax.grad(case.loss), recipe) if where == "inside" else jax.grad(recipes.apply(case.loss, recipe))
    )
    expected = flat_values(jax.jit(jax.grad(case.loss))(case.params, case.batch))
    got = flat_values(jax.jit(grad)(case.params, case.batch))
    assert np.isfinite(got).all(), f"{case.name} under {recipe_name}: NaN/Inf in the gradient"
    cos = cosine(got, expected)
    bits = min(recipe.format_of(role).element.bits for role in recipes.ROLES)
    assert cos >= RECIPE_COSINE_FLOOR[4 if bits <= 4 else 8], f"{case.name} under {recipe_name}: cosine {cos:.4f}"
    # The recipe ran: a gradient equal to float32's would mean no contraction was quantized.
    assert not np.allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize(
    "recipe_name",
    ["float8_tensorwise", pytest.param("mxfp8", marks=pytest.mark.slow), pytest.param("nvfp4", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize(
    "case_name", ["neural_ode", *(pytest.param(c, marks=pytest.mark.slow) for c in RECIPE_CASES[1:])]
)
def test_grad_outside_apply_is_the_grad_inside(case_name, recipe_name):
    """``jax.grad(recipes.apply(loss, r))`` equals ``recipes.apply(jax.grad(loss), r)`` bit for bit.
    diffrax's adjoints are ``custom_vjp``s whose backward rule recomputes the solve's steps and
    differentiates them with ``jax.vjp``; JAX calls that rule after the walk. Walked then, its
    transposed contractions are the dgrad and wgrad GEMMs of the recomputed forward ones (under
    FLOAT8_TENSORWISE ``dy`` in E5M2), as in the gradient taken inside. Before, the rule ran in the
    program's precision: a gradient between the recipe's and float32's."""
    case = _recipe_case(case_name)
    recipe = recipes.BUILTINS[recipe_name].replace(weights_only=True)
    inside = flat_values(jax.jit(recipes.apply(jax.grad(case.loss), recipe))(case.params, case.batch))
    outside = flat_values(jax.jit(jax.grad(recipes.apply(case.loss, recipe)))(case.params, case.batch))
    np.testing.assert_array_equal(outside, inside)
