"""numpyro: stochastic variational inference, the loss numpyro's ``Trace_ELBO`` computes.

Models and guides are written with numpyro's primitives (``sample``, ``plate``, ``param`` through
its autoguides and ``numpyro.contrib.module.flax_module``); the parameters are the ones
``SVI.init`` creates and ``SVI.get_params`` returns, and the loss is
``Trace_ELBO(...).loss(key, params, model, guide, *batch)``, the function ``SVI.update``
differentiates: numpyro's effect handlers (seed, substitute, trace, replay) run inside the traced
program, and sampling is reparameterised with a fixed key.

* ``vae``: numpyro's VAE example's shape: flax ``Dense`` encoder (location and ``exp`` scale) and
  decoder (Bernoulli probabilities through a sigmoid), a batch ``plate``;
* ``bnn``: a Bayesian two-layer network for regression under an ``AutoNormal`` guide, 4 particles,
  a minibatch of a larger data set (a subsampled ``plate``): the contractions' weights are samples
  ``loc + scale * eps``, drawn inside the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import Case, StepResults, check_grad, check_gradient_under_recipe, check_update, run_loss

from scalify import recipes

numpyro = pytest.importorskip("numpyro", reason="numpyro is not installed (pip install -e '.[test]')")
nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install -e '.[test]')")
optax = pytest.importorskip("optax", reason="optax is not installed (pip install -e '.[test]')")

import numpyro.distributions as dist  # noqa: E402
from numpyro.contrib.module import flax_module  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoNormal  # noqa: E402

D, H, Z, N = 64, 64, 32, 64
N_DATA = 50_000


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.softplus(nn.Dense(H)(x))
        return nn.Dense(Z)(h), jnp.exp(nn.Dense(Z)(h))


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        h = nn.softplus(nn.Dense(H)(z))
        return nn.sigmoid(nn.Dense(D)(h))


def vae_model(x):
    decode = flax_module("decoder", Decoder(), input_shape=(N, Z))
    with numpyro.plate("batch", x.shape[0]):
        z = numpyro.sample("z", dist.Normal(0, 1).expand([Z]).to_event(1))
        numpyro.sample("obs", dist.Bernoulli(decode(z)).to_event(1), obs=x)


def vae_guide(x):
    loc, scale = flax_module("encoder", Encoder(), input_shape=(N, D))(x)
    with numpyro.plate("batch", x.shape[0]):
        numpyro.sample("z", dist.Normal(loc, scale).to_event(1))


def bnn_model(x, y):
    w1 = numpyro.sample("w1", dist.Normal(0, 1).expand([x.shape[1], H]).to_event(2))
    b1 = numpyro.sample("b1", dist.Normal(0, 1).expand([H]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0, 1).expand([H, 32]).to_event(2))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    f = jnp.mean(jnp.tanh(x @ w1 + b1) @ w2, axis=-1)
    # A minibatch of a 50,000-point data set, as minibatched SVI is written: the plate scales the
    # batch's log likelihood to the data set's, so the likelihood (through the contractions), not
    # the prior and the guide's entropy, makes the gradient.
    with numpyro.plate("data", N_DATA, subsample_size=x.shape[0]):
        numpyro.sample("y", dist.Normal(f, sigma), obs=y)


def _svi_case(name, model, guide, batch, particles=1):
    elbo = Trace_ELBO(num_particles=particles)
    svi = SVI(model, guide, optax.adam(1e-3), elbo)
    params = svi.get_params(svi.init(jax.random.key(41), *batch))
    return Case(name, lambda params, batch: elbo.loss(jax.random.key(42), params, model, guide, *batch), params, batch)


def vae_case():
    x = jnp.asarray(np.random.default_rng(43).random((N, D)) < 0.3, jnp.float32)
    return _svi_case("vae", vae_model, vae_guide, (x,))


def bnn_case():
    rng = np.random.default_rng(44)
    x = jnp.asarray(rng.standard_normal((N, 32)), jnp.float32)
    y = jnp.asarray(np.sin(x[:, 0]) + 0.1 * rng.standard_normal(N), jnp.float32)
    return _svi_case("bnn", bnn_model, AutoNormal(bnn_model), (x, y), particles=4)


CASES = {"vae": vae_case, "bnn": bnn_case}


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


@pytest.mark.parametrize(
    "case_name, recipe_name",
    [
        ("vae", "mxfp8"),
        *(
            pytest.param(c, r, marks=pytest.mark.slow)
            for c in CASES
            for r in ("mxfp8", "float8_tensorwise", "float8_rowwise", "nvfp4")
            if (c, r) != ("vae", "mxfp8")
        ),
    ],
)
def test_gradient_under_recipe(case_name, recipe_name):
    """The ELBO's gradient under the recipe, taken inside and outside ``recipes.apply``: see
    ``check_gradient_under_recipe``. In ``bnn`` the weights are samples computed in the loss, and
    every contraction runs under the recipe all the same."""
    check_gradient_under_recipe(CASES[case_name](), recipes.BUILTINS[recipe_name])
