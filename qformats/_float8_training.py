"""Float8 with torchao's training convention: a reciprocal scale that multiplies on the way in.

torchao's float8 training (``convert_to_float8_training``) stores, per tensor or per row,

    r = max_value / max(amax, eps)            (float32; optionally rounded down to a power of two)
    data = saturate(x * r)                    (rounded to nearest even)
    value = data / r

so ``r`` is the reciprocal of this library's usual multiplier ``amax / max_value``; the two give
different element bits for a few percent to half of the elements. This format keeps torchao's ``r``
as its scale array and divides by it when dequantizing, so quantized operands match torchao bit for
bit. (``r`` is computed with a float32 division: rounding the float64 quotient torchao computes to
float32 gives the same number, because float64 carries more than twice float32's precision.)
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import jax.numpy as jnp
import numpy as np

from qformats import _bits, _elements, _layout
from qformats._fmt_common import div, encode_times_reciprocal
from qformats._format import ScaledFormat


@attrs.frozen
class ReciprocalScaleFloat8(ScaledFormat):
    """``data = sat(x * r)``, ``value = data / r``, ``r = max_value / max(amax, eps)`` (torchao float8).

    ``axis=None`` gives one scale for the tensor (torchao "tensorwise"); an integer gives one scale
    per line along ``axis`` (torchao "rowwise"/"axiswise": ``amax`` reduces over ``axis``, which in
    a GEMM is the contracted axis). ``pow2=True`` rounds ``r`` down to a power of two (torchao's
    ``round_scales_to_power_of_2``), which makes ``1 / r`` exact. ``scale_values`` returns the
    multiplier ``1 / r`` (for code that multiplies); :meth:`dequantize` divides, as torchao does.
    """

    local_scales: ClassVar[bool] = True

    name: str
    element: _elements.FloatElement
    axis: int | None = None
    pow2: bool = False
    eps: float = 1e-12

    @property
    def layout(self):
        return _layout.PerTensor() if self.axis is None else _layout.AlongAxis(self.axis)

    def aim(self, contracted, free=None):
        """Axiswise scales reduce over the contracted axis (one scale per row of the GEMM)."""
        del free
        return self if self.axis is None else self.replace(axis=contracted)

    def reciprocal_scale(self, amax):
        """``r`` for each block from its ``amax`` (float32)."""
        # max_value is an operand, not a folded constant: XLA may not rewrite this division.
        r = jnp.asarray(self.max_value, jnp.float32) / jnp.maximum(amax, np.float32(self.eps))
        if self.pow2:
            # torchao's exp2(floor(log2(r))) with a float32 log2, whose rounding can reach the next
            # integer just below a power of two (the scale is then that power, and the largest
            # element saturates): reproduced with the same rounding, not with the exact exponent.
            r = _bits.pow2(jnp.clip(jnp.floor(_bits.log2_f32(r)).astype(jnp.int32), -126, 127))
        return r

    def quantize(self, x):
        data, r = encode_times_reciprocal(self, x)
        # the block grid keeps the input's rank, (1, ..., 1) per tensor; the layout's scale shape is ()
        return data, _layout.reshape(r, self.scale_shape(data.shape))

    def decode(self, data):
        return self.element.decode(data)

    def scale_values(self, scale):
        return np.float32(1) / jnp.asarray(scale, jnp.float32)

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``decode(data) / r``: a division, as torchao applies its scale."""
        elems = self.decode(data)
        block = self.block_shape(elems.shape)
        # A true division: XLA would turn a division by a broadcast scale into a multiply.
        return div(elems, _layout.expand(jnp.asarray(scale, jnp.float32), elems.shape, block)).astype(dtype)


FP8_E4M3_TENSORWISE = ReciprocalScaleFloat8("fp8_e4m3_tensorwise", _elements.FLOAT8_E4M3FN)
FP8_E5M2_TENSORWISE = ReciprocalScaleFloat8("fp8_e5m2_tensorwise", _elements.FLOAT8_E5M2)
FP8_E4M3_ROWWISE = ReciprocalScaleFloat8("fp8_e4m3_rowwise", _elements.FLOAT8_E4M3FN, axis=-1, pow2=True)
FP8_E5M2_ROWWISE = ReciprocalScaleFloat8("fp8_e5m2_rowwise", _elements.FLOAT8_E5M2, axis=-1, pow2=True)
