"""Serve a ModelOpt NVFP4 Llama checkpoint in JAX with the weights kept in NVFP4.

Loads a checkpoint exported by ``modelopt.torch.export.export_hf_checkpoint`` (NVFP4: ``weight`` u8,
``weight_scale`` f8e4m3, ``weight_scale_2`` f32) with :func:`qformats.read_checkpoint`, wraps each
quantized weight as a :class:`scalify.ScaledArray` (``data`` and ``scale`` as stored, format
``modelopt_nvfp4``) and runs a Llama forward under ``jax.jit(scalify.scalify(forward))``. The same
forward on the dequantized weights (``fmt.dequantize``, which equals ModelOpt's own dequantization bit
for bit) gives the reference logits.

Usage: python examples/serve_nvfp4_llama.py CHECKPOINT_DIR [--tokens 1,5,9,...]
(e.g. shared/vectors/checkpoints/modelopt_nvfp4_hf_export_tinyllama)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import qformats as qf
import scalify


def load(path):
    """``(config, params)``: NVFP4 weights as ScaledArrays, everything else as bfloat16 arrays."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    params = {}
    for name, t in qf.read_checkpoint(path).items():
        if isinstance(t, qf.QuantizedTensor):
            params[name] = scalify.ScaledArray(
                jnp.asarray(t.data), jax.tree.map(jnp.asarray, t.scale), fmt=t.fmt, dtype=t.dtype
            )
        elif name.endswith(".weight"):
            params[name] = jnp.asarray(t)
    return cfg, params


def dense(params, dtype=None):
    """The same parameters with every quantized weight dequantized: in the producer's dtype (bfloat16,
    ModelOpt's own values bit for bit) by default, or in ``dtype`` (float32: the exact products)."""
    return {
        k: (v.fmt.dequantize(v.data, v.scale, dtype or v.dtype) if isinstance(v, scalify.ScaledArray) else v)
        for k, v in params.items()
    }


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))
    return y.astype(jnp.bfloat16) * w


def linear(x, w):
    """``x @ w.T`` for ``w[out, in]``, accumulated in float32, result in bfloat16."""
    return jnp.einsum("ti,oi->to", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def rope(x, pos, theta):
    """Rotary embedding (Llama's rotate-half form) on ``x[t, heads, dim]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    ang = pos[:, None].astype(jnp.float32) * jnp.asarray(inv, jnp.float32)[None, :]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, None, :]
    x32 = x.astype(jnp.float32)
    half = d // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos + rot * sin).astype(jnp.bfloat16)


def forward(params, tokens, cfg):
    """Llama forward for one sequence ``tokens[t]``: logits ``[t, vocab]`` in float32."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    t = tokens.shape[0]
    pos = jnp.arange(t)
    h = params["model.embed_tokens.weight"][tokens]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, params[p + "input_layernorm.weight"], eps)
        q = rope(linear(x, params[p + "self_attn.q_proj.weight"]).reshape(t, nh, hd), pos, theta)
        k = rope(linear(x, params[p + "self_attn.k_proj.weight"]).reshape(t, nkv, hd), pos, theta)
        v = linear(x, params[p + "self_attn.v_proj.weight"]).reshape(t, nkv, hd)
        k = jnp.repeat(k, nh // nkv, axis=1)
        v = jnp.repeat(v, nh // nkv, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) / np.float32(math.sqrt(hd))
        a = jax.nn.softmax(jnp.where(mask[None], s, np.float32(-1e30)), axis=-1).astype(jnp.bfloat16)
        o = jnp.einsum("hqk,khd->qhd", a, v, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        h = h + linear(o.reshape(t, nh * hd), params[p + "self_attn.o_proj.weight"])
        x = rms_norm(h, params[p + "post_attention_layernorm.weight"], eps)
        g = linear(x, params[p + "mlp.gate_proj.weight"])
        u = linear(x, params[p + "mlp.up_proj.weight"])
        h = h + linear(
            (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(jnp.bfloat16),
            params[p + "mlp.down_proj.weight"],
        )
    h = rms_norm(h, params["model.norm.weight"], eps)
    return jnp.einsum("ti,oi->to", h, params["lm_head.weight"], preferred_element_type=jnp.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--tokens", default="1,15,27,3,99,42,7,64")
    args = ap.parse_args(argv)
    cfg, params = load(args.checkpoint)
    tokens = jnp.asarray([int(s) for s in args.tokens.split(",")], jnp.int32)
    nq = sum(isinstance(v, scalify.ScaledArray) for v in params.values())
    codes = sum(v.data.nbytes for v in params.values() if isinstance(v, scalify.ScaledArray))
    print(f"{nq} NVFP4 weights kept quantized ({codes} bytes of codes)")

    run = jax.jit(scalify.scalify(lambda p, x: forward(p, x, cfg)))
    t0 = time.perf_counter()
    logits = np.asarray(run(params, tokens))
    t1 = time.perf_counter()
    plain = jax.jit(lambda p, x: forward(p, x, cfg))
    ref = np.asarray(plain(dense(params), tokens))
    ref32 = np.asarray(plain(dense(params, jnp.float32), tokens))
    top = np.abs(ref).max()
    print(f"logits {logits.shape}, first call {t1 - t0:.2f} s, max |logit| {top:.3g}")
    print(
        f"  max |scalify - producer-dequantized bf16 weights| = {np.abs(logits - ref).max():.3g}, "
        f"argmax agree {(logits.argmax(-1) == ref.argmax(-1)).mean():.0%}"
    )
    print(f"  max |scalify - float32-dequantized weights|       = {np.abs(logits - ref32).max():.3g}")
    return logits, ref


if __name__ == "__main__":
    main()
