"""The scale contract of ScaledArray: value = data * scale with scale >= 0 (#14).

Before the check, ``as_scaled_array(x, scale=-2.0)`` was accepted and ``abs`` then returned
``-|x|``; ``scale=0`` gave inf data. The rules take signs and orderings from the data alone, so a
negative scale is refused everywhere a concrete scale enters, and the dividing constructor also
refuses zero and non-finite scales. References: NumPy on the plain values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify

X = np.array([[1.0, -2.0], [3.0, -4.0]], np.float32)


@pytest.mark.parametrize("scale", [-2.0, np.float32(-1.0), np.array([[1.0], [-1.0]], np.float32), -np.inf])
def test_negative_scale_refused(scale):
    with pytest.raises(ValueError, match="must be >= 0"):
        scalify.as_scaled_array(jnp.asarray(X), scale=scale)
    with pytest.raises(ValueError, match="must be >= 0"):
        scalify.scaled_array(X, scale)


@pytest.mark.parametrize("scale", [0.0, np.nan, np.inf])
def test_dividing_constructor_refuses_zero_and_nonfinite(scale):
    with pytest.raises(ValueError, match="positive and finite"):
        scalify.as_scaled_array(jnp.asarray(X), scale=scale)


@pytest.mark.parametrize("scale", [0.0, np.inf, np.nan])
def test_raw_constructor_keeps_jax_scalify_semantics(scale):
    # scaled_array(data, scale) does not divide: value = data * scale (jax-scalify builds zero,
    # Inf and NaN scales this way in its own tests).
    a = scalify.scaled_array(X, scale)
    np.testing.assert_array_equal(np.asarray(a.to_array()), X * np.float32(scale))


@pytest.mark.parametrize("fn", [jnp.abs, jax.nn.relu, jnp.sign, lambda v: jnp.maximum(v, 0.5)])
def test_positive_scale_rules_match_numpy(fn):
    a = scalify.as_scaled_array(jnp.asarray(X), scale=2.0)
    got = scalify.scalify(fn)(a)
    got = got.to_array() if isinstance(got, scalify.ScaledArray) else got
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(jnp.asarray(X))))


def test_traced_scale_is_not_checked_but_works():
    # A traced scale has no value to check at trace time (documented as the caller's contract).
    f = jax.jit(lambda s: scalify.as_scaled_array(jnp.asarray(X), scale=s).to_array())
    np.testing.assert_allclose(np.asarray(f(np.float32(4.0))), X)
