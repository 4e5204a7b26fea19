"""Powers of two: the scales scalify builds, rounds and moves are powers of two, so moving one
between data and scale is exact. Traced helpers work on the float32 bits (no ``log2``, no
division); the ``_np`` ones take Python floats at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify._config import _STACK, Pow2RoundMode, get_config

_EXP_MASK = np.int32(0x7F800000)
_MANT_MASK = np.int32(0x007FFFFF)


def pow2_round_down(x):
    """Largest power of two <= ``x`` (positive normal float32), with integer ops on the bits."""
    x = jnp.asarray(x, jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return lax.bitcast_convert_type(bits & _EXP_MASK, jnp.float32)


def pow2_round_up(x):
    """Smallest power of two >= ``x`` (positive normal float32)."""
    x = jnp.asarray(x, jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    exact = (bits & _MANT_MASK) == 0
    up = (bits & _EXP_MASK) + np.int32(1 << 23)
    return lax.bitcast_convert_type(lax.select(exact, bits, up), jnp.float32)


def pow2_round(x, mode: Pow2RoundMode | None = None):
    """Round a positive scale ``x`` to a power of two following ``mode`` (default: the config's)."""
    if mode is None:
        mode = get_config().rounding_mode
    if mode == Pow2RoundMode.NONE:
        return jnp.asarray(x, jnp.float32)
    if mode == Pow2RoundMode.DOWN:
        return pow2_round_down(x)
    if mode == Pow2RoundMode.UP:
        return pow2_round_up(x)
    if mode == Pow2RoundMode.STOCHASTIC:
        x = jnp.asarray(x, jnp.float32)
        cfg = get_config()
        _STACK.counter += 1
        key = jax.random.fold_in(jax.random.key(cfg.stochastic_seed), _STACK.counter)
        down = pow2_round_down(x)
        p = x / down - 1.0  # in [0, 1): linear position between down and 2 * down
        u = jax.random.uniform(key, jnp.shape(x), jnp.float32)
        return jnp.where(u < p, down * 2.0, down)
    raise ValueError(f"Unknown Pow2RoundMode {mode!r}")


def pow2_round_np(x: float, mode: Pow2RoundMode | None = None) -> float:
    """Static (numpy) version of :func:`pow2_round` for Python scalars; STOCHASTIC rounds down."""
    if mode is None:
        mode = get_config().rounding_mode
    x = float(x)
    if mode == Pow2RoundMode.NONE or x == 0.0 or not np.isfinite(x):
        return x
    m, e = np.frexp(abs(x))  # abs(x) = m * 2**e, m in [0.5, 1)
    down = float(np.ldexp(1.0, int(e) - 1))
    if mode == Pow2RoundMode.UP and m != 0.5:
        return down * 2.0
    return down


def pow2_ceil_np(x: float) -> float:
    """Smallest power of two >= ``x`` (a Python float)."""
    return pow2_round_np(x, Pow2RoundMode.UP)


def pow2_floor_np(v: float) -> float:
    """Largest power of two <= ``v`` (a Python float); 1 for zero, negative or non-finite ``v``."""
    v = float(v)
    if not np.isfinite(v) or v <= 0:
        return 1.0
    return float(2.0 ** np.floor(np.log2(v)))


def is_pow2(v: float) -> bool:
    """Whether the Python float ``v`` is plus or minus a power of two."""
    return np.frexp(abs(v))[0] == 0.5


def mul_pow2_bits(x, e: int):
    """``x * 2^e`` for float32 ``x`` and a static integer ``e``, on the exponent field.

    Normal results are exact; results below the normal range are signed zeros (as XLA's flush of
    subnormals gives), above it signed infinities; zeros, subnormal inputs (read as zero on CPU),
    infinities and NaN keep their class.
    """
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
    field = lax.bitwise_and(lax.shift_right_logical(bits, np.int32(23)), np.int32(0xFF))
    sign = lax.bitwise_and(bits, np.int32(-(2**31)))
    new = field + np.int32(e)
    shifted = bits + np.int32(e * 2**23)
    inf = lax.bitwise_or(sign, np.int32(0x7F800000))
    out = lax.select(new >= 255, inf, shifted)
    out = lax.select(new <= 0, sign, out)
    out = lax.select((field == 0) | (field == 255), lax.select(field == 0, sign, bits), out)
    return lax.bitcast_convert_type(out, jnp.float32)
