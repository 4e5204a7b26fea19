"""The two models: an MLP classifier (digits) and a small character-level GPT-style transformer.

Every matmul goes through :func:`qeinsum`, which applies the run's :class:`Numerics`: quantize both
operands through a qformats format (``scalify.ops.quantize``; blocked formats block along the
contracted axis, per-channel formats put their channels on a free axis), optionally quantize the
gradient of the output (``grad_fmt``), and optionally rescale that gradient dynamically
(``scalify.ops.dynamic_rescale_l2_grad``, the jax-scalify recipe for float16).
"""

from __future__ import annotations

import math

import attrs
import jax
import jax.numpy as jnp
import numpy as np

import qformats as qf
from scalify import ops


@attrs.frozen
class Numerics:
    """How a model computes. ``dtype``: storage and compute dtype of parameters and activations.

    ``fmt``: format of the matmul operands (None: unquantized). ``grad_fmt``: format of the gradient
    of each matmul output in the backward pass (None: unquantized). ``rescale_grads``: dynamic
    rescaling of activation gradients (only meaningful under scalify; identity on plain arrays).
    """

    dtype: object = jnp.float32
    fmt: object = None
    grad_fmt: object = None
    rescale_grads: bool = False
    norm_dtype: object = None


def _aim(fmt, contract: int, free: int):
    layout = fmt.layout
    if isinstance(layout, qf.Blocked):
        return fmt.replace(axis=contract)
    if isinstance(layout, qf.PerChannel):
        return fmt.replace(axis=free)
    return fmt


def _quantize_grad(fmt):
    @jax.custom_vjp
    def q(x):
        return x

    q.defvjp(lambda x: (x, None), lambda _, g: (ops.quantize(g, fmt),))
    return q


def qeinsum(num: Numerics, spec: str, a, b, a_axes: tuple[int, int], b_axes: tuple[int, int]):
    """``jnp.einsum(spec, a, b)`` with the run's numerics; ``*_axes`` = (contracted axis, a free axis)."""
    if num.fmt is not None:
        a = ops.quantize(a, _aim(num.fmt, *a_axes))
        b = ops.quantize(b, _aim(num.fmt, *b_axes))
    out = jnp.einsum(spec, a, b)
    if num.grad_fmt is not None:
        out = _quantize_grad(num.grad_fmt)(out)
    if num.rescale_grads:
        out = ops.dynamic_rescale_l2_grad(out)
    return out


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


def mlp_apply(params, x, num: Numerics):
    """Logits (batch, 10) in ``num.dtype``."""
    n = len([k for k in params if k.startswith("w")])
    h = x
    for i in range(n):
        h = qeinsum(num, "bi,io->bo", h, params[f"w{i}"], (-1, 0), (0, -1)) + params[f"b{i}"]
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


def _layer_norm(x, g, b):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mu
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    return xc * jax.lax.rsqrt(var + 1e-5) * g + b


def layer_norm(x, g, b, num: Numerics):
    """LayerNorm; with ``num.norm_dtype`` its statistics and backward run in that dtype."""
    if num.norm_dtype is None:
        return _layer_norm(x, g, b)
    nd = num.norm_dtype
    # scalify's convert_element_type keeps the scale, so float32 carrier data must be renormalised
    # before it is cast back to float16 (forward: the output; backward: the cotangents of the inputs).
    up = [ops.dynamic_rescale_max_grad(a.astype(nd)) for a in (x, g, b)]
    return ops.dynamic_rescale_max(_layer_norm(*up)).astype(x.dtype)


def gpt_apply(params, ids, num: Numerics, cfg: GPTConfig = GPTConfig()):
    """Logits (batch, context, vocab) in ``num.dtype`` for int ``ids`` (batch, context)."""
    bsz, t = ids.shape
    d, nh = cfg.d_model, cfg.n_heads
    hd = d // nh
    onehot = jax.nn.one_hot(ids, cfg.vocab, dtype=num.dtype)
    x = qeinsum(num, "btv,vd->btd", onehot, params["wte"], (-1, -2), (0, -1)) + params["wpe"][:t]
    mask = np.tril(np.ones((t, t), dtype=bool))
    for i in range(cfg.n_layers):
        p = params[f"h{i}"]
        h = layer_norm(x, p["ln1_g"], p["ln1_b"], num)
        qkv = qeinsum(num, "btd,de->bte", h, p["w_qkv"], (-1, -2), (0, -1))
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q = q.reshape(bsz, t, nh, hd).transpose(0, 2, 1, 3)
        k = k.reshape(bsz, t, nh, hd).transpose(0, 2, 1, 3)
        v = v.reshape(bsz, t, nh, hd).transpose(0, 2, 1, 3)
        att = qeinsum(num, "bhtd,bhsd->bhts", q, k, (-1, -2), (-1, -2)) * (1.0 / math.sqrt(hd))
        att = jnp.where(mask, att, -1e4)
        att = jax.nn.softmax(att, axis=-1)
        y = qeinsum(num, "bhts,bhsd->bhtd", att, v, (-1, -2), (-2, -1))
        y = y.transpose(0, 2, 1, 3).reshape(bsz, t, d)
        x = x + qeinsum(num, "btd,de->bte", y, p["w_proj"], (-1, -2), (0, -1))
        h = layer_norm(x, p["ln2_g"], p["ln2_b"], num)
        h = jax.nn.gelu(qeinsum(num, "btd,df->btf", h, p["w_fc"], (-1, -2), (0, -1)))
        x = x + qeinsum(num, "btf,fd->btd", h, p["w_fc2"], (-1, -2), (0, -1))
    x = layer_norm(x, params["lnf_g"], params["lnf_b"], num)
    return qeinsum(num, "btd,dv->btv", x, params["w_out"], (-1, -2), (0, -1))
