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
from thirdparty_harness import (
    Case,
    StepResults,
    check_grad,
    check_sharpness_aware_step,
    check_update,
    keras_step_with_the_recipe_on_the_loss,
    run_loss,
)

import scalify

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


# -------------------------------------------------------------------------------------------------
# model.fit under a training recipe: keras's own train_step, one line changed
# -------------------------------------------------------------------------------------------------


def mnist_convnet():
    """keras-io's "Simple MNIST convnet" (two Conv2D + MaxPooling2D, Flatten, Dropout, a softmax
    Dense), on 16x16 images, compiled as the example compiles it; layer names from a fresh session
    (the softmax layer's scope is ``dense``)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input(shape=(16, 16, 1)),
            keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("name", ["float8_tensorwise", "mxfp8"])
def test_model_fit_under_a_recipe(name):
    """``model.train_step = recipes.apply(model.train_step, recipe)``, then ``model.fit`` unchanged:
    keras takes the gradient inside its step, so the recipe meets a differentiated program and must
    run its backward GEMMs in their roles. The weights after two steps (a 64-image epoch) equal those of the step
    that applies the recipe to the loss alone (within 1e-5 of each weight's largest magnitude: two
    programs XLA compiles apart), and differ from float32's. MXFP8 keeps the 10-way Dense in high
    precision (its input gradient sums over 10 outputs); the first convolution, over one input
    channel, is no GEMM and keeps the program's precision under any recipe."""
    recipe = scalify.recipes.get_recipe(name)
    if name == "mxfp8":
        recipe = recipe.replace(high_precision_scopes=("dense",))
    rng = np.random.default_rng(0)
    x = rng.random((64, 16, 16, 1)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, 64), 10)

    def fit(change):
        model = mnist_convnet()
        change(model)
        history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        return history.history["loss"], [np.asarray(v.value) for v in model.trainable_variables]

    loss, weights = fit(lambda m: setattr(m, "train_step", scalify.recipes.apply(m.train_step, recipe)))
    ref_loss, ref_weights = fit(lambda m: setattr(m, "train_step", keras_step_with_the_recipe_on_the_loss(m, recipe)))
    _, f32_weights = fit(lambda m: None)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for w, ref in zip(weights, ref_weights, strict=True):
        np.testing.assert_allclose(w, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    moved = [
        not np.allclose(w, f, rtol=0, atol=1e-5 * np.abs(f).max()) for w, f in zip(weights, f32_weights, strict=True)
    ]
    assert any(moved)


def test_sharpness_aware_step_under_recipe(case):
    """Both gradients of a sharpness-aware step taken inside ``recipes.apply``: the second at
    parameters that mix every input of the step (through the first gradient) still runs each
    GEMM in its roles (before, the step raised the pairing error)."""
    check_sharpness_aware_step(case)
