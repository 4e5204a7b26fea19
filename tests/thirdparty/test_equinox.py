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
from thirdparty_harness import Case, StepResults, check_grad, check_update, run_loss

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
