"""Helpers shared by the checkpoint formats (``_fmt_*.py``)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def div(a, b):
    """IEEE ``a / b`` (correctly rounded float32), as numpy and torch compute it.

    XLA on CPU rewrites a division by a constant or by a broadcast value (a scalar, or a block
    scale expanded to its elements) into a multiplication by the reciprocal, which can differ in
    the last bit; producers divide. The divisor is therefore broadcast to the result's shape
    behind an optimization barrier, which XLA cannot see through.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    b = lax.optimization_barrier(jnp.broadcast_to(b, shape))
    return a / b
