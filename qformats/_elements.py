"""Element codecs: how a float32 value (already divided by its scale) becomes low-precision data.

Two final codecs:

* :class:`FloatElement` -- a sign/exponent/mantissa minifloat (fp16, bf16, fp8 e4m3/e5m2,
  fp6 e2m3/e3m2, fp4 e2m1). Rounding is to nearest, ties to even, and values beyond the element
  maximum saturate to it. The sub-16-bit ones are encoded with integer operations on the float32
  bits (exact, and faster on CPU than XLA's converts), producing one code per ``uint8``.
* :class:`IntElement` -- a symmetric integer grid ``code * step`` (int8, MXINT8's 2^-6 step).
"""

from __future__ import annotations

import math

import attrs
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from qformats import _bits, _random
from qformats._bits import F32_ABS_MASK, F32_BIAS, F32_EXP_MASK, F32_MANT_BITS, bits_f32, f32_bits


@attrs.frozen
class FloatElement:
    """A minifloat element type.

    Attributes:
        name: spec name, e.g. ``"float8_e4m3fn"``.
        ebits, mbits: exponent and mantissa widths; ``bias = 2**(ebits-1) - 1``.
        max_value: largest finite magnitude (the saturation bound).
        dtype: the JAX/ml_dtypes type that holds one element, or ``None`` when XLA has no such
            type (fp6): then data are ``uint8`` codes.
        nan_code: the code (sign bit clear) a NaN input encodes to, or ``None`` if the type has no
            NaN (NaN inputs then encode to the saturated maximum; their block scale is NaN).
        native: encode/decode with XLA's own converts (fp16/bf16) instead of bit operations.
    """

    name: str
    ebits: int
    mbits: int
    max_value: float
    dtype: object = None
    nan_code: int | None = None
    native: bool = False

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emax(self) -> int:
        """``floor(log2(max_value))``: the exponent the OCP MX scale rule subtracts."""
        return math.floor(math.log2(self.max_value))

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number, ``1 - bias``."""
        return 1 - self.bias

    @property
    def smallest_normal(self) -> float:
        return 2.0**self.emin

    @property
    def step(self) -> float:
        """Spacing of the grid just below 1.0 (``2**-mbits``): relative precision of the format."""
        return 2.0**-self.mbits

    @property
    def storage_dtype(self):
        return jnp.dtype(self.dtype) if self.dtype is not None else jnp.dtype(jnp.uint8)

    @property
    def exact_dtype(self):
        """The narrowest of bfloat16 and float32 that holds every element value exactly."""
        return jnp.bfloat16 if self.mbits <= 7 and self.ebits <= 8 else jnp.float32

    def half_step(self, v):
        """Half the grid spacing at magnitude ``|v|`` (the worst round-to-nearest error)."""
        e = np.maximum(np.floor(np.log2(np.maximum(np.abs(v), 1e-300))), self.emin)
        return 2.0 ** (e - self.mbits - 1)

    # -- encode ---------------------------------------------------------------------------------
    def stochastic_round(self, v, key):
        """``v`` (float32) rounded stochastically to this type's grid, as float32 values.

        With ``a = min(|v|, max_value)`` and ``ulp = 2**(max(floor(log2 a), emin) - mbits)`` the
        grid spacing at ``a``, ``q = a / ulp`` is exact (a power-of-two scaling), and ``a`` rounds
        to ``floor(q) * ulp`` or ``(floor(q) + 1) * ulp`` with probabilities that make the result
        unbiased: up when a uniform ``u`` in ``[0, 1)`` (24 random bits, :mod:`qformats._random`)
        is below ``q - floor(q)``. Values on the grid
        (and 0, and the saturated maximum) are unchanged; NaN stays NaN. :meth:`encode` of the
        result is then exact.
        """
        v = jnp.asarray(v, jnp.float32)
        a = jnp.minimum(jnp.abs(v), np.float32(self.max_value))
        e = jnp.maximum(_bits.floor_log2(a), self.emin) - self.mbits
        q = _bits.mul_pow2(a, -e)
        low = jnp.floor(q)
        u = _random.uniform(key, v.shape)
        r = _bits.mul_pow2(low + (u < q - low).astype(jnp.float32), e)
        r = jnp.minimum(r, np.float32(self.max_value))
        return jnp.where(jnp.isnan(v), v, jnp.copysign(r, v))

    def encode(self, v, *, nan_free: bool = False):
        """Round float32 ``v`` to this type (nearest-even, saturating) and return its data.

        Data is ``self.dtype`` when it exists, else ``uint8`` codes (sign in bit ``bits - 1``).
        ``nan_free=True`` promises that ``v`` holds no NaN (the NaN test is then left out; the
        result is the same for every other input).
        """
        v = v.astype(jnp.float32)
        if self.native:
            return jnp.clip(v, -self.max_value, self.max_value).astype(self.dtype)
        codes = self.encode_codes(v, nan_free=nan_free)
        if self.dtype is not None and jnp.dtype(self.dtype).itemsize == 1 and self.bits == 8:
            return lax.bitcast_convert_type(codes, self.dtype)
        return codes

    def encode_codes(self, v, *, nan_free: bool = False):
        """Integer round-to-nearest-even of float32 ``v`` to ``uint8`` element codes.

        With ``a = min(|v|, max_value)`` (as bits; Inf saturates) and ``k`` the binade of the grid
        spacing, ``max(exponent(a), emin)``, adding the float ``c = 2**(k + 23 - mbits)`` rounds
        ``a`` to the grid exactly once (``a < 2c``, float32 round-to-nearest-even), leaving the
        number of grid steps in the low bits of ``a + c``. That count is the code for subnormals and
        the code less ``(k - emin) << mbits`` for normals (a carry into the next binade comes out
        right), so one float add replaces separate normal and subnormal paths. (Checked against the
        two-path formulation on all 2**32 float32 inputs for every sub-16-bit element.)
        """
        b = f32_bits(v)
        a = jnp.minimum(b & F32_ABS_MASK, int(np.float32(self.max_value).view(np.int32)))  # saturate
        shift = F32_MANT_BITS - self.mbits
        emin_bits = (self.emin + F32_BIAS) << F32_MANT_BITS
        k = jnp.maximum(a & F32_EXP_MASK, emin_bits)
        c = k + (shift << F32_MANT_BITS)
        steps = f32_bits(bits_f32(a) + bits_f32(c)) - k  # (a + c) - c in bits, plus k
        code = steps + (k >> shift) - ((shift << F32_MANT_BITS) + (emin_bits >> shift))
        if self.nan_code is not None and not nan_free:
            code = jnp.where((b & F32_ABS_MASK) > F32_EXP_MASK, self.nan_code, code)
        sign_bit = self.bits - 1
        code = code | ((b >> (31 - sign_bit)) & (1 << sign_bit))
        return code.astype(jnp.uint8)

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, data):
        """Float32 value of element data (``self.dtype`` or ``uint8`` codes)."""
        if data.dtype == jnp.uint8:
            return self.decode_codes(data)
        if data.dtype == jnp.float8_e4m3fn and self.bits == 8 and not self.native:
            # bit decoding is faster on CPU than XLA's float8 -> float32 convert (same values)
            return self.decode_codes(lax.bitcast_convert_type(data, jnp.uint8))
        if data.dtype == jnp.float8_e5m2 and not self.native:
            # E5M2 is the high byte of a float16, whose hardware convert to float32 is exact and
            # much faster than XLA's float8 convert. NaN codes are first made the one quiet NaN
            # that XLA's convert produces (0x7FC00000, with the sign), so the bits are identical.
            c = lax.bitcast_convert_type(data, jnp.uint8)
            c = jnp.where((c & 0x7F) > 0x7C, (c & 0x80) | 0x7E, c)
            return lax.bitcast_convert_type(c.astype(jnp.uint16) << 8, jnp.float16).astype(jnp.float32)
        return data.astype(jnp.float32)

    def decode_codes(self, codes):
        """Float32 value of ``uint8`` codes, built from bits (no gather).

        Covers types without Inf (fp4, fp6, e4m3fn); types that have a JAX dtype decode natively.
        """
        c = codes.astype(jnp.int32)
        e = (c >> self.mbits) & ((1 << self.ebits) - 1)
        m = c & ((1 << self.mbits) - 1)
        if self.bits == 6:
            # fp6 codes come out of a slices+stack unpack; this float-domain form fuses better there
            normal = bits_f32(((e - self.bias + F32_BIAS) << F32_MANT_BITS) | (m << (F32_MANT_BITS - self.mbits)))
            sub = m.astype(jnp.float32) * np.float32(2.0 ** (self.emin - self.mbits))
            mag = jnp.where(e == 0, sub, normal)
            if self.nan_code is not None:
                mag = jnp.where((c & ~(1 << (self.bits - 1))) == self.nan_code, jnp.float32(jnp.nan), mag)
            return jnp.where(((c >> (self.bits - 1)) & 1) == 1, -mag, mag)
        # normal: exponent and mantissa fields moved into place, exponent re-biased by one add
        mag_mask = (1 << (self.bits - 1)) - 1
        normal = ((c & mag_mask) << (F32_MANT_BITS - self.mbits)) + ((F32_BIAS - self.bias) << F32_MANT_BITS)
        sub = f32_bits(m.astype(jnp.float32) * np.float32(2.0 ** (self.emin - self.mbits)))
        mag = jnp.where(e == 0, sub, normal)
        if self.nan_code is not None:
            mag = jnp.where((c & mag_mask) == self.nan_code, 0x7FC00000, mag)
        return bits_f32(mag | ((c >> (self.bits - 1)) << 31))


@attrs.frozen
class IntElement:
    """Symmetric integer element: ``value = code * step``, ``code`` in ``[-qmax, qmax]``.

    Rounding is to nearest, ties to even; values beyond ``qmax * step`` saturate.
    """

    name: str
    bits: int = 8
    step: float = 1.0
    qmax: int = 127

    @property
    def max_value(self) -> float:
        return self.qmax * self.step

    @property
    def smallest_normal(self) -> float:
        return self.step

    @property
    def emax(self) -> int:
        return math.floor(math.log2(self.max_value))

    @property
    def storage_dtype(self):
        return jnp.dtype(jnp.int8)

    @property
    def exact_dtype(self):
        """The narrowest of bfloat16 and float32 that holds every element value (``code * step``,
        ``step`` a power of two) exactly."""
        return jnp.bfloat16 if self.qmax < 256 and np.log2(self.step).is_integer() else jnp.float32

    def half_step(self, v):
        return np.full(np.shape(v), self.step / 2)

    def stochastic_round(self, v, key):
        """``v`` rounded stochastically (unbiased) to the grid ``code * step``, saturating at
        ``qmax * step``, as float32 values: up from ``floor(v / step)`` with probability equal to
        the remainder. NaN stays NaN (and then encodes to 0, as in :meth:`encode`)."""
        q = jnp.clip(jnp.asarray(v, jnp.float32) * np.float32(1.0 / self.step), -self.qmax, self.qmax)
        low = jnp.floor(q)
        u = _random.uniform(key, q.shape)
        return (low + (u < q - low).astype(jnp.float32)) * np.float32(self.step)

    def encode(self, v, *, nan_free: bool = False):
        """``clip(round_even(v / step), -qmax, qmax)`` as int8 (NaN encodes to 0).

        ``nan_free=True`` promises that ``v`` holds no NaN (the NaN test is then left out).
        """
        q = v.astype(jnp.float32) * np.float32(1.0 / self.step)
        # Round to an integer with one float add: in [2**23, 2**24) float32 steps are 1, so
        # q + 1.5 * 2**23 rounds q to nearest even exactly for |q| < 2**22, and the bits of the sum
        # less those of 1.5 * 2**23 are round(q). Clamping the bits to within qmax of those of
        # 1.5 * 2**23 saturates everything else the way clip would (sums beyond 2**24 and +Inf
        # have larger bits, sums below 2**23, negative ones and -Inf smaller). This replaces
        # XLA's NaN-propagating float min/max and its saturating float -> int8 convert.
        magic = int(np.float32(1.5 * 2**23).view(np.int32))
        n = jnp.clip(f32_bits(q + np.float32(1.5 * 2**23)), magic - self.qmax, magic + self.qmax) - magic
        if not nan_free:
            n = jnp.where(jnp.isnan(q), 0, n)
        return n.astype(jnp.int8)

    def decode(self, data):
        return data.astype(jnp.float32) * np.float32(self.step)


FLOAT16 = FloatElement("float16", 5, 10, 65504.0, jnp.float16, native=True)
BFLOAT16 = FloatElement("bfloat16", 8, 7, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), jnp.bfloat16, native=True)
FLOAT8_E4M3FN = FloatElement("float8_e4m3fn", 4, 3, 448.0, jnp.float8_e4m3fn, nan_code=0x7F)
FLOAT8_E5M2 = FloatElement("float8_e5m2", 5, 2, 57344.0, jnp.float8_e5m2, nan_code=0x7F)
FLOAT6_E2M3FN = FloatElement("float6_e2m3fn", 2, 3, 7.5)
FLOAT6_E3M2FN = FloatElement("float6_e3m2fn", 3, 2, 28.0)
FLOAT4_E2M1FN = FloatElement("float4_e2m1fn", 2, 1, 6.0)
INT8 = IntElement("int8")
MXINT8_ELEMENT = IntElement("mxint8", step=2.0**-6)
