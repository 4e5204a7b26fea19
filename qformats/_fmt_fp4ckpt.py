"""FP4 (E2M1) formats as published checkpoints store them: NVFP4 (compressed-tensors, ModelOpt) and
MXFP4 (compressed-tensors, gpt-oss).

Both pack two E2M1 codes per byte along the last axis, element ``2j`` in the low nibble.

* :class:`NVFP4CheckpointFormat`: blocks of 16 with a float8_e4m3fn block scale ``s`` and a float32
  tensor scale ``g``. compressed-tensors stores ``g`` as a **divisor** (``weight_global_scale``):
  ``w = dtype(code * (f32(s) / g))``; ModelOpt stores a **multiplier** (``weight_scale_2``):
  ``w = dtype(code * (f32(s) * g))``. The per-block factor is rounded to float32 first, then the
  product, then the cast to the output dtype (round to nearest even), as both producers do. Code
  0x8 is -0.0 in compressed-tensors and +0.0 in ModelOpt (``negative_zero``).
* :class:`MXFP4CheckpointFormat`: blocks of 32 with an E8M0 byte ``e``: ``w = code * 2**(e - 127)``;
  byte 255 decodes to +inf (compressed-tensors and transformers compute ``2**(255 - 127)``, which
  overflows float32), not NaN as in the OCP MX built-ins.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import jax.numpy as jnp
import numpy as np
from jax import lax

from qformats import _bits, _elements, _layout, _packing
from qformats._fmt_common import div
from qformats._format import ScaledFormat
from qformats._mx import MXFormat, _check_mode
from qformats._nvfp4 import NVFP4Scale

_FP4 = _elements.FLOAT4_E2M1FN
_E4M3 = _elements.FLOAT8_E4M3FN
_GLOBAL_MODES = ("divisor", "multiplier")


def _check_global(instance, attribute, value):
    if value not in _GLOBAL_MODES:
        raise ValueError(f"global_scale={value!r}; choose one of {_GLOBAL_MODES}")


@attrs.frozen
class NVFP4CheckpointFormat(ScaledFormat):
    """NVFP4 as stored by compressed-tensors (``global_scale="divisor"``) or ModelOpt (``"multiplier"``).

    ``data``: uint8 ``[..., K/2]`` (low nibble first); ``scale``: :class:`qformats.NVFP4Scale` with
    ``block`` float8_e4m3fn ``[..., K/16]`` and ``tensor`` float32 ``()``.

    Decode: ``eff = f32(block) / tensor`` (divisor) or ``f32(block) * tensor`` (multiplier), each
    rounded to float32; ``w = dtype(fp4(code) * eff)``. ``out_dtype`` records the producer's output
    dtype (compressed-tensors: always bfloat16; ModelOpt: the model dtype).

    Quantize (the producers' recipe, in float32 from the input's values): ``amax = max|x|``;
    divisor (compressed-tensors): with ``r`` rounding to the input's dtype when it is 16-bit (torch
    computes in the model dtype), ``g = r(448 * 6 / amax)``, ``block = e4m3(clamp(r(block_amax / 6) * g,
    -448, 448))``, and a block code of zero becomes E4M3's epsilon 0.125; multiplier (ModelOpt):
    ``g = amax / (6 * 448)``, ``block = e4m3(clamp(block_amax / 6 / g, 2**-9, 448))``, 1.0 for an all-zero
    block; then ``code = fp4(x / eff)`` (nearest even, saturating). An all-zero tensor gets ``g = 1``.
    """

    axis_fields: ClassVar[tuple[str, ...]] = ("axis",)

    name: str = "ct_nvfp4"
    global_scale: str = attrs.field(default="divisor", validator=_check_global)
    negative_zero: bool = True
    out_dtype: str = "bfloat16"
    axis: int = -1
    block_size: int = 16
    packed: bool = True

    @property
    def element(self):
        return _FP4

    @property
    def layout(self):
        return _layout.Blocked(self.axis, self.block_size)

    def quantize(self, x):
        self.check_input(x)
        in_dtype = jnp.result_type(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        bmax = _layout.block_amax(x, block, exact=True)
        amax = jnp.max(bmax) if bmax.size else jnp.float32(0)
        finite = amax <= np.float32(np.finfo(np.float32).max)
        six, e4max = np.float32(_FP4.max_value), np.float32(_E4M3.max_value)
        if self.global_scale == "divisor":
            g = np.float32(e4max * six) / jnp.where(amax == 0, np.float32(1), amax)
            g = jnp.where(amax == 0, np.float32(1), g)
            wide = in_dtype if in_dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
            g = _bits.round_to(g, wide)
            bs = jnp.clip(_bits.round_to(div(bmax, six), wide) * g, -e4max, e4max)
            code = _E4M3.encode(bs)
            code = jnp.where(_E4M3.decode(code) == 0, _E4M3.encode(jnp.float32(0.125)), code)  # E4M3 eps
        else:
            g = jnp.where(amax == 0, np.float32(1), div(amax, six * e4max))
            bs = jnp.clip(div(div(bmax, six), g), np.float32(2.0**-9), e4max)
            code = _E4M3.encode(jnp.where(bmax == 0, np.float32(1), bs))
        g = jnp.where(finite, g, np.float32(np.nan))
        eff = self._effective(code, g)
        safe = jnp.where(eff == 0, np.float32(1), eff)
        data = _FP4.encode(div(x, _layout.expand(safe, x.shape, block)))
        if self.packed:
            data = _packing.pack(data, 4, self.axis % data.ndim)
        return data, NVFP4Scale(code, g)

    def _effective(self, block_code, tensor):
        """The per-block factor, rounded to float32 on its own.

        The barriers keep XLA from folding it into the element expression (it rewrites
        ``x / (b / g)`` as ``x * g / b``) and from turning a division by a constant ``g`` into a
        multiplication by its reciprocal; either rounds differently from the producers.
        """
        b, t = lax.optimization_barrier((_E4M3.decode(block_code), jnp.asarray(tensor, jnp.float32)))
        return lax.optimization_barrier(div(b, t) if self.global_scale == "divisor" else b * t)

    def decode(self, data):
        if self.packed:
            data = _packing.unpack(data, 4, self.axis % data.ndim)
        if not self.negative_zero:
            data = jnp.where(data == 8, jnp.uint8(0), data)
        return _FP4.decode(data)

    def scale_values(self, scale):
        return self._effective(scale.block, jnp.asarray(scale.tensor, jnp.float32))

    def data_shape(self, shape):
        return _packing.packed_shape(shape, 4, self.axis) if self.packed else tuple(shape)

    def value_shape(self, data_shape):
        return _packing.unpacked_shape(data_shape, 4, self.axis) if self.packed else tuple(data_shape)


@attrs.frozen
class MXFP4CheckpointFormat(MXFormat):
    """MXFP4 as compressed-tensors (``mxfp4-pack-quantized``) and gpt-oss store it.

    ``data`` uint8 ``[..., K/2]`` (low nibble first), ``scale`` uint8 E8M0 ``[..., K/32]``.
    ``w = dtype(fp4(code) * 2**(e - 127))``; ``e = 255`` gives ``code * inf`` (so 0 -> NaN, else
    +-inf), as the producers compute it. Quantize is the OCP MX ``floor`` rule
    (``e = floor(log2(block_amax)) - 2``), elements rounded to nearest even and saturated at 6.
    """

    name: str = "ct_mxfp4"
    element: object = _FP4
    scale_mode: str = attrs.field(default="even", validator=_check_mode)
    out_dtype: str = "bfloat16"

    def quantize(self, x):
        data, scale = super().quantize(x)
        return data, lax.bitcast_convert_type(scale, jnp.uint8)

    def scale_values(self, scale):
        b = (
            jnp.asarray(scale).astype(jnp.int32)
            if jnp.asarray(scale).dtype != jnp.float8_e8m0fnu
            else (lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32))
        )
        f = _bits.bits_f32(jnp.where(b == 0, 0x00400000, b << _bits.F32_MANT_BITS))
        return jnp.where(b == 255, np.float32(np.inf), f)

    def _scaled(self, codes, byte, dtype=jnp.float32):
        """``decode(codes) * 2**(e - 127)`` (255 -> inf), applied without a subnormal multiplier."""
        elems = self.element.decode(codes)
        block = self.block_shape(elems.shape)
        b = byte.astype(jnp.int32)
        head, tail = _bits.pow2_split(jnp.minimum(b, 254) - 127)
        head = jnp.where(b == 255, np.float32(np.inf), head)
        out = elems * _layout.expand(head, elems.shape, block) * _layout.expand(tail, elems.shape, block)
        return out.astype(dtype)
