"""equinox: ``eqx.nn`` layers (Embedding, LayerNorm, MultiheadAttention, RMSNorm, MLP, Conv2d).

Two tiny models: a pre-norm attention block over token embeddings (equinox masks attention as
``where(mask, logits, finfo(dtype).min)``) and a small CNN classifier. Parameters live in the module
pytree: ``eqx.partition(model, eqx.is_inexact_array)`` splits them from the static rest and
``eqx.combine`` puts the (scaled) parameters back inside the traced loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from thirdparty_harness import Case, StepResults, check_grad, check_sharpness_aware_step, check_update, run_loss

eqx = pytest.importorskip("equinox", reason="equinox is not installed (pip install -e '.[test]')")

VOCAB, CLASSES = 64, 32


class AttentionBlock(eqx.Module):
    embed: eqx.nn.Embedding
    ln: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    rms: eqx.nn.RMSNorm
    mlp: eqx.nn.MLP

    def __init__(self, d, key):
        k = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, d, key=k[0])
        self.ln = eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(d // 32, d, key=k[1])
        self.rms = eqx.nn.RMSNorm(d)
        self.mlp = eqx.nn.MLP(d, VOCAB, 2 * d, depth=2, activation=jax.nn.gelu, key=k[2])

    def __call__(self, tokens):  # one sequence [T]
        x = jax.vmap(self.embed)(tokens)
        h = jax.vmap(self.ln)(x)
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=mask)
        return jax.vmap(self.mlp)(jax.vmap(self.rms)(x))


class SmallCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.MLP

    def __init__(self, width, key):
        k = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, width // 2, kernel_size=3, padding=1, key=k[0])
        self.conv2 = eqx.nn.Conv2d(width // 2, width, kernel_size=3, stride=2, padding=1, key=k[1])
        self.head = eqx.nn.MLP(width * 4 * 4, CLASSES, 2 * width, depth=1, activation=jax.nn.relu, key=k[2])

    def __call__(self, image):  # one image [C, H, W]
        h = jax.nn.relu(self.conv1(image))
        h = jax.nn.relu(self.conv2(h))
        return self.head(h.reshape(-1))


def _split_case(name, model, batch, per_example_loss):
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, batch):
        m = eqx.combine(params, static)
        return jnp.mean(jax.vmap(lambda *ex: per_example_loss(m, *ex))(*batch))

    return Case(name, loss, params, batch)


def attention_case(d_model=64, batch=2, seq=8):
    """Width ``d_model`` (a multiple of 32), heads of 32, MLP 2 * d_model."""
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, VOCAB, size=(batch, seq + 1)), jnp.int32)

    def per_example(m, seq):
        logits = m(seq[:-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, seq[1:]).mean()

    return _split_case("eqx_attention_block", AttentionBlock(d_model, jax.random.key(2)), (tokens,), per_example)


def cnn_case(d_model=32, batch=2, seq=None):
    """8x8 RGB images, ``d_model`` channels after the second conv (``seq`` is unused)."""
    rng = np.random.default_rng(3)
    images = jnp.asarray(rng.standard_normal((batch, 3, 8, 8)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, CLASSES, size=(batch,)), jnp.int32)

    def per_example(m, image, label):
        return optax.softmax_cross_entropy_with_integer_labels(m(image), label)

    return _split_case("eqx_cnn", SmallCNN(d_model, jax.random.key(3)), (images, labels), per_example)


CASES = {"eqx_attention_block": attention_case, "eqx_cnn": cnn_case}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]()


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)


# -- a step as equinox's own examples write it ------------------------------------------------------
class NormedMLP(eqx.Module):
    """BatchNorm (batch statistics over a ``jax.vmap`` axis name, running averages in ``eqx.nn.State``)
    between linear layers, as equinox's ``stateful`` example; its ``axis_name``, ``inference`` flag
    and activation are Python objects in the module."""

    norm: eqx.nn.BatchNorm
    lin1: eqx.nn.Linear
    lin2: eqx.nn.Linear
    activation: object = eqx.field(static=False, default=jax.nn.relu)

    def __init__(self, d, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.BatchNorm(input_size=d, axis_name="batch", mode="batch")
        self.lin1 = eqx.nn.Linear(d, d, key=k1)
        self.lin2 = eqx.nn.Linear(d, d, key=k2)

    def __call__(self, x, state):
        x, state = self.norm(x, state)
        return self.lin2(self.activation(self.lin1(x))), state


def _eqx_step(optim):
    def loss(model, state, xs, ys):
        pred, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xs, state)
        return jnp.mean((pred - ys) ** 2), state

    def make_step(model, state, opt_state, xs, ys):
        (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, state, xs, ys)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, opt_state, value

    return make_step


@pytest.mark.parametrize("name", ["fp16", "int8_per_channel", "mxfp8"])
def test_filter_jit_step_returns_the_module(name):
    """``eqx.filter_jit(scalify(make_step))`` with a step that returns its ``eqx.Module`` and
    ``eqx.nn.State``, unchanged: the module's Python leaves come back as they were (they failed as
    non-JAX outputs), the BatchNorm's ``pmean`` over the vmap axis runs (it failed: a collective
    over a positional axis), and every array agrees with the float32 step on the same values."""
    from thirdparty_harness import array_leaves, assert_tree_close, dequantize_tree, quantize_tree

    import qformats as qf
    import scalify

    fmt, d = qf.get_format(name), 32
    model, state = eqx.nn.make_with_state(NormedMLP)(d, jax.random.key(0))
    qmodel = quantize_tree(model, fmt)
    dmodel = dequantize_tree(qmodel)
    rng = np.random.default_rng(0)
    xs, ys = (jnp.asarray(rng.standard_normal((8, d)), jnp.float32) for _ in range(2))
    optim = optax.adam(1e-2, eps=1e-2)
    opt_state = optim.init(eqx.filter(dmodel, eqx.is_array))
    step = _eqx_step(optim)
    expected = eqx.filter_jit(step)(dmodel, state, opt_state, xs, ys)
    got = eqx.filter_jit(scalify.scalify(step))(qmodel, state, opt_state, xs, ys)
    assert got[0].norm.axis_name == "batch" and got[0].norm.inference is False
    assert got[0].activation is jax.nn.relu
    assert_tree_close(array_leaves(got), array_leaves(expected), fmt, "model, state, optimizer state and loss")
    assert float(got[3]) == pytest.approx(float(expected[3]), rel=1e-5)


def test_sharpness_aware_step_under_recipe(case):
    """Both gradients of a sharpness-aware step taken inside ``recipes.apply``: the second at
    parameters that mix every input of the step (through the first gradient) still runs each
    GEMM in its roles (before, the step raised the pairing error)."""
    check_sharpness_aware_step(case)
