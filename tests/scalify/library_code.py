"""Stands in for a library's own code in error-location tests: its frames are excluded from JAX's
user tracebacks, as flax excludes its modules' (``flax.traceback_util.register_exclusion``), so the
equations it emits have no user line of their own and the caller's line names them."""

from __future__ import annotations

import jax
import jax.experimental.sparse as sparse
import jax.numpy as jnp
from flax import traceback_util

traceback_util.register_exclusion(__file__)


@jax.jit
def sparse_mix(v):
    """A sparse (BCOO) matrix times ``v``: ``bcoo_dot_general``, which scalify has no rule for."""
    adjacency = sparse.BCOO.fromdense(jnp.eye(v.shape[0], dtype=v.dtype), nse=v.shape[0])
    return adjacency @ v
