"""Regressions found by the differential fuzzer (tests/scalify/test_fuzz.py), reduced to one rule each.

Each test compares ``scalify(f)(scaled)`` with ``f`` on the dequantized float32 inputs, eagerly and
under ``jax.jit``: no NaN / Inf where float32 is finite, values within the carrier's rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify as jsa

RNG = np.random.default_rng(0)
MODES = {"eager": lambda f: f, "jit": jax.jit}
RTOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 2.0**-9}


def _carrier(value, scale, dtype):
    """A carrier with exactly ``data = value / scale`` in ``dtype`` (no normalisation)."""
    data = (np.asarray(value, np.float32) / np.float32(scale)).astype(dtype)
    return jsa.ScaledArray(jnp.asarray(data), jnp.asarray(scale, jnp.float32))


def _deq(x):
    return np.asarray(x.to_array(jnp.float32) if isinstance(x, jsa.ScaledArray) else x, np.float32)


def _check(f, args, rtol):
    ref = np.asarray(f(*[jnp.asarray(_deq(a)) for a in args]), np.float32)  # float32 on the values
    finite = np.isfinite(ref)
    assert finite.any()
    for name, wrap in MODES.items():
        got = _deq(wrap(jsa.scalify(f))(*args))
        assert np.isfinite(got[finite]).all(), (name, int((~np.isfinite(got[finite])).sum()))
        np.testing.assert_allclose(
            got[finite], ref[finite], rtol=rtol, atol=rtol * np.abs(ref[finite]).max(), err_msg=name
        )
        np.testing.assert_array_equal(np.isnan(got[~finite]), np.isnan(ref[~finite]), err_msg=name)


# -- integer_pow / square of a carrier whose data magnitude is unknown ------------------------------


def test_gelu_of_unnormalised_float16_carrier():
    """gelu's ``x**3`` cubed float16 data 261 (scale 2^-15) to -inf: ``gelu`` returned -0.0 or NaN."""
    x = (RNG.uniform(-1, 1, (4, 32)) * 2.0**-7).astype(np.float32)
    sx = _carrier(x, 2.0**-15, np.float16)
    _check(jax.nn.gelu, (sx,), 4 * RTOL[np.dtype(np.float16)])


@pytest.mark.parametrize("fn", [lambda a: a**3, jnp.square, lambda a: a**-2], ids=["cube", "square", "inv_square"])
def test_power_of_carrier_with_huge_scale(fn):
    """Scale 2^100 with data ~2^-80: ``scale**n`` leaves float32 (Inf or 0) and ``data**n`` flushes
    or overflows: 0 * Inf = NaN."""
    x = (RNG.uniform(0.5, 1.0, (4, 32)) * 2.0**20).astype(np.float32)
    _check(fn, (_carrier(x, 2.0**100, np.float32),), 4e-6)


def test_inverse_square_of_small_float16_data():
    """``x**-2`` of float16 data 2^-10 is 2^20: beyond float16 (the power is now taken in float32)."""
    x = RNG.uniform(0.5, 1.0, (4, 32)).astype(np.float32)
    _check(lambda a: a**-2, (_carrier(x, 2.0**10, np.float16),), 4 * RTOL[np.dtype(np.float16)])


# -- a NaN block (or a NaN per-tensor scale) must not spread --------------------------------------------


def _nan_block(shape, fmt, row=0):
    x = RNG.standard_normal(shape).astype(np.float32) * 4
    x[row, 3] = np.nan
    return jsa.as_scaled_array(jnp.asarray(x), fmt=fmt)


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: jax.nn.softmax(a, axis=-1),
        lambda a: jnp.max(a, axis=-1),
        lambda a: jnp.sum(a, axis=-1),
        lambda a: (a - jnp.mean(a, -1, keepdims=True)) * jax.lax.rsqrt(jnp.var(a, -1, keepdims=True) + 1e-5),
    ],
    ids=["softmax", "max", "sum", "layer_norm"],
)
def test_nan_block_stays_in_its_row(fn):
    """MXFP8 with one NaN block: reducing over rows folded the block grid to its max scale (NaN),
    so every row of the result was NaN, not only the row holding the NaN block."""
    _check(fn, (_nan_block((8, 64), "mxfp8"),), 1e-6)


def test_where_next_to_nan_block_of_other_layout():
    """``where(m, x, y)`` with x in MXFP8 (one NaN block) and y per-channel: the blocks do not line
    up, both were folded to per-tensor, the common scale was NaN and so was every selected y."""
    sx = _nan_block((8, 64), "mxfp8")
    sy = jsa.as_scaled_array(jnp.asarray(RNG.standard_normal((8, 64)).astype(np.float32)), fmt="int8_per_channel")
    mask = jnp.asarray(RNG.random((8, 64)) < 0.5)
    _check(lambda a, b: jnp.where(mask, a, b), (sx, sy), 1e-6)


def test_where_zero_next_to_nan_tensor():
    """A per-tensor format with a NaN has scale NaN: ``where(m, x, 0)`` kept the NaN scale for the
    selected zeros (0 * NaN), and ``x > 0`` compared the data, not the NaN values."""
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    x[2, 5] = np.nan
    sx = jsa.as_scaled_array(jnp.asarray(x), fmt="fp8_e5m2")
    mask = jnp.asarray(RNG.random((8, 32)) < 0.5)
    _check(lambda a: jnp.where(mask, a, 0.0), (sx,), 1e-6)
    _check(lambda a: jnp.where(a > 0, 1.0, 2.0), (sx,), 1e-6)


# -- settle of a block grid ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp8"])
def test_where_huge_fill_output_of_block_format(fmt):
    """``where(m, x, -2.38e38)`` as a program output: settling the carrier moved the fill's 2^125
    into every block scale at once (Inf for the larger blocks, the others' data flushed: NaN)."""
    x = (RNG.standard_normal((4, 32)) * 4).astype(np.float32)
    sx = jsa.as_scaled_array(jnp.asarray(x), fmt=fmt)
    mask = jnp.asarray(RNG.random((4, 32)) < 0.5)
    _check(lambda a: jnp.where(mask, a, -2.38e38), (sx,), 1e-6)


# -- an Inf element ------------------------------------------------------------------------------------------


def test_inf_element_does_not_stop_renormalisation():
    """One Inf in a float16 carrier (data 2^11): its Inf amax kept every block from being
    renormalised before ``y * y``, whose data 2^22 overflowed float16 in every row (an RMS norm
    then returned 0 for all rows, not only for the row of the Inf)."""
    y = RNG.choice([-1.0, 1.0], (4, 32)).astype(np.float32) * np.float32(2.0**-27)
    y[1, 3] = np.inf
    sy = _carrier(y, 2.0**-38, np.float16)
    _check(lambda a: a * a, (sy,), 4 * RTOL[np.dtype(np.float16)])
    _check(
        lambda a: a * jax.lax.rsqrt(jnp.mean(a * a, -1, keepdims=True) + 1e-5), (sy,), 8 * RTOL[np.dtype(np.float16)]
    )


# -- bounded functions of small float16 values --------------------------------------------------------------


@pytest.mark.parametrize("fn", [jnp.tanh, jnp.sin, jnp.log1p, jax.lax.erf], ids=["tanh", "sin", "log1p", "erf"])
def test_bounded_function_of_small_float16_values(fn):
    """A bounded function's output had scale 1: in a float16 carrier ``tanh(9.2e-6)`` was a
    subnormal with two digits (-9.179e-6) and ``tanh(2^-30)`` was 0; float32 keeps both."""
    x = RNG.uniform(0.5, 1.0, (4, 32)).astype(np.float32) * RNG.choice([-1, 1], (4, 32)).astype(np.float32)
    x *= np.exp2(RNG.integers(-30, -16, (4, 1))).astype(np.float32)
    _check(fn, (_carrier(x, 2.0**-30, np.float16),), 4 * RTOL[np.dtype(np.float16)])


# -- a plain operand times a float16 carrier -----------------------------------------------------------------


def test_plain_times_float16_carrier():
    """``plain * carrier`` in float16: the plain operand has scale 1, so its product with the
    carrier's data (plain 2^15 times data 4 for a scale of 2^-2) overflowed float16 where the
    value 2^15 is finite; now the product is formed in float32 and renormalised."""
    p = (RNG.uniform(0.5, 1.0, (4, 32)) * 2.0**15).astype(np.float16)
    y = RNG.choice([-1.0, 1.0], (4, 32)).astype(np.float32)
    _check(lambda a, b: a * b, (jnp.asarray(p), _carrier(y, 2.0**-2, np.float16)), 2 * RTOL[np.dtype(np.float16)])
