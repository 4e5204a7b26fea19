"""Shared pieces of the distributed tests: the 2x4 mesh, a small MLP and a GPT-style transformer block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qformats as qf
import scalify as jsa
import scalify._rules_collectives
from examples.train.models import GPTConfig, gpt_init, layer_norm
from scalify import ops

D_IN, D_HID, D_OUT, BATCH = 64, 128, 64, 16


# Mesh axis types: "explicit" is what ``jax.make_mesh`` gives by default (the sharding is part of
# each array's type, and JAX checks it operation by operation); "auto" is the classic GSPMD mesh.
# Every test runs on an explicit mesh; the ones that take ``AXES`` also run on an auto one (a
# representative subset, to keep the suite's time in check).
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
AXES = list(AXIS_TYPES)


def mesh_2x4(axes="explicit"):
    """The 2x4 ``("d", "m")`` mesh; ``axes="explicit"`` is ``jax.make_mesh``'s default."""
    if axes == "explicit":
        return jax.make_mesh((2, 4), ("d", "m"))
    return jax.make_mesh((2, 4), ("d", "m"), axis_types=(AXIS_TYPES[axes],) * 2)


def explicit(mesh) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def mlp_data(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": (rng.normal(size=(D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32),
        "w2": (rng.normal(size=(D_HID, D_OUT)) / np.sqrt(D_HID)).astype(np.float32),
    }
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
    return params, x, y


def loss_fn(params, x, y, out_sharding=None):
    """``out_sharding``: the sharding of the output of the second matmul. Under explicit axes a
    row-split ``w2`` (tensor parallelism) contracts a sharded axis, and JAX asks the program to say
    how the sum is laid out (``P("d", None)``: reduced over "m"); elsewhere ``None``."""
    h = jax.nn.relu(x @ params["w1"])
    out = jnp.matmul(h, params["w2"], out_sharding=out_sharding)
    return jnp.mean((out - y) ** 2)


def train_step(params, x, y, out_sharding=None):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, out_sharding)
    new = jax.tree.map(lambda w, g: w - 0.5 * g, params, grads)
    return new, loss


def scaled_params(params, fmt):
    if fmt is None:
        return {k: jsa.as_scaled_array(jnp.asarray(v), scale=np.float32(0.25)) for k, v in params.items()}
    return {k: jsa.as_scaled_array(jnp.asarray(v), fmt=fmt) for k, v in params.items()}


@jax.jit
def _dequantize(tree):
    return jax.tree.map(
        lambda v: v.to_array(jnp.float32) if isinstance(v, jsa.ScaledArray) else v, tree, is_leaf=jsa.is_scaled_leaf
    )


def values(tree):
    """Float32 numpy values of a pytree that may hold ScaledArrays (decoded in one jitted program)."""
    return jax.tree.map(np.asarray, _dequantize(tree))


def named(mesh, spec):
    return NamedSharding(mesh, spec)


DP_SPECS = {"params": P(), "x": P(("d", "m")), "y": P(("d", "m"))}
TP_SPECS = {"params": {"w1": P(None, "m"), "w2": P("m", None)}, "x": P("d"), "y": P("d")}


# -- a GPT-style transformer block ------------------------------------------------------------------
# The pre-LayerNorm block of examples/train's character GPT (``gpt_apply``), built from the same
# pieces (``gpt_init``, ``layer_norm``, einsums). ``gpt_apply`` itself is not used: it embeds
# tokens and projects QKV with one fused ``(d, 3d)`` weight split into [Q | K | V], so a column split
# of it would not keep whole heads on a device. Megatron keeps heads local, so Q, K and V are the
# three column thirds of ``gpt_init``'s ``w_qkv``, held as separate weights.
# d_model 128 (4 heads of 32): a split over the 4-way model axis leaves one head and at least 32
# features per device, so MX blocks of 32 stay whole.
BLOCK_CFG = GPTConfig(vocab=32, context=16, d_model=128, n_heads=4, n_layers=1, d_ff=256)
BLOCK_BATCH = 8
BLOCK_LR = np.float32(0.5)
_COL, _ROW, _REP = P(None, "m"), P("m", None), P()

# Megatron tensor parallelism: QKV and MLP-up column-split (output features over "m"), attention
# out and MLP-down row-split (input features over "m"); layer-norm parameters replicated.
BLOCK_TP_PARAMS = {
    "ln1_g": _REP,
    "ln1_b": _REP,
    "wq": _COL,
    "wk": _COL,
    "wv": _COL,
    "w_proj": _ROW,
    "ln2_g": _REP,
    "ln2_b": _REP,
    "w_fc": _COL,
    "w_fc2": _ROW,
}
BLOCK_SPECS = {
    "data-parallel": {"params": {k: _REP for k in BLOCK_TP_PARAMS}, "x": P(("d", "m"))},
    "tensor-parallel": {"params": BLOCK_TP_PARAMS, "x": P("d")},
}
# The format each parameter is held in. Every format sits on a column-split weight and the
# per-tensor FP8 and the blocked MXFP8 also on a row-split one (FP16 shares FP8's layout: a 0-d
# scale, replicated); FP16 also holds the replicated layer-norm vectors. One mixed tree rather than
# one test per format: each compilation of the scalified block step takes ~10 s on the CPU.
BLOCK_FORMATS = {
    "ln1_g": qf.FP16,
    "ln1_b": qf.FP16,
    "wq": qf.MXFP8,
    "wk": qf.FP8_E4M3,
    "wv": qf.FP16,
    "w_proj": qf.FP8_E4M3,
    "ln2_g": qf.FP16,
    "ln2_b": qf.FP16,
    "w_fc": qf.MXFP8,
    "w_fc2": qf.MXFP8,
}


def block_data(seed=0):
    """Float32 block parameters (layer norms perturbed from 1 / 0), input and target ``(B, T, d)``."""
    cfg = BLOCK_CFG
    h = {k: np.asarray(v) for k, v in gpt_init(jax.random.key(seed), cfg)["h0"].items()}
    wq, wk, wv = np.split(h.pop("w_qkv"), 3, axis=1)
    rng = np.random.default_rng(seed)
    d = cfg.d_model
    params = dict(h, wq=wq, wk=wk, wv=wv)
    for k in ("ln1_g", "ln2_g"):
        params[k] = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    for k in ("ln1_b", "ln2_b"):
        params[k] = (0.1 * rng.standard_normal(d)).astype(np.float32)
    x = rng.standard_normal((BLOCK_BATCH, cfg.context, d)).astype(np.float32)
    y = rng.standard_normal((BLOCK_BATCH, cfg.context, d)).astype(np.float32)
    return params, x, y


@jax.jit
def _quantize_block_params(params):
    return {k: jsa.as_scaled_array(v, fmt=BLOCK_FORMATS[k]) for k, v in params.items()}


def block_inputs(seed=0):
    """``(float32 params, params held in BLOCK_FORMATS, x as a carrier ScaledArray, y)``."""
    params, x, y = block_data(seed)
    sp = _quantize_block_params(params)  # one compiled program, not op-by-op dispatch (seconds)
    return params, sp, jsa.as_scaled_array(jnp.asarray(x), scale=np.float32(2.0)), jnp.asarray(y)


def _identity(v):
    return v


def _mm(spec, a, b, out_sharding=None):
    """A matmul of the block; the parameters carry the format, nothing is re-quantized here."""
    if out_sharding is None:
        return jnp.einsum(spec, a, b)
    return jnp.einsum(spec, a, b, out_sharding=out_sharding)


def block_apply(p, x, f=_identity, g=_identity, out_sharding=None):
    """The block on ``x`` (B, T, d). ``f`` and ``g`` are Megatron's conjugate operators around the
    tensor-parallel region (``f`` before the column-split matmuls, ``g`` after the row-split ones);
    identities on one device and under jit shardings, where XLA inserts the collectives.
    ``out_sharding``: the sharding of the row-split matmuls' outputs under explicit mesh axes (there
    the contracted axis is sharded, and JAX asks the program how the sum is laid out); else None."""
    b, t, _ = x.shape
    hd = BLOCK_CFG.d_model // BLOCK_CFG.n_heads
    h = f(layer_norm(x, p["ln1_g"], p["ln1_b"]))

    def heads(w):  # (B, T, d) -> (B, heads, T, hd); inside shard_map: this device's heads
        return _mm("btd,de->bte", h, w).reshape(b, t, -1, hd).transpose(0, 2, 1, 3)

    q, k, v = heads(p["wq"]), heads(p["wk"]), heads(p["wv"])
    att = jnp.einsum("bhtd,bhsd->bhts", q, k) * np.float32(1.0 / np.sqrt(hd))
    att = jnp.where(np.tril(np.ones((t, t), bool)), att, np.float32(-1e4))  # causal mask
    att = jax.nn.softmax(att, axis=-1)
    y = jnp.einsum("bhts,bhsd->bhtd", att, v).transpose(0, 2, 1, 3).reshape(b, t, -1)
    x = x + g(_mm("btd,de->bte", y, p["w_proj"], out_sharding))
    h = f(layer_norm(x, p["ln2_g"], p["ln2_b"]))
    return x + g(_mm("btf,fd->btd", jax.nn.gelu(_mm("btd,df->btf", h, p["w_fc"])), p["w_fc2"], out_sharding))


def block_loss(p, x, y, f=_identity, g=_identity, out_sharding=None):
    return jnp.mean((block_apply(p, x, f, g, out_sharding) - y) ** 2)


def block_train_step(params, x, y, out_sharding=None):
    """One SGD step. The updated parameters are re-quantized into their formats (they stay held in
    BLOCK_FORMATS from step to step); the loss and the gradients (float32 carriers) come back too."""
    loss, grads = jax.value_and_grad(block_loss)(params, x, y, out_sharding=out_sharding)
    new = {k: ops.quantize(w - BLOCK_LR * grads[k], BLOCK_FORMATS[k]) for k, w in params.items()}
    return new, loss, grads


def megatron_ops(axis):
    """Megatron's ``f`` (identity forward, all-reduce backward) and ``g`` (all-reduce forward,
    identity backward) over the mesh ``axis``, for shard_map with ``check_vma=False``."""

    @jax.custom_vjp
    def f(v):
        return v

    f.defvjp(lambda v: (v, None), lambda _, ct: (jax.lax.psum(ct, axis),))

    @jax.custom_vjp
    def g(v):
        return jax.lax.psum(v, axis)

    g.defvjp(lambda v: (jax.lax.psum(v, axis), None), lambda _, ct: (ct,))
    return f, g


def format_step(sa):
    """One grid step of a formatted ScaledArray's format at each element (value units, float64).

    numpy only (ml_dtypes decodes the fp16 / fp8 data and the E8M0 scale bytes): no device programs."""
    elems = np.asarray(sa.data).astype(np.float64)
    scale = np.asarray(sa.scale).astype(np.float64)
    if scale.ndim:  # a block grid: repeat each scale over its block
        for ax, b in enumerate(sa.fmt.block_shape(elems.shape)):
            scale = np.repeat(scale, b, axis=ax)
    return 2.0 * sa.fmt.element.half_step(elems) * scale
