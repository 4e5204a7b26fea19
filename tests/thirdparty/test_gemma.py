"""A Gemma-style decoder written as plain JAX in the style of Gemma's reference implementation.

Gemma's reference code is not a pip package, so the model is written here, in its shape: parameters
in a nested dict named like the reference checkpoints, einsum projections, rotary position embeddings
on queries and keys, RMSNorm with a ``1 + scale`` gain, grouped-query attention with attention-logit
soft-capping and a mask applied as ``where(mask, logits, K_MASK)`` with the reference's large negative
literal, a gated GELU MLP, a tied embedding read out with final-logit soft-capping.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import Case, StepResults, check_grad, check_sharpness_aware_step, check_update, run_loss

K_MASK = -2.3819763e38  # the mask literal of Gemma's reference attention


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    vocab: int = 64
    d_model: int = 64
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 32
    hidden: int = 128
    layers: int = 1
    attn_softcap: float = 50.0
    final_softcap: float = 30.0
    max_wavelength: float = 10_000.0


def init_params(cfg: GemmaConfig, key):
    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in).astype(np.float32)

    keys = iter(jax.random.split(key, 1 + 6 * cfg.layers))
    params = {"embedder": {"input_embedding": normal(next(keys), (cfg.vocab, cfg.d_model), 1.0)}}
    for i in range(cfg.layers):
        d, n, k, h, f = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden
        params[f"layer_{i}"] = {
            "pre_attention_norm": {"scale": 0.1 * jax.random.normal(next(keys), (d,))},
            "attn": {
                "q_einsum": {"w": normal(next(keys), (n, d, h), d)},
                "kv_einsum": {"w": normal(next(keys), (2, k, d, h), d)},
                "attn_vec_einsum": {"w": normal(next(keys), (n, h, d), n * h)},
            },
            "pre_ffw_norm": {"scale": jnp.zeros((d,))},
            "mlp": {
                "gating_einsum": normal(next(keys), (2, d, f), d),
                "linear": normal(next(keys), (f, d), f),
            },
        }
    params["final_norm"] = {"scale": jnp.zeros((cfg.d_model,))}
    return params


def rms_norm(x, scale):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed = x * jax.lax.rsqrt(var + 1e-6)
    return normed * (1 + scale)


def apply_rope(x, positions, max_wavelength):
    """Rotary embedding on the last axis of ``x`` [B, T, N, H] at integer ``positions`` [B, T]."""
    head_dim = x.shape[-1]
    fraction = 2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    timescale = max_wavelength**fraction
    angle = positions[..., None].astype(jnp.float32) / timescale  # [B, T, H/2]
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(p, x, positions, mask, cfg: GemmaConfig):
    q = jnp.einsum("BTD,NDH->BTNH", x, p["q_einsum"]["w"])
    k, v = jnp.einsum("BSD,CKDH->CBSKH", x, p["kv_einsum"]["w"])
    q = apply_rope(q, positions, cfg.max_wavelength) * cfg.head_dim**-0.5
    k = apply_rope(k, positions, cfg.max_wavelength)
    b, t, n, h = q.shape
    q = q.reshape(b, t, cfg.kv_heads, n // cfg.kv_heads, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k)
    logits = jnp.tanh(logits / cfg.attn_softcap) * cfg.attn_softcap
    logits = jnp.where(mask[:, None, None], logits, K_MASK)
    probs = jax.nn.softmax(logits, axis=-1)
    enc = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(b, t, n, h)
    return jnp.einsum("BTNH,NHD->BTD", enc, p["attn_vec_einsum"]["w"])


def mlp(p, x):
    gate, up = jnp.einsum("BTD,CDF->CBTF", x, p["gating_einsum"])
    return jnp.einsum("BTF,FD->BTD", jax.nn.gelu(gate) * up, p["linear"])


def forward(params, tokens, cfg: GemmaConfig):
    emb = params["embedder"]["input_embedding"]
    x = emb[tokens] * jnp.sqrt(jnp.float32(cfg.d_model))
    input_mask = tokens != 0
    positions = jnp.cumsum(input_mask, axis=-1) - 1
    t = tokens.shape[1]
    mask = input_mask[:, None, :] & jnp.tril(jnp.ones((t, t), bool))[None]
    for i in range(cfg.layers):
        p = params[f"layer_{i}"]
        x = x + attention(p["attn"], rms_norm(x, p["pre_attention_norm"]["scale"]), positions, mask, cfg)
        x = x + mlp(p["mlp"], rms_norm(x, p["pre_ffw_norm"]["scale"]))
    x = rms_norm(x, params["final_norm"]["scale"])
    logits = jnp.einsum("BTD,VD->BTV", x, emb)
    return jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap


def make_loss(cfg: GemmaConfig):
    def loss(params, tokens):
        logits = forward(params, tokens[:, :-1], cfg)
        targets = tokens[:, 1:]
        weights = (targets != 0).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weights) / jnp.sum(weights)

    return loss


def synthetic_tokens(cfg: GemmaConfig, batch=2, length=9, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, cfg.vocab, size=(batch, length))
    tokens[1, -3:] = 0  # right padding: the mask hides padded keys
    return jnp.asarray(tokens, jnp.int32)


def gemma_case(d_model=64, batch=2, seq=8):
    """Width ``d_model`` (a multiple of 64): heads of 32, one KV head per two query heads, MLP 2 * d_model."""
    cfg = GemmaConfig(d_model=d_model, heads=d_model // 32, kv_heads=d_model // 64, hidden=2 * d_model)
    return Case("gemma", make_loss(cfg), init_params(cfg, jax.random.key(0)), synthetic_tokens(cfg, batch, seq + 1))


CASES = {"gemma": gemma_case}


@pytest.fixture(scope="module")
def case():
    return gemma_case()


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)


def test_sharpness_aware_step_under_recipe(case):
    """Both gradients of a sharpness-aware step taken inside ``recipes.apply``: the second at
    parameters that mix every input of the step (through the first gradient) still runs each
    GEMM in its roles (before, the step raised the pairing error)."""
    check_sharpness_aware_step(case)
