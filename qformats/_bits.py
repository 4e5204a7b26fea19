"""Float32 bit tricks shared by the codecs.

XLA on CPU flushes float32 subnormals in arithmetic, and ``log2``/``exp2``/division are slow, so
every power of two in the hot path is built from its exponent field with integer operations, and
no scale is ever applied by dividing by (or multiplying with) a subnormal power of two.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

F32_MANT_BITS = 23
F32_BIAS = 127
F32_EXP_MASK = 0x7F800000
F32_MANT_MASK = 0x007FFFFF
F32_ABS_MASK = 0x7FFFFFFF


def f32_bits(x):
    """Bit pattern of a float32 array as int32."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def round_to(x, dtype):
    """Float32 ``x`` rounded to ``dtype`` (float32, bfloat16 or float16; nearest, ties to even,
    subnormals and overflow included) and returned as float32, as ``x.astype(dtype).astype(f32)``.

    Not written as that round trip: XLA may drop it (``xla_allow_excess_precision``, on by default),
    and on CPU its reduction fusions do, so a rounding a torch producer performs in bfloat16 would be
    skipped in some programs and not in others. ``reduce_precision`` is kept; it rounds float16's
    subnormals differently, so those (``|x| < 2**-14``, a grid of ``2**-24``) round on their own.
    """
    x = jnp.asarray(x, jnp.float32)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x
    if dtype == jnp.bfloat16:
        return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    if dtype == jnp.float16:
        sub = jnp.round(x * np.float32(2.0**24)) * np.float32(2.0**-24)
        normal = lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)
        return jnp.where(jnp.abs(x) < np.float32(2.0**-14), sub, normal)
    raise ValueError(f"round_to: dtype {dtype} is not float32, bfloat16 or float16")


def bits_f32(b):
    """Float32 array whose bit pattern is the int32 array ``b``."""
    return lax.bitcast_convert_type(b.astype(jnp.int32), jnp.float32)


def exponent_field(x):
    """Biased float32 exponent field of ``x`` (0 for zero/subnormal, 255 for Inf/NaN)."""
    return (f32_bits(x) >> F32_MANT_BITS) & 0xFF


def floor_log2(x):
    """``floor(log2(|x|))`` for normal ``x``; -127 for zero and subnormals."""
    return exponent_field(x) - F32_BIAS


def ceil_log2(x):
    """``ceil(log2(|x|))`` for normal ``x``: floor plus one unless ``|x|`` is a power of two."""
    b = f32_bits(x)
    return floor_log2(x) + ((b & F32_MANT_MASK) != 0).astype(jnp.int32)


def pow2(e):
    """``2**e`` as float32 for integer ``e`` in [-126, 127] (normal range), built from bits."""
    return bits_f32((e + F32_BIAS) << F32_MANT_BITS)


def pow2_split(e):
    """``(head, tail)`` with ``head * tail == 2**e`` for integer ``e`` in [-127, 127], both normal.

    ``2**-127`` is subnormal and reads as zero on CPU, so that one case is split as
    ``2**-126 * 0.5``; applying ``(x * head) * tail`` is exact wherever the result is normal.
    """
    e = jnp.asarray(e, jnp.int32)
    return pow2(jnp.maximum(e, -126)), jnp.where(e < -126, jnp.float32(0.5), jnp.float32(1.0))


def pow2_split_wide(e):
    """``(head, tail)``, both normal, with ``head * tail == 2**e`` for integer ``e`` in [-252, 254]."""
    e = jnp.asarray(e, jnp.int32)
    head = jnp.clip(e, -126, 127)
    return pow2(head), pow2(e - head)


def mul_pow2(x, e):
    """``x * 2**e`` for integer ``e`` in [-127, 127] without a subnormal multiplier."""
    head, tail = pow2_split(e)
    return x * head * tail


def rceil_exponent(amax, max_value: float):
    """Smallest integer ``e`` with ``amax * 2**-e <= max_value`` (``ceil(log2(amax / max_value))``),
    for normal ``amax``, without a division.

    Start from ``floor(log2(amax)) - floor(log2(max_value))``; the scaled amax then lies in
    ``[2**emax, 2**(emax+1))`` and one exact comparison decides whether to step up. No quotient is
    formed, so nothing is lost when ``amax / max_value`` would be a float32 subnormal (which XLA on
    CPU flushes to zero). Zero and subnormal ``amax`` give ``-127 - emax`` or less; callers clamp.
    """
    emax = math.floor(math.log2(max_value))
    e = floor_log2(amax) - emax
    scaled = mul_pow2(amax, jnp.clip(-e, -127, 127))
    return e + (scaled > np.float32(max_value)).astype(jnp.int32)


def log2_f32(x):
    """``log2(x)`` for positive normal float32 ``x``, rounded to float32 as a correctly rounded
    ``log2f`` rounds it (what ``torch.log2`` returns at the points that matter below).

    ``floor``/``ceil`` of a float32 ``log2`` is how torchao derives power-of-two scales; near a
    power of two ``2**k`` the rounded logarithm lands exactly on ``k`` when ``|log2 x - k|`` is
    below half a float32 ulp of ``k``, so it differs from the exact exponent there. To reproduce
    that rounding, ``x = 2**e * m`` with ``m`` in ``[sqrt(1/2), sqrt(2))`` and the float32 sum
    ``e + log2(m)`` is formed: ``log2(m)`` is small and accurate, so the one rounding of the sum is
    the rounding of the exact logarithm.
    """
    b = f32_bits(x)
    # e such that m = x / 2**e lies in [sqrt(1/2), sqrt(2)): bump the exponent when the mantissa
    # is at least sqrt(2) (0x3504F3 is the mantissa field of sqrt(2) rounded up).
    e = ((b >> F32_MANT_BITS) & 0xFF) - F32_BIAS + ((b & F32_MANT_MASK) >= 0x3504F3).astype(jnp.int32)
    m = bits_f32((b & F32_MANT_MASK) | ((F32_BIAS - (e - floor_log2(x))) << F32_MANT_BITS))
    return e.astype(jnp.float32) + jnp.log2(m)


def round_quotient(a, b, q):
    """The correctly rounded float32 quotient ``a / b`` (IEEE round to nearest even, subnormal and
    overflowing quotients included) for normal ``a`` and ``b``, given any float32 ``q`` within 2
    units in the last place of it (counted in ``q``'s own binade: where that is the binade above the
    quotient's, up to 4.5 of the quotient's units); where ``a`` or ``b`` is zero, subnormal, Inf or
    NaN, ``q``.

    XLA divides float32 on CPU as IEEE does, but not everywhere: on NVIDIA GPUs it emits PTX
    ``div.full.f32``, specified to within 2 ulps; a quotient on an exact rounding tie of a coarser
    grid (FP4, int8, E4M3) then rounds to either side of it. This repairs ``q`` with integer
    arithmetic only, so no float operation (contracted, flushed or approximated) can move it again.

    With ``|a| = A 2**ea``, ``|b| = B 2**eb`` (``A``, ``B`` in ``[2**23, 2**24)``) the result's ulp
    is ``2**e``, ``e = max(ea - eb - 23 - [A < B], -149)``, and ``|a / b| = u 2**e`` with
    ``2uB = A 2**s``, ``s = ea - eb - e + 1 <= 25``. ``q``'s significand, shifted to the ulp
    ``2**e``, is an integer ``n0`` within 5 of ``u``, so ``D = A 2**s - (2 n0 + 1) B = 2B (u - n0 -
    1/2)`` lies in ``[-11B, 9B]`` and is exact in wrapped 32-bit arithmetic. ``round(u) = n0 + 1 +
    floor(D / 2B)``, a tie (``D`` a multiple of ``2B``) to the even one. ``u < 1/4`` (``s < 0``)
    rounds to zero, and a biased exponent above 254 is Inf.
    """
    a, b, q = (jnp.asarray(v, jnp.float32) for v in (a, b, q))
    ab, bb, qb = f32_bits(a), f32_bits(b), f32_bits(q) & F32_ABS_MASK
    field_a, field_b, field_q = ((v >> F32_MANT_BITS) & 0xFF for v in (ab, bb, qb))
    sig_a, sig_b, sig_q = ((v & F32_MANT_MASK) | (1 << F32_MANT_BITS) for v in (ab, bb, qb))
    sig_q = jnp.where(field_q > 0, sig_q, qb)  # a subnormal guess has no implicit bit
    below = (sig_a < sig_b).astype(jnp.int32)
    # the result's biased exponent field, where the result is normal; subnormal results share 1
    field = field_a - field_b + F32_BIAS - below
    ulp_field = jnp.maximum(field, 1)
    s = F32_MANT_BITS + 1 + below - (ulp_field - field)
    # q's significand at the ulp 2**e: one bit either way when q lies in a neighbouring binade
    n0 = (sig_q << ((jnp.maximum(field_q, 1) - ulp_field).clip(-1, 1) + 1)) >> 1
    u32 = jnp.uint32
    d = (sig_a.astype(u32) << s.clip(0, 31).astype(u32)) - (2 * n0 + 1).astype(u32) * sig_b.astype(u32)
    d = lax.bitcast_convert_type(d, jnp.int32)
    two_b = sig_b << 1
    k = sum((d >= j * two_b).astype(jnp.int32) for j in range(-5, 6)) - 5
    tie = d == (k - 1) * two_b
    n = n0 + k - (tie & ((n0 + k) & 1 == 1)).astype(jnp.int32)
    mag = ((ulp_field - 1) << F32_MANT_BITS) + n
    mag = jnp.where(s < 0, 0, jnp.where(field > 254, F32_EXP_MASK, jnp.minimum(mag, F32_EXP_MASK)))
    normal = ((field_a - 1).astype(u32) < 254) & ((field_b - 1).astype(u32) < 254)
    return jnp.where(normal, bits_f32(mag | ((ab ^ bb) & ~F32_ABS_MASK)), q)
