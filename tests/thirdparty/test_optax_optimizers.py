"""optax's optimizers, core and contrib, stepping scaled parameters under scalify.

A training step is the model and the optimizer: optax's update rules are code nobody here wrote,
with their own reductions (Adafactor's factored moments, LAMB's and LARS's trust ratios, Fromage's
norms), signs (Lion), matrix iterations (Muon's Newton-Schulz orthogonalisation, GaLore's
projections), conditionals on the step count (``MultiSteps``, schedule-free's interpolation,
D-Adaptation and Prodigy's step-size estimates) and masks over the parameter tree.

For each optimizer and format: ``jit(scalify(step))`` on a two-layer MLP whose weight matrices are
ScaledArrays, against ``jit(step)`` in float32 on the dequantized weights (the third-party harness's
tolerance, which would catch any value rounded to the format); then a second step from the scalified
step's outputs, against float32 on those outputs dequantized, so both programs start from the same
numbers again (moments, step counts and the optimizer's estimates included).

Found: every one ran and agreed, in every format tried (so this is a regression suite). Adam-like
optimizers use ``eps=1e-2`` as the harness's Adam does, so that their first step is Lipschitz in the
gradient (with ``eps ~ 1e-8`` the first step is ``lr * sign(g)``, and a gradient entry that is zero
up to float32 rounding would flip sign: the comparison would measure noise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib as oc
import pytest
from thirdparty_harness import assert_tree_close, dequantize_tree, n_scaled, quantize_tree

import qformats as qf
import scalify

OPTIMIZERS = {
    "sgd_nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: optax.adamw(1e-2, eps=1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "lamb": lambda: optax.lamb(1e-2, eps=1e-2),
    "lars": lambda: optax.lars(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2, eps=1e-2),
    "adagrad": lambda: optax.adagrad(1e-2, eps=1e-2),
    "novograd": lambda: optax.novograd(1e-2, eps=1e-2),
    "yogi": lambda: optax.yogi(1e-2, eps=1e-2),
    "adabelief": lambda: optax.adabelief(1e-2, eps=1e-2),
    "radam": lambda: optax.radam(1e-2, eps=1e-2),
    "sm3": lambda: optax.sm3(1e-2),
    "fromage": lambda: optax.fromage(1e-2),
    "clipped_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-2)),
    "masked_weight_decay": lambda: optax.chain(
        optax.add_decayed_weights(1e-2, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p)), optax.sgd(0.1)
    ),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2, eps=1e-2), every_k_schedule=2),
    "muon": lambda: oc.muon(1e-2),
    "galore": lambda: oc.galore(1e-2, rank=4),
    "schedule_free_adamw": lambda: oc.schedule_free_adamw(1e-2, eps=1e-2),
    "prodigy": lambda: oc.prodigy(1.0, eps=1e-2),
    "dadapt_adamw": lambda: oc.dadapt_adamw(1.0, eps=1e-2),
    "mechanize": lambda: oc.mechanize(optax.adam(1e-2, eps=1e-2)),
    "ademamix": lambda: oc.ademamix(1e-2, eps=1e-2),
    "adopt": lambda: oc.adopt(1e-2, eps=1e-2),
    "madgrad": lambda: oc.madgrad(1e-2, eps=1e-2),
    "cocob": lambda: oc.cocob(),
    "dog": lambda: oc.dog(),
}
# The fast lane: one optimizer per kind of update rule, in MXFP8; the slow lane the rest and the
# other families.
FAST = ("adafactor", "lion", "lamb", "muon", "galore", "schedule_free_adamw", "masked_weight_decay", "multi_steps")
FORMATS = ("mxfp8", "nvfp4", "int8_per_channel", "fp16")


def _model():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((64, 128)) * 0.1, jnp.float32),
        "b1": jnp.zeros(128),
        "w2": jnp.asarray(rng.standard_normal((128, 64)) * 0.1, jnp.float32),
    }
    batch = (jnp.asarray(rng.standard_normal((16, 64)), jnp.float32), jnp.asarray(rng.integers(0, 64, 16)))

    def loss(p, batch):
        x, y = batch
        h = jax.nn.gelu(x @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()

    return params, batch, loss


@pytest.mark.parametrize(
    ("name", "fmt_name"),
    [
        pytest.param(n, f, marks=() if (f == "mxfp8" and n in FAST) else pytest.mark.slow, id=f"{n}-{f}")
        for f in FORMATS
        for n in OPTIMIZERS
    ],
)
def test_optimizer_steps_scaled_parameters_as_float32(name, fmt_name):
    fmt = qf.get_format(fmt_name)
    params, batch, loss = _model()
    opt = OPTIMIZERS[name]()

    def step(p, state, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, state = opt.update(grads, state, p)
        return value, optax.apply_updates(p, updates), state

    qparams = quantize_tree(params, fmt)
    assert n_scaled(qparams) == 2
    dparams = dequantize_tree(qparams)
    state = opt.init(dparams)
    scaled_step = jax.jit(scalify.scalify(step))
    got = scaled_step(qparams, state, batch)
    assert_tree_close(got, jax.jit(step)(dparams, state, batch), fmt, f"{name} step 1")
    assert any(isinstance(v, scalify.ScaledArray) for v in jax.tree.leaves(got[1], is_leaf=scalify.is_scaled_leaf))
    again = scaled_step(got[1], got[2], batch)
    assert_tree_close(again, jax.jit(step)(*dequantize_tree((got[1], got[2])), batch), fmt, f"{name} step 2")
