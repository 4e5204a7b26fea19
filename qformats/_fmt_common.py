"""Helpers shared by the checkpoint formats (``_fmt_*.py``)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from qformats._layout import explicit_sharding


def div(a, b):
    """IEEE ``a / b`` (correctly rounded float32), as numpy and torch compute it.

    XLA on CPU rewrites a division by a constant or by a broadcast value (a scalar, or a block
    scale expanded to its elements) into a multiplication by the reciprocal, which can differ in
    the last bit; producers divide. The divisor is therefore broadcast to the result's shape
    behind an optimization barrier, which XLA cannot see through. It is broadcast by a select on
    a predicate computed from the dividend, not with ``broadcast_to``: under ``vmap`` an unbatched
    divisor would stay unbatched through ``broadcast_to`` (and ``ones_like``), and vmap's own
    broadcast, outside the barrier, would be rewritten again.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    a = jnp.broadcast_to(a, jnp.broadcast_shapes(a.shape, b.shape))
    sharding = explicit_sharding(a)
    if sharding is not None:
        # With explicit sharding the select's predicate and cases must share one sharding: the
        # divisor is broadcast into the dividend's (a per-channel scale of a sharded weight).
        b = lax.broadcast_in_dim(b, a.shape, tuple(range(a.ndim - b.ndim, a.ndim)), out_sharding=sharding)
    b = lax.optimization_barrier(jnp.where(a == a, b, b))
    return a / b
