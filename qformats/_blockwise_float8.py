"""Float8 with a float32 scale per block of 128: DeepSeek-V3's training recipe.

torchao's blockwise float8 training (``torchao.prototype.blockwise_fp8_training``) and Transformer
Engine's ``Float8BlockScaling`` quantize activations and gradients in blocks of 128 consecutive
elements along a GEMM's summed axis and weights in 128 x 128 tiles. Per block,

    r = max_value / max(amax, eps)      (float32; TE's default rounds it down to a power of two)
    data = saturate(x * r)              (rounded to nearest even)
    scale = 1 / r                       (float32, the multiplier the GEMM applies)
    value = data * scale

``r`` is a float32 division: torchao divides in float64 and rounds to float32, the same number,
because float64 carries more than twice float32's precision. ``eps`` clamps ``amax`` in float32,
as torchao's Triton kernels do.

Degenerate blocks differ between the two libraries. torchao (``eps=1e-12``; its PyTorch reference
quantizers, for non-finite input): an all-zero block takes ``r = 448 / 1e-12``, and a block holding
Inf or NaN has ``r`` 0 or NaN, so it dequantizes to NaN. Transformer Engine
(``compute_scale_from_amax``, epsilon 0): ``r = 1`` where ``amax`` is 0, Inf or NaN (the block's
finite elements keep their values, saturated), and ``r = FLT_MAX`` where ``448 / amax`` overflows
(``degenerate_unit_scale=True``). Where ``r`` exceeds ``2**126`` (an amax
below about ``max * 2**-126``: ``5e-36`` for E4M3), ``1 / r`` is a float32 subnormal; it is stored
as such, and applied in two normal factors, since XLA on the CPU reads a subnormal operand as 0.
For the same reason a block whose values are all float32 subnormals quantizes to 0 on the CPU (its
amax reads as 0), where TE on a GPU would scale it up.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import jax.numpy as jnp
import numpy as np
from jax import lax

from qformats import _elements, _layout
from qformats._fmt_common import BlocksOrTiles, div, encode_times_reciprocal, mul
from qformats._format import ScaledFormat

_POW2_MASK = np.int32(-(1 << 23))  # 0xFF800000: sign and exponent bits of a float32


@attrs.frozen
class BlockwiseFloat8(BlocksOrTiles, ScaledFormat):
    """``data = sat(x * r)``, ``scale = 1 / r``, ``r = max_value / max(amax, eps)`` per block.

    Blocks are ``block_size`` consecutive elements along ``axis``; with ``tile_axis`` set, square
    ``block_size x block_size`` tiles over ``axis`` and ``tile_axis`` (a weight and its transpose
    then quantize alike). ``pow2=True`` zeroes ``r``'s mantissa bits (Transformer Engine's default
    power-of-two scales; ``1 / r`` is then exact). ``degenerate_unit_scale=True`` gives a block whose
    ``amax`` is 0, Inf or NaN ``r = 1``, and an ``r`` that overflows ``FLT_MAX``, as Transformer
    Engine does (with ``eps=0``: TE's default epsilon).
    """

    local_scales: ClassVar[bool] = True
    axis_fields: ClassVar[tuple[str, ...]] = ("axis", "tile_axis")

    name: str
    element: _elements.FloatElement = _elements.FLOAT8_E4M3FN
    axis: int = -1
    block_size: int = 128
    tile_axis: int | None = None
    pow2: bool = False
    eps: float = 1e-12
    degenerate_unit_scale: bool = False

    def reciprocal_scale(self, amax):
        """``r`` for each block from its float32 ``amax``."""
        # max_value is an operand, not a folded constant: XLA may not rewrite this division.
        amax = jnp.maximum(amax, np.float32(self.eps))  # NaN stays NaN
        r = div(jnp.asarray(self.max_value, jnp.float32), amax)
        if self.degenerate_unit_scale:
            r = jnp.where(jnp.isinf(r), np.float32(np.finfo(np.float32).max), r)
            r = jnp.where((amax == 0) | ~jnp.isfinite(amax), np.float32(1), r)
        if self.pow2:  # a NaN keeps its NaN (masked, it would read as Inf)
            masked = lax.bitcast_convert_type(lax.bitcast_convert_type(r, jnp.int32) & _POW2_MASK, jnp.float32)
            r = jnp.where(jnp.isnan(r), r, masked)
        return r

    def quantize(self, x):
        data, r = encode_times_reciprocal(self, x)
        return data, div(np.float32(1), r)

    def decode(self, data):
        return self.element.decode(data)

    def scale_values(self, scale):
        return jnp.asarray(scale, jnp.float32)

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``decode(data) * scale``, rounded once; a subnormal scale (``r`` above ``2**126``), which
        XLA on the CPU would read as 0, is applied as ``(data * (scale * 2**64)) * 2**-64``, both
        factors normal and built from its bits."""
        elems = self.decode(data)
        block = self.block_shape(elems.shape)
        head, tail = _normal_factors(jnp.asarray(scale, jnp.float32))
        out = mul(mul(elems, _layout.expand(head, elems.shape, block)), _layout.expand(tail, elems.shape, block))
        return out.astype(dtype)


def _normal_factors(scale):
    """``(head, tail)``, both normal float32, with ``head * tail == scale`` for positive ``scale``:
    ``(scale, 1)``, or for a subnormal ``scale = m * 2**-149``, ``(m * 2**-85, 2**-64)``."""
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    sub = (bits > 0) & (bits < 0x00800000)
    head = jnp.where(sub, bits.astype(jnp.float32) * np.float32(2.0**-85), scale)
    return head, jnp.where(sub, np.float32(2.0**-64), np.float32(1))


FP8_E4M3_BLOCK128 = BlockwiseFloat8("fp8_e4m3_block128")
FP8_E4M3_BLOCK128_POW2 = BlockwiseFloat8("fp8_e4m3_block128_pow2", pow2=True, eps=0.0, degenerate_unit_scale=True)
