"""blackjax: samplers and variational inference, with blackjax's own kernels and drivers.

One Bayesian neural network, written as blackjax's users write a target: a log density of a
pytree of weights (a two-hidden-layer ``tanh`` MLP, 32 features, widths 32, a vector output
weight; standard normal priors on every weight; a Gaussian likelihood with noise 0.5) on 64
points. What scalify meets is blackjax's:

* ``nuts``: ``blackjax.util.run_inference_algorithm`` (blackjax's driver: ``init``, then a
  ``lax.scan`` of ``step``) over ``blackjax.nuts``: ``jax.value_and_grad`` of the log density
  inside the velocity Verlet integrator, the trajectory doubled in ``lax.while_loop`` s, the
  multinomial choice of a proposal and the U-turn criterion on ``ravel_pytree`` d momenta, the
  positions carried by the scan;
* ``mfvi``: ``blackjax.meanfield_vi``'s ``step`` (Adam, 4 samples): samples ``mu + exp(rho) * eps``
  of a ``ravel_pytree`` d position, the log density ``vmap`` ped over them, the ELBO's gradient with
  the stick-the-landing estimator (``stop_gradient``), an optax update;
* ``sgld``: ``blackjax.sgld`` with ``blackjax.sgmcmc.gradients.grad_estimator``: the per-example
  log likelihood ``vmap`` ped over a minibatch and scaled to the data set, its gradient, one
  overdamped Langevin step (Gaussian noise from ``ravel_pytree``).

Under ``scalify`` the two 32 x 32 weight matrices (the harness scales leaves of rank 2 that the
format's layout accepts: every built-in takes both) are ScaledArrays: in the sampler's position,
in the variational mean and log scale, in the SG-MCMC position. Under the recipes the recipe goes where a
sampler's user puts it: on the log density (``blackjax.nuts(recipes.apply(logdensity_fn, r),
...)``), or on the step whose gradient blackjax takes inside (``recipes.apply(vi.step, r)``,
``recipes.apply(sgld.step, r)``). (Under ``recipes.apply(nuts.step, r)`` blackjax's kinetic energy
and U-turn criterion, inner products of two momenta, were quantized until this suite found it; they
now keep the program's precision: see ``docs/examples.md``, "blackjax's samplers and variational
inference".)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import (
    COVERED_BY_FAMILY,
    FAMILY_REPRESENTATIVES,
    FORMAT_NAMES,
    PROPAGATION_RTOL,
    Case,
    assert_recipe_distance,
    assert_tree_close,
    balanced_cosine,
    check_gradient_under_recipe,
    dequantize_tree,
    n_scaled,
    quantize_tree,
    recipe_rounding,
)

import qformats as qf
import scalify
from scalify import recipes

blackjax = pytest.importorskip("blackjax", reason="blackjax is not installed (pip install -e '.[test]')")
optax = pytest.importorskip("optax", reason="optax is not installed (pip install -e '.[test]')")

D, H, N = 32, 32, 64
SIGMA = 0.5
N_DATA = 6_400  # SG-MCMC: the minibatch is one of 100


def _data():
    rng = np.random.default_rng(51)
    x = rng.standard_normal((N, D))
    y = np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.1 * rng.standard_normal(N)
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


DATA = _data()


def init_position():
    """A draw at the prior's scale: every weight N(0, 1/fan_in), biases zero."""
    k1, k2, k3 = jax.random.split(jax.random.key(52), 3)
    return {
        "w1": jax.random.normal(k1, (D, H)) / np.sqrt(D),
        "b1": jnp.zeros(H),
        "w2": jax.random.normal(k2, (H, H)) / np.sqrt(H),
        "b2": jnp.zeros(H),
        "w3": jax.random.normal(k3, (H,)) / np.sqrt(H),
        "b3": jnp.zeros(()),
    }


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return h @ params["w3"] + params["b3"]


def logprior(params):
    return sum(jnp.sum(jax.scipy.stats.norm.logpdf(p)) for p in jax.tree.leaves(params))


def loglikelihood(params, example):
    """One example's log likelihood (blackjax's SG-MCMC estimators ``vmap`` it over a minibatch)."""
    x, y = example
    return jax.scipy.stats.norm.logpdf(y, mlp(params, x), SIGMA)


def logdensity(params, data):
    x, y = data
    return jnp.sum(jax.scipy.stats.norm.logpdf(y, mlp(params, x), SIGMA)) + logprior(params)


def target(data=DATA):
    """The log density of the position alone, as blackjax takes it (the data closed over)."""
    return lambda position: logdensity(position, data)


# -- formats -------------------------------------------------------------------------------------------
# A format registered by a user or a plugin (not a built-in of either list) runs in the fast lane.
def _lane(fast, family_only=False):
    """The format parameters of one test: ``fast`` in the fast lane, the other built-ins slow; with
    ``family_only`` the built-ins that share a family's path (COVERED_BY_FAMILY) are left out."""
    out = []
    for name in FORMAT_NAMES:
        if name in COVERED_BY_FAMILY and family_only:
            continue
        builtin = name in FAMILY_REPRESENTATIVES or name in COVERED_BY_FAMILY
        out.append(pytest.param(name, marks=pytest.mark.slow) if builtin and name not in fast else name)
    return out


def _quantized(tree, fmt_name):
    fmt = qf.get_format(fmt_name)
    qtree = quantize_tree(tree, fmt)
    if n_scaled(qtree) == 0:
        pytest.skip(f"no weight has a shape that {fmt_name} accepts")
    return fmt, qtree, dequantize_tree(qtree)


def _perturbed(tree, key, relative):
    """Every leaf multiplied by ``1 + u``, ``u`` uniform in ``[-relative, relative]``."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [
            x * (1 + jax.random.uniform(k, x.shape, x.dtype, -relative, relative))
            for x, k in zip(leaves, keys, strict=True)
        ]
    )


# -- NUTS ----------------------------------------------------------------------------------------------
NUTS_STEP_SIZE = 0.02  # float32 from init_position: 191 then 127 leapfrog steps, no divergence
NUTS_DRAWS = 2
INV_MASS = jnp.ones(sum(p.size for p in jax.tree.leaves(init_position())))


def nuts_program(logdensity_fn):
    """blackjax's own driver around NUTS, as its examples run it (``initial_position=``)."""

    def sample(key, position):
        nuts = blackjax.nuts(logdensity_fn, NUTS_STEP_SIZE, INV_MASS)
        return blackjax.util.run_inference_algorithm(key, nuts, NUTS_DRAWS, initial_position=position)

    return sample


# The acceptance rate is an average of exp(min(0, E0 - Ei)) over the trajectory: an error d in an
# energy difference is a relative error d in each term. The energies here are ~2e3-5e3 nats (the
# prior over 2145 weights dominates), float32 sums of ~2200 terms that scalify sums in another
# order (per block, rescaled): measured 0 to 13 float32 ulps of the log density apart. The bound
# allows 64 ulps of the largest energy in each of E0 and Ei (2 * 64 * 2**-24 * 5e3 = 0.04 nats,
# ~4% relative); an energy rounded to a format's element (bf16: ~20 nats) would exceed it.
ENERGY_ULPS = 64


# The draws' log-density gradients are derivatives at the end of 300-odd leapfrog steps: float32
# itself, from the position multiplied by 1 + u (u uniform within +-2**-24, half an ulp), moves them
# by 3.1e-5 to 1.3e-4 of their largest element (measured with the test's three seeds, the six
# family formats), and scalify by 2.0e-5 to 1.3e-4 (at most 1.5 times float32's own, fp16; with
# other seeds float32's own went down to 2.5e-5, and fp16's ratio up to 2.95). They are compared at
# GRAD_PROBE_FACTOR times the largest of three such probes (or the harness's tolerance, if larger);
# the positions, log densities and energies at the harness's tolerance, which an intermediate
# rounded to a format's element would not meet after those steps.
GRAD_PROBE_FACTOR = 8
HALF_ULP = 2.0**-24


def _relative_diff(got, expected) -> float:
    """The largest ``max |got - expected| / max |expected|`` over the leaves."""
    return max(
        float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(e, np.float64))) / max(np.max(np.abs(e)), 1e-30))
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True)
    )


@pytest.mark.parametrize("fmt_name", _lane(fast=("mxfp8",), family_only=True))
def test_nuts(fmt_name):
    """Two NUTS draws under ``jit(scalify(...))`` against float32 from the dequantized position:
    the same trees (leapfrog steps, divergences, U-turns), each draw's position and log density and
    the proposals' energies within the harness's tolerance, the draws' gradients within float32's
    own spread (``GRAD_PROBE_FACTOR``), the acceptance rates within ``ENERGY_ULPS``. (NUTS's
    choices compare energies with uniform draws: a difference in the last bits could flip one, and
    a flipped choice would show here as another tree or another draw.)"""
    fmt, qpos, dpos = _quantized(init_position(), fmt_name)
    sample = nuts_program(target())
    key = jax.random.key(53)
    float32 = jax.jit(sample)
    _, (states, info) = float32(key, dpos)
    _, (qstates, qinfo) = jax.jit(scalify.scalify(sample))(key, qpos)
    qstates, qinfo = dequantize_tree(qstates), dequantize_tree(qinfo)
    for field in ("num_integration_steps", "is_divergent", "is_turning"):
        np.testing.assert_array_equal(getattr(qinfo, field), getattr(info, field), err_msg=field)
    assert not np.any(info.is_divergent), "float32's trajectories diverged: the test's step size is wrong"
    assert_tree_close(qstates.position, states.position, fmt, "NUTS draws")
    assert_tree_close(qstates.logdensity, states.logdensity, fmt, "NUTS draws' log densities")
    assert_tree_close(qinfo.energy, info.energy, fmt, "NUTS proposals' energies")
    own = max(
        _relative_diff(
            float32(key, _perturbed(dpos, jax.random.key(57 + s), HALF_ULP))[1][0].logdensity_grad,
            states.logdensity_grad,
        )
        for s in range(3)
    )
    factor = max(1.0, GRAD_PROBE_FACTOR * own / PROPAGATION_RTOL)
    assert_tree_close(qstates.logdensity_grad, states.logdensity_grad, fmt, "NUTS draws' gradients", rtol_factor=factor)
    ulp = 2.0**-24 * float(np.max(np.abs(info.energy)))
    bound = np.asarray(info.acceptance_rate) * 2 * ENERGY_ULPS * ulp
    err = np.abs(np.asarray(qinfo.acceptance_rate, np.float64) - np.asarray(info.acceptance_rate, np.float64))
    assert np.all(err <= bound), f"acceptance rates {qinfo.acceptance_rate} vs float32's {info.acceptance_rate}"


# -- the log density's gradient under the recipes ------------------------------------------------------
# NVFP4's 16 x 16 tiles need a free axis on both operands: the output weight is a vector, and the
# recipe refuses it with its error (measured). The other built-ins run it.
RECIPES_CI = ("mxfp8",)
RECIPES_SLOW = ("float8_tensorwise", "float8_rowwise", "mxfp4")


def _recipes():
    return [*RECIPES_CI, *(pytest.param(r, marks=pytest.mark.slow) for r in RECIPES_SLOW)]


def logdensity_case():
    return Case("bnn_logdensity", lambda p, data: -logdensity(p, data), init_position(), DATA)


@pytest.mark.parametrize("recipe_name", _recipes())
def test_nuts_under_recipe(recipe_name):
    """The target's gradient under the recipe (``check_gradient_under_recipe``: taken inside and
    outside ``recipes.apply``, bit for bit; within the program's own sensitivity of float32's), then
    NUTS on the recipe's log density, ``blackjax.nuts(recipes.apply(logdensity_fn, r), ...)``
    (blackjax's ``jax.value_and_grad`` of it meets the recipe's VJP): its draws are finite and do
    not diverge.
    (How often NUTS accepts on a quantized target is measured, not asserted: docs/examples.md.)"""
    recipe = recipes.BUILTINS[recipe_name]
    check_gradient_under_recipe(logdensity_case(), recipe)
    sample = nuts_program(recipes.apply(target(), recipe))
    _, (states, info) = jax.jit(sample)(jax.random.key(53), init_position())
    for leaf in jax.tree.leaves((states, info)):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64))), f"NaN/Inf in NUTS under {recipe_name}"
    assert not np.any(info.is_divergent), f"NUTS diverged under {recipe_name}: energies {info.energy}"


def test_nuts_program_under_recipe_as_a_whole():
    """blackjax's whole driver under the recipe, ``recipes.apply(sample, r)``: ``init`` takes the
    gradient at the first position, each step again at positions computed from it (the momentum
    moved by it). Each backward GEMM pairs with its own forward one, and the draws equal those of
    NUTS on the recipe's log density bit for bit. (Before, the pairing raised: the step's
    contraction, data times a position that mixes every input, had taken the data as its weight
    where ``init``'s took it as its activation.)"""
    recipe = recipes.BUILTINS[RECIPES_CI[0]]
    whole = jax.jit(recipes.apply(nuts_program(target()), recipe))(jax.random.key(53), init_position())
    want = jax.jit(nuts_program(recipes.apply(target(), recipe)))(jax.random.key(53), init_position())
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- mean-field VI -------------------------------------------------------------------------------------
def mfvi():
    return blackjax.meanfield_vi(target(), optax.adam(1e-2), num_samples=4)


def mfvi_state(steps=100):
    """A state ``steps`` float32 steps into a run from ``vi.init(init_position())`` (whose mean is
    zero: nothing to scale)."""
    vi = mfvi()

    def run(state):
        return jax.lax.fori_loop(0, steps, lambda i, s: vi.step(jax.random.fold_in(jax.random.key(54), i), s)[0], state)

    return jax.jit(run)(vi.init(init_position()))


_MFVI_STATE = []


def _mfvi_state():
    if not _MFVI_STATE:
        _MFVI_STATE.append(mfvi_state())
    return _MFVI_STATE[0]


@pytest.mark.parametrize("fmt_name", _lane(fast=("mxfp8", "fp8_e4m3", "nvfp4")))
def test_mfvi_step(fmt_name):
    """One ``meanfield_vi`` step with the variational mean and log scale as ScaledArrays, against
    float32 on their dequantized values: the new mean and log scale, Adam's moments and the ELBO,
    each within the harness's tolerance."""
    state = _mfvi_state()
    fmt, qparams, dparams = _quantized((state.mu, state.rho), fmt_name)
    qstate = state._replace(mu=qparams[0], rho=qparams[1])
    dstate = state._replace(mu=dparams[0], rho=dparams[1])
    step = mfvi().step
    key = jax.random.key(55)
    new, info = jax.jit(step)(key, dstate)
    qnew, qinfo = jax.jit(scalify.scalify(step))(key, qstate)
    assert_tree_close(qinfo.elbo, info.elbo, fmt, "ELBO")
    assert_tree_close(qnew.mu, new.mu, fmt, "variational mean")
    assert_tree_close(qnew.rho, new.rho, fmt, "variational log scale")
    adam, qadam = new.opt_state[0], qnew.opt_state[0]
    assert_tree_close(qadam.mu, adam.mu, fmt, "Adam's first moment")
    assert_tree_close(qadam.nu, adam.nu, fmt, "Adam's second moment")


def _elbo_gradient(old_state, new_state):
    """The gradient a step took, from Adam's first moment: ``m' = b1 m + (1 - b1) g`` (optax's
    default ``b1 = 0.9``), in float64."""
    m_old = jax.tree.leaves(old_state.opt_state[0].mu)
    m_new = jax.tree.leaves(new_state.opt_state[0].mu)
    return [
        (np.asarray(b, np.float64) - 0.9 * np.asarray(a, np.float64)) / 0.1 for a, b in zip(m_old, m_new, strict=True)
    ]


# MXFP4 is left out: measured, the ELBO gradient it takes has a cosine of 0.32 with float32's,
# against probes (below) at 0.17-0.92 (median of the first three 0.81): 3.6 times the median's
# distance. Near the optimum the stick-the-landing gradient is a difference of two nearly equal
# terms (the target's score and the approximation's), and E2M1 rounds the activations and the
# backward GEMMs' operands by up to a quarter. NVFP4 refuses the output weight (see above).
MFVI_RECIPES_SLOW = ("float8_tensorwise", "float8_rowwise")


def _mfvi_probe(state, key, relative, seed):
    """float32's gradient from blackjax's step on a target that reads its weights multiplied by
    ``1 + u`` (:func:`_perturbed`; the same ``u`` for each sample): what a recipe's rounding of the
    sampled weights does, once, to the ELBO's gradient."""

    def perturbed_target(position):
        return logdensity(_perturbed(position, jax.random.key(seed), relative), DATA)

    vi = blackjax.meanfield_vi(perturbed_target, optax.adam(1e-2), num_samples=4)
    return _elbo_gradient(state, jax.jit(vi.step)(key, state)[0])


@pytest.mark.parametrize(
    "recipe_name", [*RECIPES_CI, *(pytest.param(r, marks=pytest.mark.slow) for r in MFVI_RECIPES_SLOW)]
)
def test_mfvi_step_under_recipe(recipe_name):
    """``recipes.apply(vi.step, r)``: the ELBO's gradient taken inside blackjax's step. Finite; for
    the recipes whose scales do not span the sample axis (blocks and rows along the summed axis)
    bit for bit the step of ``meanfield_vi(recipes.apply(logdensity_fn, r))`` (the recipe's own
    VJP: the gradient outside); and the gradient it took (from Adam's first moment) as close to
    float32's as the harness's bar: distance (1 - cosine) at most RECIPE_NOISE_FACTOR times the
    median of three probes' (:func:`_mfvi_probe` at the recipe's coarsest unit roundoff).
    FLOAT8_TENSORWISE takes one amax over the four samples' weights in the step's batched
    contraction, and one per sample where the log density is ``vmap`` ped under its own
    ``recipes.apply``: the two differ (measured), as a per-tensor scale of a stack of tensors does."""
    recipe = recipes.BUILTINS[recipe_name]
    state, vi = _mfvi_state(), mfvi()
    key = jax.random.key(55)
    got = jax.jit(recipes.apply(vi.step, recipe))(key, state)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(got)), f"NaN/Inf under {recipe_name}"
    if recipe_name != "float8_tensorwise":
        outside = blackjax.meanfield_vi(recipes.apply(target(), recipe), optax.adam(1e-2), num_samples=4)
        for a, b in zip(jax.tree.leaves(jax.jit(outside.step)(key, state)), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(a, b)
    reference = _elbo_gradient(state, jax.jit(vi.step)(key, state)[0])
    relative = recipe_rounding(recipe)
    probes = [balanced_cosine(_mfvi_probe(state, key, relative, seed), reference) for seed in range(3)]
    assert_recipe_distance(f"ELBO under {recipe_name}", _elbo_gradient(state, got[0]), reference, probes)


# -- SGLD ----------------------------------------------------------------------------------------------
SGLD_STEP_SIZE = 1e-5


def sgld_program(grad_fn):
    sgld = blackjax.sgld(grad_fn)

    def step(key, position, minibatch):
        """The gradient estimate SGLD takes, and the step (which takes it again)."""
        return grad_fn(position, minibatch), sgld.step(key, sgld.init(position), minibatch, SGLD_STEP_SIZE)

    return step


def sgld_grad():
    return blackjax.sgmcmc.gradients.grad_estimator(logprior, loglikelihood, N_DATA)


@pytest.mark.parametrize("fmt_name", _lane(fast=("mxfp8", "int8_per_channel", "mxfp4")))
def test_sgld_step(fmt_name):
    """SGLD's gradient estimate and step with the position as ScaledArrays, against float32 from the
    dequantized position: the gradient and the new position within the harness's tolerance."""
    fmt, qpos, dpos = _quantized(init_position(), fmt_name)
    step = sgld_program(sgld_grad())
    key = jax.random.key(56)
    grad, new = jax.jit(step)(key, dpos, DATA)
    qgrad, qnew = jax.jit(scalify.scalify(step))(key, qpos, DATA)
    assert_tree_close(qgrad, grad, fmt, "SGLD gradient estimate")
    assert_tree_close(qnew, new, fmt, "SGLD step")


@pytest.mark.parametrize("recipe_name", _recipes())
def test_sgld_under_recipe(recipe_name):
    """blackjax's ``logdensity_estimator`` (a minibatch's per-example log likelihoods, ``vmap`` ped,
    scaled to the data set) under the recipe: ``check_gradient_under_recipe``; then
    ``recipes.apply(sgld.step, r)``, the estimator's gradient taken inside, bit for bit the step
    with ``jax.grad(recipes.apply(logdensity_estimator, r))``."""
    recipe = recipes.BUILTINS[recipe_name]
    estimator = blackjax.sgmcmc.gradients.logdensity_estimator(logprior, loglikelihood, N_DATA)
    check_gradient_under_recipe(Case("sgld_estimator", lambda p, b: -estimator(p, b), init_position(), DATA), recipe)
    sgld_inside = blackjax.sgld(sgld_grad())
    sgld_outside = blackjax.sgld(jax.grad(recipes.apply(estimator, recipe)))
    key, position = jax.random.key(56), init_position()
    inside = jax.jit(recipes.apply(sgld_inside.step, recipe))(key, position, DATA, SGLD_STEP_SIZE)
    outside = jax.jit(sgld_outside.step)(key, position, DATA, SGLD_STEP_SIZE)
    for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(outside), strict=True):
        np.testing.assert_array_equal(a, b)
