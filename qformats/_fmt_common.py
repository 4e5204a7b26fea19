"""Helpers shared by the formats: the division and product every producer's rounding depends on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from qformats import _layout
from qformats._bits import round_quotient
from qformats._layout import explicit_sharding

# Backends whose float32 division XLA compiles to a hardware IEEE divide (the CPU). Elsewhere (NVIDIA
# GPUs: PTX ``div.full.f32``, within 2 ulps) the quotient is repaired to the correctly rounded one.
IEEE_DIVISION_PLATFORMS = ("cpu",)


def div(a, b):
    """IEEE ``a / b`` (correctly rounded float32) of the values ``a`` and ``b`` hold, as numpy and
    torch compute it, on every backend and whatever program produced the operands.

    Two XLA rewrites change a quotient in the last bit, and the operands are therefore held
    (:func:`_held`):

    * on CPU a division by a constant or by a broadcast value (a scalar, or a block scale expanded
      to its elements) becomes a multiplication by the reciprocal;
    * ``(A / B) / C`` becomes ``A / (B * C)``: a block maximum divided by 6 and then by NVFP4's
      tensor scale, or a user's ``a / c`` fused into a quantization that divides by its scale.

    Off the platforms in ``IEEE_DIVISION_PLATFORMS`` the backend's quotient is not trusted to be
    correctly rounded (XLA on NVIDIA GPUs divides with PTX ``div.full.f32``) and is repaired with
    integer arithmetic (:func:`qformats._bits.round_quotient`).
    """
    a, b = _held(a, b)
    # Chosen when lowering, so the compiled program holds one of the two.
    exact = {platform: _quotient for platform in IEEE_DIVISION_PLATFORMS}
    return lax.platform_dependent(a, b, default=_rounded_quotient, **exact)


def mul(a, b):
    """IEEE ``a * b`` of the values ``a`` and ``b`` hold, whatever program produced them.

    XLA reassociates a product with a constant factor: a user's ``x = a * c`` (``c`` a constant, a
    softmax temperature or ``1 / sqrt(d)``) fed to a quantization that multiplies ``x`` by its
    runtime scale ``r`` (a scalar or a broadcast row) is computed as ``a * (c * r)``, which rounds
    differently from ``x * r``. The operands are therefore held (:func:`_held`).
    """
    a, b = _held(a, b)
    return a * b


def _held(a, b):
    """``a`` and ``b`` as float32, ``b`` broadcast to the common shape, both through one optimization
    barrier, which XLA cannot see through: an operation on them is not merged with their producers.

    The second operand is broadcast inside the barrier, by a select on a predicate computed from the
    first, not with ``broadcast_to``: under ``vmap`` an unbatched operand would stay unbatched
    through ``broadcast_to`` (and ``ones_like``), and vmap's own broadcast, outside the barrier,
    would be rewritten again.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    a = jnp.broadcast_to(a, jnp.broadcast_shapes(a.shape, b.shape))
    sharding = explicit_sharding(a)
    if sharding is not None:
        # With explicit sharding the select's predicate and cases must share one sharding: the
        # second operand is broadcast into the first's (a per-channel scale of a sharded weight).
        b = lax.broadcast_in_dim(b, a.shape, tuple(range(a.ndim - b.ndim, a.ndim)), out_sharding=sharding)
    return lax.optimization_barrier((a, jnp.where(a == a, b, b)))


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


def encode_times_reciprocal(fmt, x):
    """``(data, r)`` in torchao's float8 convention: per block of ``fmt``'s layout
    ``r = fmt.reciprocal_scale(amax)`` and ``data = encode(x * r)``, ``x`` as float32 (checked)."""
    fmt.check_input(x)
    x = jnp.asarray(x).astype(jnp.float32)
    block = fmt.block_shape(x.shape)
    r = fmt.reciprocal_scale(_layout.block_amax(x, block, exact=True))
    return fmt.element.encode(mul(x, _layout.expand(r, x.shape, block))), r


class BlocksOrTiles:
    """Layout and aim of a format with fields ``axis``, ``block_size`` and ``tile_axis``: blocks of
    ``block_size`` along ``axis``, or, with ``tile_axis`` set, square tiles over the two axes."""

    @property
    def layout(self):
        if self.tile_axis is not None:
            return _layout.Tiles(self.axis, self.tile_axis, self.block_size)
        return _layout.Blocked(self.axis, self.block_size)

    def aim(self, contracted, free=None):
        """Blocks along the contracted axis; a tiled format tiles with the operand's ``free`` axis."""
        if self.tile_axis is None:
            return self.replace(axis=contracted)
        if free is None:
            raise ValueError(
                f"{self.name} with {self.block_size}x{self.block_size} tiles needs a second (free) axis, "
                f"but this GEMM operand has none; use 1-D blocks (tile_axis=None) for it."
            )
        return self.replace(axis=contracted, tile_axis=free)
