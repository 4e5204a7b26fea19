"""Stands in for a library's own code in error-location tests: its frames are excluded from JAX's
user tracebacks, as flax excludes its modules' (``flax.traceback_util.register_exclusion``), so the
equations it emits have no user line of their own and the caller's line names them."""

from __future__ import annotations

import jax
from flax import traceback_util

traceback_util.register_exclusion(__file__)


@jax.jit
def foreign_kernel(v):
    """A foreign (FFI) kernel applied to ``v``: ``ffi_call``, whose math scalify cannot know, so it
    has no rule. Tracing is enough to reach it; no handler is registered or run."""
    return jax.ffi.ffi_call("library_kernel", jax.ShapeDtypeStruct(v.shape, v.dtype))(v)
