"""A float32 -> float16 cast inside scalify must not overflow when the value fits float16 scaled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify


@pytest.mark.parametrize("scale_shape", [(), (1, 8), (4, 1)])
def test_narrowing_cast_renormalises(scale_shape):
    rng = np.random.default_rng(0)
    data = jnp.asarray(rng.normal(size=(4, 8)) * 1e6, jnp.float32)  # beyond float16's 65504
    scale = jnp.full(scale_shape, 1e-3, jnp.float32)
    x = scalify.ScaledArray(data, scale)
    out = jax.jit(scalify.scalify(lambda v: v.astype(jnp.float16)))(x)
    assert out.data.dtype == jnp.float16
    assert np.all(np.isfinite(np.asarray(out.data)))
    ref = np.asarray(x.to_array(), np.float32)
    # float16 keeps 11 significant bits: relative error at most 2**-11.
    s = np.asarray(out.scale, np.float32).reshape(np.shape(out.scale) or (1, 1))
    full = np.repeat(np.repeat(s, 4 // s.shape[0], axis=0), 8 // s.shape[1], axis=1)
    value = np.asarray(out.data, np.float32) * full  # one rounding: float16 data times the scale
    np.testing.assert_allclose(value, ref, rtol=2.0**-11)


def test_widening_cast_keeps_scale():
    x = scalify.as_scaled_array(jnp.asarray([1.0, 2.0], jnp.float16), scale=np.float32(4))
    out = scalify.scalify(lambda v: v.astype(jnp.float32))(x)
    assert out.data.dtype == jnp.float32 and float(out.scale) == 4.0
