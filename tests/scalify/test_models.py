"""Coverage: forward and backward of an MLP, a GPT-style block, a CNN, and an AdamW update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FORMATS, make_scaled, values

import qformats as qf
import scalify as jsa

RNG = np.random.default_rng(1)


def _normal(*shape, std=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * std, jnp.float32)


def _scale_tree(tree, fmt):
    return jax.tree.map(lambda x: make_scaled(x, fmt, scale=0.25) if x.ndim >= 1 and x.shape[-1] % 32 == 0 else x, tree)


def _deq(tree):
    return jax.tree.map(
        lambda v: v.to_array(jnp.float32) if isinstance(v, jsa.ScaledArray) else v, tree, is_leaf=jsa.is_scaled_leaf
    )


def _compare(got, expected, rtol):
    g, e = values(got), values(expected)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(1.0, float(np.max(np.abs(b))))), g, e
    )


# -- (a) MLP with softmax cross-entropy -------------------------------------------------------------
def mlp_loss(params, x, labels):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, h.shape[-1], dtype=h.dtype), axis=-1))


def _mlp():
    params = [
        (_normal(64, 32, std=0.2), jnp.zeros(32)),
        (_normal(32, 32, std=0.2), jnp.zeros(32)),
        (_normal(32, 32, std=0.2), jnp.zeros(32)),
    ]
    return params, _normal(8, 64), jnp.asarray(RNG.integers(0, 32, 8))


# -- (b) GPT-style transformer block --------------------------------------------------------------
def layer_norm(x, g, b):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def gpt_loss(params, tokens):
    emb, ln_g, ln_b, wq, wk, wv, wo, w1, w2 = params
    x = emb[tokens]  # (T, D) embedding lookup
    t, d = x.shape
    h = layer_norm(x, ln_g, ln_b)
    q, k, v = h @ wq, h @ wk, h @ wv
    att = (q @ k.T) / np.sqrt(d).astype(np.float32)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = jnp.where(mask, att, -1e9)
    att = jax.nn.softmax(att, axis=-1)
    x = x + (att @ v) @ wo
    h = layer_norm(x, ln_g, ln_b)
    x = x + jax.nn.gelu(h @ w1, approximate=True) @ w2 + 0.1 * jax.nn.gelu(h @ w1, approximate=False) @ w2
    logits = x @ emb.T  # tied output projection
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp[:-1], tokens[1:, None], axis=-1))


def _gpt():
    d, v = 32, 64
    params = [
        _normal(v, d, std=0.5),
        jnp.ones(d),
        jnp.zeros(d),
        _normal(d, d, std=0.2),
        _normal(d, d, std=0.2),
        _normal(d, d, std=0.2),
        _normal(d, d, std=0.2),
        _normal(d, 2 * d, std=0.2),
        _normal(2 * d, d, std=0.2),
    ]
    return params, jnp.asarray(RNG.integers(0, v, 8))


# -- (c) small CNN ---------------------------------------------------------------------------------
def cnn_loss(params, x, labels):
    w1, w2, wd = params
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dn))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=dn))
    h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
    logits = h.reshape(h.shape[0], -1) @ wd
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, 32), -1))


def _cnn():
    params = [_normal(3, 3, 4, 32, std=0.3), _normal(3, 3, 32, 32, std=0.1), _normal(2 * 2 * 32, 32, std=0.1)]
    return params, _normal(2, 8, 8, 4), jnp.asarray(RNG.integers(0, 32, 2))


MODELS = {"mlp": (mlp_loss, _mlp), "gpt": (gpt_loss, _gpt), "cnn": (cnn_loss, _cnn)}


@pytest.mark.parametrize(
    ("model", "fmt_name"),
    [
        ("mlp", "scale"),
        ("mlp", "fp8_e4m3"),
        ("mlp", "mxfp8"),
        ("gpt", "scale"),
        ("gpt", "mxfp8"),
        ("cnn", "scale"),
        ("cnn", "nvfp4"),
    ],
)
def test_model_grad_both_orders(model, fmt_name):
    loss, init = MODELS[model]
    params, *batch = init()
    sparams = _scale_tree(params, FORMATS[fmt_name])
    expected = jax.value_and_grad(loss)(_deq(sparams), *batch)
    # scalify(grad(f))
    got = jax.jit(jsa.scalify(jax.value_and_grad(loss)))(sparams, *batch)
    _compare(got, expected, rtol=2e-4)
    if fmt_name == "scale":
        # grad(scalify(f)): gradients with respect to the carrier's data and scale. (Formatted
        # leaves hold fp8 / E8M0 codes: differentiate a carrier copy instead.)
        val, g = jax.jit(jax.value_and_grad(lambda p: jsa.asarray(jsa.scalify(loss)(p, *batch))))(sparams)
        np.testing.assert_allclose(float(val), float(expected[0]), rtol=2e-4)
        assert all(np.all(np.isfinite(np.asarray(leaf, np.float32))) for leaf in jax.tree.leaves(g))


def test_grad_through_scalify_matches_value_gradient():
    """grad(scalify(f)) w.r.t. data of a per-tensor carrier == grad(f) * scale."""
    x = _normal(4, 32)
    sx = jsa.as_scaled_array(x, scale=np.float32(2.0))
    g = jax.grad(lambda s: jsa.asarray(jsa.scalify(lambda v: jnp.sum(jnp.tanh(v) ** 2))(s)))(sx)
    ref = jax.grad(lambda v: jnp.sum(jnp.tanh(v) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g.data), np.asarray(ref) * 2.0, rtol=1e-5, atol=1e-6)


def test_adamw_update_on_scaled_params():
    params, x, labels = _mlp()
    sparams = _scale_tree(params, None)
    opt = optax.adamw(1e-2, weight_decay=1e-2)

    def step(p, state):
        g = jax.grad(mlp_loss)(p, x, labels)
        upd, state = opt.update(g, state, p)
        return optax.apply_updates(p, upd), state

    state = opt.init(params)
    # optax's bias correction computes float ** int32 count: standard promotion (suite runs strict).
    with jax.numpy_dtype_promotion("standard"):
        exp_p, _ = step(_deq(sparams), state)
        got_p, got_state = jax.jit(jsa.scalify(step))(sparams, state)
        got_p2, _ = jax.jit(jsa.scalify(step))(got_p, got_state)
    _compare(got_p, exp_p, rtol=1e-4)
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(values(got_p2)))


@pytest.mark.parametrize("name", ["relu", "gelu", "silu", "sigmoid", "softplus", "log_softmax", "logsumexp"])
def test_jax_nn_activations_grad(name):
    fn = getattr(jax.nn, name)
    x = _normal(4, 32, std=3.0)
    sx = jsa.as_scaled_array(x, scale=np.float32(4.0))
    f = lambda v: jnp.sum(fn(v) ** 2)
    g = jax.jit(jsa.scalify(jax.grad(f)))(sx)
    np.testing.assert_allclose(np.asarray(g), jax.grad(f)(x), rtol=1e-5, atol=1e-5)


def test_float16_mlp_step_is_finite_and_close():
    params, x, labels = _mlp()
    p16 = jax.tree.map(lambda v: v.astype(jnp.float16), params)
    sp = jsa.as_scaled_array(p16, scale=np.float32(0.25))
    loss, g = jax.jit(jsa.scalify(jax.value_and_grad(mlp_loss)))(sp, x.astype(jnp.float16), labels)
    ref_loss, _ = jax.value_and_grad(mlp_loss)(params, x, labels)
    np.testing.assert_allclose(float(np.asarray(loss)), float(ref_loss), rtol=2e-2)
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(values(g)))


def test_per_channel_int8_weights_matmul():
    w = _normal(32, 16)
    sw = jsa.as_scaled_array(w, fmt=qf.INT8_PER_CHANNEL)
    x = _normal(4, 32)
    got = jsa.scalify(lambda a, b: a @ b)(x, sw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(sw), rtol=1e-5, atol=1e-5)
