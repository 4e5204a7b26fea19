"""OCP Microscaling (MX) formats: blocks of 32 elements share one E8M0 power-of-two scale."""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import jax.numpy as jnp
import numpy as np
from jax import lax

from qformats import _bits, _layout, _packing
from qformats._fmt_common import div
from qformats._format import ScaledFormat

SCALE_MODES = ("floor", "ceil", "even", "rceil", "rceil_log2")
E8M0_NAN = 255


def _check_mode(instance, attribute, value):
    if value not in SCALE_MODES:
        raise ValueError(f"scale_mode={value!r} is not an MX scale mode; choose one of {SCALE_MODES}")


def even_mbits(element) -> int:
    """Mantissa width that the ``even`` scale mode rounds a block's amax to.

    A float element's own ``mbits``; for an integer element ``code * step`` the number of fraction
    bits of its grid in the top binade ``[2**emax, 2**(emax+1))``, ``emax - log2(step)`` (MXINT8:
    6, the grid ``k / 64`` on ``[1, 2)``).
    """
    mbits = getattr(element, "mbits", None)
    if mbits is not None:
        return int(mbits)
    step = getattr(element, "step", None)
    if step is not None and math.log2(step).is_integer():
        return int(element.emax - math.log2(step))
    raise ValueError(
        f"scale_mode='even' rounds the block amax to the element's mantissa width, but element "
        f"{getattr(element, 'name', element)!r} has neither an 'mbits' field nor a power-of-two 'step'; "
        f"use another scale mode."
    )


def e8m0_exponent(amax, element, mode: str):
    """Unbiased E8M0 scale exponent of each block from its ``amax`` (float32, >= 0).

    * ``floor`` (OCP MX spec): ``floor(log2(amax)) - emax``;
    * ``ceil``: ``ceil(log2(amax)) - emax``;
    * ``even``: ``amax`` first rounded (nearest-even) to the element's mantissa width (see
      :func:`even_mbits`), then floor; as in torchao, a block whose rounded ``amax`` overflows
      float32 gets a NaN scale;
    * ``rceil`` (NVIDIA): ``ceil(log2(amax / max_value))``, so the block never saturates; computed
      exactly, without forming the quotient (which is a float32 subnormal for a block max below
      ``max_value * 2**-126``, and XLA on CPU flushes those to zero);
    * ``rceil_log2``: ``rceil`` with the logarithm rounded to float32 before the ``ceil``, as torchao
      computes it (``torch.ceil(torch.log2(amax / max_value))``): just above a power of two the
      rounded logarithm is that power's exponent, so the scale is one step smaller than ``rceil``'s
      and the block's largest element saturates. Where the quotient is below float32's smallest
      normal, the exact ``rceil`` exponent is used (torch keeps the subnormal quotient).

    Clamped to E8M0's range ``[-127, 127]``; computed from the float32 bits. Returns
    ``(exponent, overflow)`` where ``overflow`` marks blocks whose scale must be NaN.
    """
    overflow = jnp.zeros(amax.shape, bool)
    if mode == "rceil":
        e = _bits.rceil_exponent(amax, element.max_value)
    elif mode == "rceil_log2":
        # The quotient is formed only where it is normal: amax >= max_value * tiny.
        normal = amax >= np.float32(element.max_value * np.finfo(np.float32).tiny)
        # A true division (div), as torch computes it: XLA would multiply by the reciprocal, and
        # one ulp moves ceil(log2) just above a power of two.
        ratio = div(jnp.where(normal, amax, np.float32(element.max_value)), element.max_value)
        e = jnp.where(
            normal, jnp.ceil(_bits.log2_f32(ratio)).astype(jnp.int32), _bits.rceil_exponent(amax, element.max_value)
        )
    else:
        if mode == "floor":
            e = _bits.floor_log2(amax)
        elif mode == "ceil":
            e = _bits.ceil_log2(amax)
        else:  # even
            mbits = even_mbits(element)
            b = _bits.f32_bits(amax)
            b = (b + (1 << (_bits.F32_MANT_BITS - mbits - 1))) & _bits.F32_EXP_MASK
            overflow = b == _bits.F32_EXP_MASK
            e = (b >> _bits.F32_MANT_BITS) - _bits.F32_BIAS
        e = e - element.emax
    return jnp.clip(e, -127, 127), overflow


def e8m0_to_f32(byte):
    """``2**(byte - 127)`` as float32 (byte 0 is the subnormal ``2**-127``; 255 is NaN)."""
    b = byte.astype(jnp.int32)
    f = _bits.bits_f32(jnp.where(b == 0, 0x00400000, b << _bits.F32_MANT_BITS))
    return jnp.where(b == E8M0_NAN, np.float32(np.nan), f)


# Element types ``jax.nn.scaled_matmul`` takes (cuDNN's block-scaled GEMMs on Blackwell).
_SCALED_MATMUL_ELEMENTS = {
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "float4_e2m1fn": jnp.float4_e2m1fn,
}


@attrs.frozen
class MXFormat(ScaledFormat):
    """An OCP MX format: ``value = element(data) * 2**(scale_byte - 127)`` per block.

    Elements round to nearest even and saturate at ``element.max_value``; a NaN or Inf anywhere in
    a block makes the block's scale NaN (byte 255). The scale array holds one
    ``float8_e8m0fnu`` per block. With ``packed=True`` sub-byte elements are packed along ``axis``
    (fp4: 2 per byte, fp6: 4 per 3 bytes); otherwise data are one code per byte (``uint8``) or the
    element's own dtype for 8-bit floats.

    ``saturate_top`` chooses what happens at the top of float32's range, for blocks of finite
    values whose amax is near ``FLT_MAX``:

    * ``False`` (default, torchao's results bit for bit): ``ceil``, ``rceil`` and ``rceil_log2`` may
      pick an exponent ``e`` with ``max_value * 2**e`` beyond ``FLT_MAX``, so the block's largest
      elements dequantize to ``inf``; ``even`` gives the block a NaN scale when its rounded amax
      overflows float32.
    * ``True`` (the OCP spec's guarantee that finite input gives a finite scale and finite values):
      the exponent is capped at ``127 - emax``, the largest with ``max_value * 2**e`` finite (the
      ``floor`` rule never exceeds it), so such blocks saturate at ``max_value * 2**(127 - emax)``.
      ``floor`` results are unchanged.
    """

    axis_fields: ClassVar[tuple[str, ...]] = ("axis",)
    local_scales: ClassVar[bool] = True

    name: str
    element: object
    axis: int = -1
    block_size: int = 32
    scale_mode: str = attrs.field(default="floor", validator=_check_mode)
    packed: bool = True
    saturate_top: bool = False

    @property
    def layout(self):
        return _layout.Blocked(self.axis, self.block_size)

    @property
    def _packs(self) -> bool:
        return self.packed and self.element.bits < 8

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        fast_amax = _layout.fast_block_max(x, block)
        if fast_amax is None:  # the exact block max is as fast here (see block_amax)
            data, byte = self._encode(x, block, _layout.block_amax(x, block, exact=True))
            data = self._pack(data)
        else:
            data, byte = self._encode_fast(x, block, fast_amax)
        return data, lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)

    def aim(self, contracted, free=None):
        """Blocks along the contracted axis (each block's scale factors out of the partial sums)."""
        del free
        return self.replace(axis=contracted)

    def quantize_stochastic(self, x, key):
        """:meth:`quantize` with the scaled elements rounded stochastically (same E8M0 scales)."""
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        data, byte = self._encode(x, block, _layout.block_amax(x, block, exact=True), key=key)
        return self._pack(data), lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)

    def _pack(self, codes, materialized: bool = False):
        if not self._packs:
            return codes
        return _packing.pack(codes, self.element.bits, self.axis % codes.ndim, materialized=materialized)

    def _scale(self, amax):
        """``(e, byte)``: each block's exponent and its E8M0 byte (255, NaN, for non-finite blocks)."""
        e, overflow = e8m0_exponent(amax, self.element, self.scale_mode)
        if self.saturate_top:
            e = jnp.minimum(e, 127 - self.element.emax)
            overflow = jnp.zeros_like(overflow)
        nonfinite = ~(amax <= np.finfo(np.float32).max) | overflow
        return e, jnp.where(nonfinite, E8M0_NAN, e + 127).astype(jnp.uint8)

    def _encode(self, x, block, amax, key=None):
        """Unpacked element data and scale bytes from the exact block max; with a PRNG ``key`` the
        scaled elements round stochastically instead of to nearest."""
        e, byte = self._scale(amax)
        # Block scales are applied as x * 2**-e, split so no factor is subnormal.
        inv_head, inv_tail = _bits.pow2_split(-e)
        v = x * _layout.expand(inv_head, x.shape, block) * _layout.expand(inv_tail, x.shape, block)
        if key is not None:
            v = self.element.stochastic_round(v, key)
        return self.element.encode(v), byte

    def _amax(self, x, block, fast_amax=None, nan=None):
        """The block maxima, with the scales of the exact block max (see :meth:`_encode_fast`): the
        NaN-blind float reduction where it gives them, else the exact integer one."""
        if fast_amax is None:
            fast_amax = _layout.fast_block_max(x, block)
            if fast_amax is None:
                return _layout.block_amax(x, block, exact=True)
        need_exact = _layout.has_nan(x) if nan is None else nan
        if self.scale_mode in ("ceil", "even"):
            need_exact = need_exact | jnp.any(fast_amax < np.float32(np.finfo(np.float32).tiny))
        return lax.cond(need_exact, lambda x, a: _layout.block_amax(x, block, exact=True), lambda x, a: a, x, fast_amax)

    def _encode_fast(self, x, block, fast_amax):
        """:meth:`_encode`, with the block max from the NaN-blind float reduction where possible.

        The exact integer block max replaces the float one when ``x`` holds a NaN (the float max
        drops it) and, for ``ceil``/``even`` (which read the mantissa of a subnormal block max),
        when a block max is below the smallest normal; ``floor``/``rceil``/``rceil_log2`` depend on
        a subnormal or zero block max only through its exponent field (0 either way) and through
        a product with the subnormal as a factor, which XLA on CPU reads as zero anyway, so the
        scales equal those of the exact block max.

        The element loop runs inside a second ``cond``: its fast branch, taken when ``x`` holds no
        NaN and every ``e < 127`` (so the scale is one normal power of two), leaves out the NaN
        test and the second scale factor; the other branch is :meth:`_encode`'s loop. Both give the
        same bits. Being ``cond`` operands, the per-block factors are written out once instead of
        being re-derived inside the element loop.
        """
        nan = _layout.has_nan(x)
        amax = self._amax(x, block, fast_amax, nan)
        e, byte = self._scale(amax)
        inv_head, inv_tail = _bits.pow2_split(-e)
        # fp4 pairs are packed inside the element loop; fp6 codes leave the cond unpacked, so
        # that they are written out, and are packed from memory (see _packing.pack).
        pack_inside = self.element.bits != 6

        def general(x, inv_head, inv_tail):
            v = x * _layout.expand(inv_head, x.shape, block) * _layout.expand(inv_tail, x.shape, block)
            data = self.element.encode(v)
            return self._pack(data) if pack_inside else data

        def fast(x, inv_head, inv_tail):
            data = self.element.encode(x * _layout.expand(inv_head, x.shape, block), nan_free=True)
            return self._pack(data) if pack_inside else data

        data = lax.cond(nan | jnp.any(e >= 127), general, fast, x, inv_head, inv_tail)
        return (data if pack_inside else self._pack(data, materialized=True)), byte

    def decode(self, data):
        if self._packs:
            data = _packing.unpack(data, self.element.bits, self.axis % data.ndim)
        return self.element.decode(data)

    def scale_values(self, scale):
        return e8m0_to_f32(lax.bitcast_convert_type(scale, jnp.uint8))

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``decode(data) * 2**(byte - 127)``, applied without a subnormal multiplier (see :meth:`_scaled`)."""
        if self._packs:
            data = _packing.unpack(data, self.element.bits, self.axis % data.ndim)
        return self._scaled(data, lax.bitcast_convert_type(scale, jnp.uint8), dtype)

    def fake_quantize(self, x, key=None):
        """``dequantize(*quantize(x))`` (with ``key``: of :meth:`quantize_stochastic`) in one element
        loop: the codes are decoded where they are made, never packed or written out."""
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        codes, byte = self._encode(x, block, self._amax(x, block), key=key)
        return self._scaled(codes, byte)

    def _scaled(self, codes, byte, dtype=jnp.float32):
        """Values of unpacked element ``codes`` under the E8M0 scale bytes ``byte``.

        Integer elements ``code * step`` (``step`` a power of two, MXINT8's ``2**-6``) are applied
        as ``code * 2**(byte - 127 + log2(step))``: XLA folds a constant ``step`` into the block
        factor, which is then a subnormal (read as zero) at the bottom of the E8M0 range.
        """
        step = getattr(self.element, "step", None) if not hasattr(self.element, "mbits") else None
        if step is not None and math.log2(step).is_integer():
            elems, shift = codes.astype(jnp.float32), int(math.log2(step))
        else:
            elems, shift = self.element.decode(codes), 0
        block = self.block_shape(elems.shape)
        b = byte.astype(jnp.int32)
        if shift:
            head, tail = _bits.pow2_split_wide(jnp.minimum(b, E8M0_NAN - 1) - 127 + shift)
        else:
            head, tail = _bits.pow2_split(jnp.minimum(b, E8M0_NAN - 1) - 127)
        head = jnp.where(b == E8M0_NAN, np.float32(np.nan), head)
        out = elems * _layout.expand(head, elems.shape, block) * _layout.expand(tail, elems.shape, block)
        return out.astype(dtype)

    def factored(self, data, scale):
        """Dequantized values, exact in bfloat16 (element times a power of two), factor 1."""
        return self.dequantize(data, scale, self.element.exact_dtype), np.ones((), np.float32)

    def block_scaled(self, data, scale):
        """FP8 (E4M3, E5M2) and FP4 elements with their E8M0 block scales; FP6 and INT8 have no
        ``scaled_matmul`` element type."""
        dtype = _SCALED_MATMUL_ELEMENTS.get(self.element.name)
        if dtype is None or scale.dtype != jnp.float8_e8m0fnu:  # E8M0 scales with NaN at 255 only
            return None
        elements = data if data.dtype == dtype else self.decode(data).astype(dtype)
        return elements, scale, np.ones((), np.float32)

    def data_shape(self, shape):
        return _packing.packed_shape(shape, self.element.bits, self.axis) if self._packs else tuple(shape)

    def value_shape(self, data_shape):
        return _packing.unpacked_shape(data_shape, self.element.bits, self.axis) if self._packs else tuple(data_shape)
