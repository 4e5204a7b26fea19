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
from thirdparty_harness import Case, StepResults, check_grad, check_update, run_loss

keras = pytest.importorskip("keras", minversion="3.0", reason="keras 3 is not installed (pip install -e '.[test]')")
if keras.backend.backend() != "jax":
    pytest.skip(f"keras was imported with the {keras.backend.backend()} backend, not jax", allow_module_level=True)

VOCAB = 64


class TiedReadout(keras.layers.Layer):
    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def gpt2_backbone(d, seq):
    keras.utils.set_random_seed(5)
    tokens = keras.Input((seq,), dtype="int32")
    token_embedding = keras.layers.Embedding(VOCAB, d)
    positions = keras.ops.expand_dims(keras.ops.arange(seq), 0)
    x = token_embedding(tokens) + keras.layers.Embedding(seq, d)(positions)
    h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    h = keras.layers.MultiHeadAttention(d // 32, key_dim=32)(h, h, use_causal_mask=True)
    x = x + h
    h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    h = keras.layers.Dense(2 * d, activation="gelu")(h)
    x = x + keras.layers.Dense(d)(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    return keras.Model(tokens, TiedReadout(token_embedding)(x))


def gpt2_case(d_model=64, batch=2, seq=8):
    """Width ``d_model`` (a multiple of 32), heads of 32, MLP 2 * d_model."""
    model = gpt2_backbone(d_model, seq)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    batch = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, size=(batch, seq + 1)), jnp.int32)

    def loss(trainable, tokens):
        logits, _ = model.stateless_call(trainable, non_trainable, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return Case("keras_gpt2_backbone", loss, trainable, batch)


CASES = {"keras_gpt2": gpt2_case}


@pytest.fixture(scope="module")
def case():
    return gpt2_case()


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)
