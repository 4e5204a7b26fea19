"""keras 3 (JAX backend): a GPT-2-style backbone from ``keras.layers``.

Token and position embeddings, a pre-norm block (``LayerNormalization``, ``MultiHeadAttention`` with
``use_causal_mask=True``, a GELU ``Dense`` MLP), a final norm and a read-out tied to the token
embedding. The loss is a pure function of the weights through ``model.stateless_call(trainable,
non_trainable, x)``. (keras masks attention scores as ``where(mask, x, -1e9)``.)
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Case, StepResults, check_grad, check_update, run_loss

keras = pytest.importorskip("keras", minversion="3.0", reason="keras 3 is not installed (pip install -e '.[test]')")
if keras.backend.backend() != "jax":
    pytest.skip(f"keras was imported with the {keras.backend.backend()} backend, not jax", allow_module_level=True)

VOCAB, D, HEADS, HIDDEN, BATCH, T = 64, 64, 2, 128, 2, 8


class TiedReadout(keras.layers.Layer):
    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def gpt2_backbone():
    keras.utils.set_random_seed(5)
    tokens = keras.Input((T,), dtype="int32")
    token_embedding = keras.layers.Embedding(VOCAB, D)
    positions = keras.ops.expand_dims(keras.ops.arange(T), 0)
    x = token_embedding(tokens) + keras.layers.Embedding(T, D)(positions)
    h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    h = keras.layers.MultiHeadAttention(HEADS, key_dim=D // HEADS)(h, h, use_causal_mask=True)
    x = x + h
    h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    h = keras.layers.Dense(HIDDEN, activation="gelu")(h)
    x = x + keras.layers.Dense(D)(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    return keras.Model(tokens, TiedReadout(token_embedding)(x))


@pytest.fixture(scope="module")
def case():
    model = gpt2_backbone()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    batch = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, size=(BATCH, T + 1)), jnp.int32)

    def loss(trainable, tokens):
        logits, _ = model.stateless_call(trainable, non_trainable, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return Case("keras_gpt2_backbone", loss, trainable, batch)


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)
