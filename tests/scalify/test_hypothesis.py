"""Random compositions of supported operations: scalify(f)(scaled) == f(dequantized inputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import FORMATS, fast_jit, make_scaled
from hypothesis import given, settings
from hypothesis import strategies as st

import scalify as jsa

# Shape-preserving (4, 32) -> (4, 32) operations on (x, y); continuous, bounded growth.
OPS = {
    "neg": lambda x, y: -x,
    "abs": lambda x, y: jnp.abs(x),
    "tanh": lambda x, y: jnp.tanh(x),
    "sigmoid": lambda x, y: jax.nn.sigmoid(x),
    "gelu": lambda x, y: jax.nn.gelu(x),
    "half": lambda x, y: x * 0.5,
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "max": lambda x, y: jnp.maximum(x, y),
    "where": lambda x, y: jnp.where(y > 0, x, y),
    "transpose2": lambda x, y: (x.T * 1.0).T,
    "reshape": lambda x, y: x.reshape(8, 16).reshape(4, 32),
    "center": lambda x, y: x - jnp.mean(x, axis=-1, keepdims=True),
    "softmax": lambda x, y: jax.nn.softmax(x, axis=-1),
    "normalize": lambda x, y: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1.0),
    "matmul": lambda x, y: (x @ y.T) @ y * (1.0 / 32.0),
    "roll": lambda x, y: jnp.concatenate([x[:, 16:], x[:, :16]], axis=1),
    "exp_small": lambda x, y: jnp.exp(jnp.tanh(x)),
    "log_softplus": lambda x, y: jnp.log(jax.nn.softplus(x) + 1.0),
}


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=5),
    fmt_name=st.sampled_from(sorted(FORMATS)),
    seed=st.integers(0, 2**16),
)
def test_random_compositions(ops, fmt_name, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((4, 32)) * 2, jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    fmt = FORMATS[fmt_name]
    sx, sy = make_scaled(x, fmt), make_scaled(y, fmt, scale=0.5)

    def f(a, b):
        for name in ops:
            a = OPS[name](a, b)
        return a

    expected = np.asarray(f(jnp.asarray(np.asarray(sx)), jnp.asarray(np.asarray(sy))))
    got = np.asarray(fast_jit(jsa.scalify(f), sx, sy))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * max(1.0, float(np.max(np.abs(expected)))))
