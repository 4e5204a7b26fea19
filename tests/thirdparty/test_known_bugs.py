"""Regression tests for two bugs the third-party models found.

1. Attention masks written as a large negative literal (``where(mask, x, -2.3819763e38)`` as in
   Gemma's reference code, ``where(mask, x, finfo(dtype).min)`` as in flax and equinox, ``-1e9`` as in
   keras) gave NaN after the softmax under ``jit(scalify)``.
2. Every value of a ``qf.BF16`` ScaledArray came out 0 under ``jit(scalify)``.

Both are checked against the float32 program on the dequantized values, for every registered format
where the format accepts the operand's shape. The carrier is float32 and scales are powers of two,
so the tolerance is float32 rounding (see thirdparty_harness.PROPAGATION_RTOL).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import accepts, assert_tree_close, dequantize_tree

import qformats as qf
import scalify

MASK_LITERALS = {
    "gemma_k_mask": -2.3819763e38,
    "finfo_min": float(jnp.finfo(jnp.float32).min),
    "keras_minus_1e9": -1e9,
}


def _masked_attention(q, k, v, literal):
    logits = q @ k.T / np.float32(np.sqrt(q.shape[-1]))
    t = logits.shape[0]
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, literal)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.sum(jnp.square(probs @ v))


@pytest.mark.parametrize("literal", list(MASK_LITERALS), ids=list(MASK_LITERALS))
def test_large_negative_mask_literal(fmt_name, literal):
    fmt = qf.get_format(fmt_name)
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((8, 32)), jnp.float32) for _ in range(3))
    if not accepts(fmt, q):
        pytest.skip(f"{fmt_name} does not accept an (8, 32) operand ({fmt.layout.describe()})")
    sq, sk, sv = (scalify.as_scaled_array(a, fmt=fmt) for a in (q, k, v))
    fn = jax.value_and_grad(lambda q, k, v: _masked_attention(q, k, v, MASK_LITERALS[literal]), argnums=(0, 1, 2))
    expected = fn(*dequantize_tree((sq, sk, sv)))
    got = jax.jit(scalify.scalify(fn))(sq, sk, sv)
    assert_tree_close(got, expected, fmt, f"masked attention ({literal})")


def test_bf16_values_survive_jit_scalify():
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    sx = scalify.as_scaled_array(x, fmt=qf.BF16)
    sw = scalify.as_scaled_array(w, fmt=qf.BF16)

    def fn(x, w):
        return x, x * 2.0, x + x, x @ w, jnp.sum(x, axis=-1), jax.nn.softmax(x), jnp.tanh(x), x.T

    expected = fn(*dequantize_tree((sx, sw)))
    got = jax.jit(scalify.scalify(fn))(sx, sw)
    for i, leaf in enumerate(dequantize_tree(got)):
        assert np.any(np.asarray(leaf) != 0), f"output {i} of the bf16 program is all zeros"
    assert_tree_close(got, expected, qf.BF16, "bf16 ops")


def test_bf16_mlp_loss_and_grad():
    rng = np.random.default_rng(9)
    params = [jnp.asarray(rng.standard_normal((32, 64)) * 0.2, jnp.float32), jnp.zeros(64)]
    params += [jnp.asarray(rng.standard_normal((64, 32)) * 0.2, jnp.float32)]
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)

    def loss(p, x):
        h = jax.nn.gelu(x @ p[0] + p[1])
        return jnp.mean(jax.nn.logsumexp(h @ p[2], axis=-1))

    sparams = [scalify.as_scaled_array(p, fmt=qf.BF16) if p.ndim == 2 else p for p in params]
    fn = jax.value_and_grad(loss)
    expected = fn(dequantize_tree(sparams), x)
    got = jax.jit(scalify.scalify(fn))(sparams, x)
    assert float(np.asarray(dequantize_tree(got)[0])) != 0.0
    assert_tree_close(got, expected, qf.BF16, "bf16 MLP value_and_grad")
