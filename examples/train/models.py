"""The two models: an MLP classifier (digits) and a small character-level GPT-style transformer.

Plain JAX: no format, scale or precision appears here. The models compute in the dtype of their
parameters; the training loop (:mod:`examples.train.loop`) decides the numerics from outside, by
handing them float16 ``scalify.ScaledArray`` parameters under ``scalify.scalify`` or by wrapping
their loss with ``scalify.amp.amp`` / ``scalify.recipes.apply``.
"""

from __future__ import annotations

import math

import attrs
import jax
import jax.numpy as jnp
import numpy as np


def _normal(key, shape, std):
    return jax.random.normal(key, shape, jnp.float32) * std


# ------------------------------------------------------------------------------------------------
# MLP classifier
# ------------------------------------------------------------------------------------------------
MLP_SIZES = (64, 256, 256, 10)


def mlp_init(key, init_scale: float = 1.0, sizes=MLP_SIZES, init_std: float | None = None):
    """Float32 parameters, biases zero. Weights: ``init_scale`` times N(0, 1/fan_in), or, with
    ``init_std``, ``init_scale`` times N(0, init_std^2) whatever the fan-in (the unnormalised
    ``scale * randn`` initialisation of JAX's MNIST-from-scratch example, which jax-scalify's float16
    experiment scales)."""
    params = {}
    keys = jax.random.split(key, len(sizes) - 1)
    for i, (k, n_in, n_out) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
        std = init_scale * (init_std if init_std is not None else 1.0 / math.sqrt(n_in))
        params[f"w{i}"] = _normal(k, (n_in, n_out), std)
        params[f"b{i}"] = jnp.zeros((n_out,), jnp.float32)
    return params


def mlp_apply(params, x):
    """Logits (batch, 10) in the parameters' dtype."""
    n = len([k for k in params if k.startswith("w")])
    h = x
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return h


# ------------------------------------------------------------------------------------------------
# Character-level transformer (pre-LayerNorm GPT block)
# ------------------------------------------------------------------------------------------------
@attrs.frozen
class GPTConfig:
    vocab: int = 128
    context: int = 64
    d_model: int = 64
    n_heads: int = 2
    n_layers: int = 2
    d_ff: int = 256


def gpt_init(key, cfg: GPTConfig = GPTConfig(), init_scale: float = 1.0):
    keys = iter(jax.random.split(key, 4 + 4 * cfg.n_layers))
    d = cfg.d_model
    s = init_scale
    p = {
        "wte": _normal(next(keys), (cfg.vocab, d), s * 0.5),
        "wpe": _normal(next(keys), (cfg.context, d), s * 0.1),
        "lnf_g": jnp.ones((d,), jnp.float32),
        "lnf_b": jnp.zeros((d,), jnp.float32),
        "w_out": _normal(next(keys), (d, cfg.vocab), s / math.sqrt(d)),
    }
    for i in range(cfg.n_layers):
        p[f"h{i}"] = {
            "ln1_g": jnp.ones((d,), jnp.float32),
            "ln1_b": jnp.zeros((d,), jnp.float32),
            "w_qkv": _normal(next(keys), (d, 3 * d), s / math.sqrt(d)),
            "w_proj": _normal(next(keys), (d, d), s / math.sqrt(d) / math.sqrt(2 * cfg.n_layers)),
            "ln2_g": jnp.ones((d,), jnp.float32),
            "ln2_b": jnp.zeros((d,), jnp.float32),
            "w_fc": _normal(next(keys), (d, cfg.d_ff), s / math.sqrt(d)),
            "w_fc2": _normal(next(keys), (cfg.d_ff, d), s / math.sqrt(cfg.d_ff) / math.sqrt(2 * cfg.n_layers)),
        }
    return p


def layer_norm(x, g, b):
    """LayerNorm over the last axis."""
    mu = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mu
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    return xc * jax.lax.rsqrt(var + 1e-5) * g + b


def gpt_apply(params, ids, cfg: GPTConfig = GPTConfig()):
    """Logits (batch, context, vocab) in the parameters' dtype for int ``ids`` (batch, context)."""
    bsz, t = ids.shape
    d, nh = cfg.d_model, cfg.n_heads
    hd = d // nh
    onehot = jax.nn.one_hot(ids, cfg.vocab, dtype=params["wte"].dtype)
    x = jnp.einsum("btv,vd->btd", onehot, params["wte"]) + params["wpe"][:t]
    mask = np.tril(np.ones((t, t), dtype=bool))
    for i in range(cfg.n_layers):
        p = params[f"h{i}"]
        h = layer_norm(x, p["ln1_g"], p["ln1_b"])
        q, k, v = jnp.split(jnp.einsum("btd,de->bte", h, p["w_qkv"]), 3, axis=-1)
        q = q.reshape(bsz, t, nh, hd).transpose(0, 2, 1, 3)
        k = k.reshape(bsz, t, nh, hd).transpose(0, 2, 1, 3)
        v = v.reshape(bsz, t, nh, hd).transpose(0, 2, 1, 3)
        att = jnp.einsum("bhtd,bhsd->bhts", q, k) * (1.0 / math.sqrt(hd))
        att = jnp.where(mask, att, -1e4)
        att = jax.nn.softmax(att, axis=-1)
        y = jnp.einsum("bhts,bhsd->bhtd", att, v).transpose(0, 2, 1, 3).reshape(bsz, t, d)
        x = x + jnp.einsum("btd,de->bte", y, p["w_proj"])
        h = layer_norm(x, p["ln2_g"], p["ln2_b"])
        h = jax.nn.gelu(jnp.einsum("btd,df->btf", h, p["w_fc"]))
        x = x + jnp.einsum("btf,fd->btd", h, p["w_fc2"])
    x = layer_norm(x, params["lnf_g"], params["lnf_b"])
    return jnp.einsum("btd,dv->btv", x, params["w_out"])
