"""Helpers shared by the formats: the division every producer's rounding depends on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from qformats._bits import round_quotient
from qformats._layout import explicit_sharding

# Backends whose float32 division XLA compiles to a hardware IEEE divide (the CPU). Elsewhere (NVIDIA
# GPUs: PTX ``div.full.f32``, within 2 ulps) the quotient is repaired to the correctly rounded one.
IEEE_DIVISION_PLATFORMS = ("cpu",)


def div(a, b, *, opaque=False):
    """IEEE ``a / b`` (correctly rounded float32), as numpy and torch compute it, on every backend.

    XLA on CPU rewrites a division by a constant or by a broadcast value (a scalar, or a block
    scale expanded to its elements) into a multiplication by the reciprocal, which can differ in
    the last bit; producers divide. The divisor is therefore broadcast to the result's shape
    behind an optimization barrier, which XLA cannot see through. It is broadcast by a select on
    a predicate computed from the dividend, not with ``broadcast_to``: under ``vmap`` an unbatched
    divisor would stay unbatched through ``broadcast_to`` (and ``ones_like``), and vmap's own
    broadcast, outside the barrier, would be rewritten again.

    Off the platforms in ``IEEE_DIVISION_PLATFORMS`` the backend's quotient is not trusted to be
    correctly rounded (XLA on NVIDIA GPUs divides with PTX ``div.full.f32``) and is repaired with
    integer arithmetic (:func:`qformats._bits.round_quotient`).

    ``opaque=True`` returns the quotient behind an optimization barrier, for a quotient that is
    divided again: XLA rewrites ``(A / B) / C`` as ``A / (B * C)``, which rounds differently.
    (Only for small arrays such as scales: the barrier also keeps the quotient out of fusions.)
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
    # Chosen when lowering, so the compiled program holds one of the two.
    exact = {platform: _quotient for platform in IEEE_DIVISION_PLATFORMS}
    q = lax.platform_dependent(a, b, default=_rounded_quotient, **exact)
    return lax.optimization_barrier(q) if opaque else q


def _quotient(a, b):
    """The backend's float32 ``a / b``."""
    return a / b


@jax.custom_jvp
def _rounded_quotient(a, b):
    """``a / b`` correctly rounded from the backend's quotient (:func:`round_quotient`)."""
    return round_quotient(a, b, _quotient(a, b))


@_rounded_quotient.defjvp
def _rounded_quotient_jvp(primals, tangents):
    # d(a / b) = da / b - (a / b) db / b: the rounding repair moves the value, not the derivative.
    (a, b), (da, db) = primals, tangents
    q = _rounded_quotient(a, b)
    return q, (da - q * db) / b
