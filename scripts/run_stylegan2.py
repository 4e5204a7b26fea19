"""Train flaxmodels' StyleGAN2, unchanged, under ``scalify``: gradient penalties are second-order.

    python scripts/run_stylegan2.py                            # pip download flaxmodels (FLAXMODELS_VERSION)
    python scripts/run_stylegan2.py --source ~/src/flaxmodels  # a git clone: also its training steps
    python scripts/run_stylegan2.py --formats all --markdown
    python scripts/run_stylegan2.py --recipes all --high-precision-scopes SCOPES   # SCOPES: see the end

The models are ``flaxmodels.stylegan2``'s ``MappingNetwork``, ``SynthesisNetwork`` and
``Discriminator`` (flaxmodels 0.1.3, Flax Linen), built at a tiny size through their constructors:
16 x 16 RGB images, latents of 32, two mapping layers, feature maps of 64 (32 at 16 x 16), the
discriminator's minibatch-stddev over groups of 4. They carry what makes StyleGAN2 unlike the other
programs here: modulated and demodulated convolutions (the weight scaled per example by a style,
then by ``rsqrt`` of its squares' sum), FIR up- and down-sampling as grouped (depthwise)
convolutions and a transposed convolution written as a convolution's gradient, equalised learning
rates, per-pixel noise, a moving average of the latent (``moving_stats``). Nothing of them is copied here.

Its regularisers differentiate a gradient: R1 (the discriminator's gradient at the real images,
squared) and the path-length penalty (the generator's output differentiated by its latent). The
loss checks below are the losses of the StyleGAN2 paper (Karras et al. 2020), written for this
script over the models: ``d_loss`` (logistic loss on real and generated images), ``r1``, ``g_loss``
(non-saturating, two latents mixed at a layer) and ``pl`` (against a fixed mean length). Each runs
as the third-party harness's check: its value, gradient (both networks' weights) and one Adam
update against float32 on the dequantized weights, within the harness's tolerance.

With ``--source`` (a clone of https://github.com/matthias-wright/flaxmodels), the repository's own
``training/stylegan2/training_steps.py`` is imported as it is and its four steps (``main_step_D``,
``regul_step_D``, ``main_step_G``, ``regul_step_G``) run under ``jax.pmap(axis_name="batch")`` as its
``training.py`` runs them, one device, with the configuration of its ``main.py`` (R1 gamma 10,
path-length weight 2 and decay 0.01, mixing probability 0.9; Adam with b1 0, b2 0.99) and no
dynamic loss scale (its half-precision path uses ``flax.optim`` and ``jax.tree_multimap``, both
removed). The states are the two ``TrainState`` classes of its ``training_utils.py`` with the same
fields, written here: that module imports ``jaxlib.xla_extension.DeviceArray`` and ``flax.optim``,
which no longer exist. Each step's new states and metrics must equal float32's within the
tolerance. Without ``--source`` those rows are ``n/a``.

What the script changes in flaxmodels: ``jnp.reshape`` accepts its ``newshape`` keyword again
(flaxmodels 0.1.3 passes it; JAX removed it in 0.7), in the script's process. In the optimizer:
Adam's eps is 1e-2, as in the harness, so that a step is Lipschitz in the gradient.

With ``--recipes`` the weights stay float32 and each loss runs as
``jax.value_and_grad(recipes.apply(loss, recipe))`` (``run_keras_hub_models.check_recipe``), at 32
images (a convolution's weight gradient sums over the batch, blocked along it); the repository's
steps run as ``recipes.apply(step, recipe)`` (their gradients taken inside), their update's cosine
with float32's above the recipe's floor. RGB has 3 channels, the minibatch-stddev adds one feature
map (65) and the score is one number: pass
``--high-precision-scopes FromRGBLayer_0,ToRGBLayer_0,DiscriminatorLayer_0,LinearLayer_1``.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _jax_scalify_source import fetch_wheels  # noqa: E402
from run_flax_examples import _change, _float_leaves, failure  # noqa: E402
from run_keras_hub_models import check, check_recipe, cosine, cosine_floor, recipe_outcome  # noqa: E402
from run_recurrentgemma import run_table  # noqa: E402
from thirdparty_harness import Case, assert_tree_close, dequantize_tree, n_scaled, quantize_tree  # noqa: E402

import scalify  # noqa: E402
from scalify import recipes  # noqa: E402

# The version the figures in docs/examples.md were measured with.
FLAXMODELS_VERSION = "0.1.3"
RES, CHANNELS, LATENT, MAPPING_LAYERS = 16, 3, 32, 2
SIZES = {"fmap_base": 256, "fmap_max": 64}  # 64 feature maps at 4 x 4 and 8 x 8, 32 at 16 x 16
BATCH, RECIPE_BATCH, MBSTD_GROUP = 4, 32, 4
NUM_WS = int(np.log2(RES)) * 2 - 3
MIX_AT = 2  # g_loss: the first latent drives the first two layers, the second the rest
R1_GAMMA, PL_WEIGHT, PL_DECAY, MIXING_PROB = 10.0, 2.0, 0.01, 0.9
LOSSES = ("d_loss", "r1", "g_loss", "pl")
STEPS = ("main_step_D", "regul_step_D", "main_step_G", "regul_step_G")
CHECKS = (*LOSSES, *STEPS)


def fetch(work: Path) -> Path:
    """flaxmodels' wheel (``pip download --no-deps``) unpacked under ``work``; the directory to import from."""
    return fetch_wheels(
        work,
        (f"flaxmodels=={FLAXMODELS_VERSION}",),
        "Clone https://github.com/matthias-wright/flaxmodels and pass --source DIR.",
    )


def accept_newshape():
    """``jnp.reshape(a, newshape=...)`` as before JAX 0.7 (flaxmodels 0.1.3 calls it so); once."""
    reshape = jnp.reshape
    if getattr(reshape, "accepts_newshape", False):
        return

    def reshape_with_newshape(a, shape=None, *args, newshape=None, **kwargs):
        return reshape(a, newshape if shape is None else shape, *args, **kwargs)

    reshape_with_newshape.accepts_newshape = True
    jnp.reshape = reshape_with_newshape


def load(root: Path):
    """``flaxmodels.stylegan2`` from ``root``, and the repository's ``training_steps`` module where
    ``root`` is a clone (``None`` for a wheel)."""
    accept_newshape()
    sys.path.insert(0, str(root))
    import flaxmodels

    steps = root / "training" / "stylegan2"
    training_steps = None
    if (steps / "training_steps.py").is_file():
        sys.path.insert(0, str(steps))
        import training_steps
    return types.SimpleNamespace(stylegan2=flaxmodels.stylegan2, training_steps=training_steps)


def _normal(shape, seed: int, scale: float = 1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def build(lib, batch: int):
    """The three networks, their float32 variables (library initialisation) and one batch."""
    sg = lib.stylegan2
    nets = types.SimpleNamespace(
        mapping=sg.MappingNetwork(
            z_dim=LATENT, c_dim=0, w_dim=LATENT, num_ws=NUM_WS, num_layers=MAPPING_LAYERS, layer_features=LATENT
        ),
        synthesis=sg.SynthesisNetwork(resolution=RES, num_channels=CHANNELS, w_dim=LATENT, **SIZES),
        discriminator=sg.Discriminator(
            resolution=RES, num_channels=CHANNELS, c_dim=0, mbstd_group_size=MBSTD_GROUP, **SIZES
        ),
    )
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    mapping = nets.mapping.init(keys[0], jnp.ones((1, LATENT)), jnp.ones((1, 0)))
    synthesis = nets.synthesis.init(keys[1], jnp.ones((1, NUM_WS, LATENT)))
    params_d = nets.discriminator.init(keys[2], jnp.ones((1, RES, RES, CHANNELS)), jnp.ones((1, 0)))
    data = {
        "image": _normal((batch, RES, RES, CHANNELS), 1),
        "label": jnp.zeros((batch, 0)),
        "z1": _normal((batch, LATENT), 2),
        "z2": _normal((batch, LATENT), 3),
        # path-length noise, scaled by 1/sqrt(pixels) as in the paper
        "pl_noise": _normal((batch, RES, RES, CHANNELS), 4, 1 / RES),
        "rng": jax.random.PRNGKey(5),
    }
    return nets, mapping, synthesis, params_d, data


def loss_case(lib, name: str, recipe_run: bool) -> Case:
    """A :class:`Case` of one of :data:`LOSSES` over ``{"G": ..., "D": ...}``."""
    nets, mapping, synthesis, params_d, data = build(lib, RECIPE_BATCH if recipe_run else BATCH)
    moving, noise = mapping["moving_stats"], synthesis["noise_consts"]

    def latents(p, z):
        return nets.mapping.apply({"params": p["G"]["mapping"], "moving_stats": moving}, z, data["label"], train=False)

    def synthesize(p, w):
        variables = {"params": p["G"]["synthesis"], "noise_consts": noise}
        return nets.synthesis.apply(variables, w, noise_mode="random", rng=data["rng"])

    def generated(p, b):
        w1, w2 = latents(p, b["z1"]), latents(p, b["z2"])
        layer = jnp.arange(NUM_WS)[None, :, None]
        return synthesize(p, jnp.where(layer < MIX_AT, w1, w2))

    def score(p, images):
        return nets.discriminator.apply(p["D"], images, data["label"])

    def d_loss(p, b):
        return jnp.mean(jax.nn.softplus(score(p, generated(p, b)))) + jnp.mean(jax.nn.softplus(-score(p, b["image"])))

    def r1(p, b):
        grads = jax.grad(lambda x: jnp.sum(score(p, x)))(b["image"])
        return jnp.mean(jnp.sum(grads**2, axis=(1, 2, 3))) * (R1_GAMMA / 2)

    def g_loss(p, b):
        return jnp.mean(jax.nn.softplus(-score(p, generated(p, b))))

    def pl(p, b):
        w = latents(p, b["z1"])
        grads = jax.grad(lambda w: jnp.sum(synthesize(p, w) * b["pl_noise"]))(w)
        lengths = jnp.sqrt(jnp.mean(jnp.sum(grads**2, axis=2), axis=1))
        return jnp.mean((lengths - b["pl_mean"]) ** 2) * PL_WEIGHT

    loss = {"d_loss": d_loss, "r1": r1, "g_loss": g_loss, "pl": pl}[name]
    batch = {k: v for k, v in data.items() if k in ("image", "z1", "z2", "pl_noise")}
    batch["pl_mean"] = jnp.asarray(0.5, jnp.float32)
    params = {"G": {"mapping": mapping["params"], "synthesis": synthesis["params"]}, "D": params_d}
    return Case(name, loss, params, batch)


# -- the repository's own training steps (--source) -------------------------------------------------


def _train_states(nets, mapping, synthesis, params_d):
    """The generator's and discriminator's states, with the fields of training_utils.TrainStateG/D."""
    from flax import struct
    from flax.training import train_state

    class TrainStateG(train_state.TrainState):
        apply_mapping: Callable = struct.field(pytree_node=False)
        apply_synthesis: Callable = struct.field(pytree_node=False)
        dynamic_scale_main: Any
        dynamic_scale_reg: Any
        epoch: int
        moving_stats: Any = None
        noise_consts: Any = None

    class TrainStateD(train_state.TrainState):
        dynamic_scale_main: Any
        dynamic_scale_reg: Any
        epoch: int

    def adam():  # training.py's optimizer (main.py's learning rate), with the harness's eps
        import optax

        return optax.adam(learning_rate=0.002, b1=0.0, b2=0.99, eps=1e-2)

    state_g = TrainStateG.create(
        apply_fn=None,
        apply_mapping=nets.mapping.apply,
        apply_synthesis=nets.synthesis.apply,
        params={"mapping": mapping["params"], "synthesis": synthesis["params"]},
        tx=adam(),
        dynamic_scale_main=None,
        dynamic_scale_reg=None,
        epoch=0,
        moving_stats=mapping["moving_stats"],
        noise_consts=synthesis["noise_consts"],
    )
    state_d = TrainStateD.create(
        apply_fn=nets.discriminator.apply,
        params=params_d,
        tx=adam(),
        dynamic_scale_main=None,
        dynamic_scale_reg=None,
        epoch=0,
    )
    return state_g, state_d


class _Config:
    """The fields of main.py's configuration the steps read, at its defaults."""

    r1_gamma, pl_weight, pl_decay, G_reg_interval, D_reg_interval = R1_GAMMA, PL_WEIGHT, PL_DECAY, 4, 16


def _step_call(lib, name: str, data):
    """``(step, arguments(state_g, state_d), 0 or 1: the state it trains)`` as training.py calls it;
    every step returns that state, updated, first."""
    ts, d, config = lib.training_steps, data, _Config()
    if name == "main_step_D":
        return ts.main_step_D, lambda g, dd: (g, dd, d, d["z1"], d["z2"], {}, MIXING_PROB, d["rng"]), 1
    if name == "regul_step_D":
        return functools.partial(ts.regul_step_D, config=config), lambda g, dd: (dd, d, {}), 1
    if name == "main_step_G":
        return ts.main_step_G, lambda g, dd: (g, dd, d, d["z1"], d["z2"], {}, MIXING_PROB, d["rng"]), 0
    step = functools.partial(ts.regul_step_G, config=config, rng=d["rng"])
    return step, lambda g, dd: (g, d, d["z1"], d["pl_noise"], jnp.zeros(()), {}), 0


def _pmapped(fn):
    """``fn`` under ``jax.pmap(axis_name="batch")`` on one device, its arguments given a device axis."""
    add = lambda tree: jax.tree.map(lambda a: jnp.expand_dims(jnp.asarray(a), 0), tree)
    drop = lambda tree: jax.tree.map(lambda a: a[0], tree)
    return lambda *args: drop(jax.pmap(fn, axis_name="batch")(*add(args)))


def _trained(state):
    """A train state's parameters and optimizer state."""
    return {"params": state.params, "opt_state": state.opt_state}


def step_check(lib, name: str, run, recipe_run: bool) -> tuple[str, str]:
    """(outcome, detail) of the repository's step ``name`` under a format or a recipe."""
    if lib.training_steps is None:
        return "n/a", "the repository's steps: pass --source, a clone of matthias-wright/flaxmodels"
    nets, mapping, synthesis, params_d, data = build(lib, RECIPE_BATCH if recipe_run else BATCH)
    state_g, state_d = _train_states(nets, mapping, synthesis, params_d)
    step, arguments, trained = _step_call(lib, name, data)
    if recipe_run:
        return recipe_outcome(lambda: _step_recipe(step, arguments, trained, state_g, state_d, run))
    try:
        qg = state_g.replace(params=quantize_tree(state_g.params, run))
        qd = state_d.replace(params=quantize_tree(state_d.params, run))
        if n_scaled((qg.params, qd.params)) == 0:
            return "n/a", f"no weight has a shape {run.name} accepts"
        dg, dd = qg.replace(params=dequantize_tree(qg.params)), qd.replace(params=dequantize_tree(qd.params))
        expected = _pmapped(step)(*arguments(dg, dd))
        got = dequantize_tree(_pmapped(scalify.scalify(step))(*arguments(qg, qd)))
        assert_tree_close(got, expected, run, f"{name} states and metrics")
    except Exception as exc:  # reported per (step, format); the run goes on
        return failure(exc)
    return "ok", f"{n_scaled((qg.params, qd.params))} weights scaled, states and metrics within tolerance"


def _step_recipe(step, arguments, trained, state_g, state_d, recipe):
    """(cosine, detail, floor) of the step under ``recipes.apply``: the change it makes to the
    trained state's parameters and Adam moments (floating leaves: not Adam's step count, which
    moves by one in both) against float32's."""
    before = _float_leaves(_trained((state_g, state_d)[trained]))
    expected = _change(before, _trained(_pmapped(step)(*arguments(state_g, state_d))[0]))
    got = _change(before, _trained(_pmapped(recipes.apply(step, recipe))(*arguments(state_g, state_d))[0]))
    if not np.isfinite(got).all():
        raise FloatingPointError(f"non-finite update under {recipe.name}")
    c = cosine(got, expected)
    floor = cosine_floor(recipe)
    if floor is None:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.max(np.abs(expected)))
    return c, f"update cosine {c:.4f}", floor


def run_check(lib, name: str, run, recipe_run: bool) -> tuple[str, str]:
    """(outcome, detail) of check ``name`` under ``run``, a format or (``recipe_run``) a recipe."""
    if name in STEPS:
        return step_check(lib, name, run, recipe_run)
    case = loss_case(lib, name, recipe_run)
    return check_recipe(case, run) if recipe_run else check(case, run)


def main(argv=None) -> int:
    this = types.SimpleNamespace(
        __doc__=__doc__, package="flaxmodels", version=FLAXMODELS_VERSION, fetch=fetch, load=load
    )
    return run_table(this, max(map(len, CHECKS)) + 2, CHECKS, run_check, argv)


if __name__ == "__main__":
    sys.exit(main())
