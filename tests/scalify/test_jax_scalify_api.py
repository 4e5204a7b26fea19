"""jax-scalify's public API on scalify: ScaledArray methods, as_scaled_array, jsa.tree, jsa.lax scaling
primitives, jsa.ops forward/backward maps and debug callbacks. References are NumPy / float32."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import numpy.testing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scalify as jsa

finite16 = st.floats(-60000, 60000, allow_nan=False, width=16)


# -- ScaledArray ------------------------------------------------------------------------------------
def test_astype_keeps_value_out_of_float16_range():
    a = np.array([2, 4], np.float32) * 256**2  # overflows float16
    sa = jsa.as_scaled_array(a, scale=np.float32(256**2 * 2)).astype(np.float16)
    assert sa.dtype == np.float16 and isinstance(sa.data, np.ndarray)
    npt.assert_array_equal(sa.data, np.array([1, 2], np.float16))
    npt.assert_array_equal(np.asarray(sa, dtype=np.float32), a)


def test_astype_float8_is_a_plain_cast_of_the_data():
    a = jnp.array([400, 448, 512], jnp.float32)
    sa = jsa.as_scaled_array(a, scale=np.float32(128)).astype(jnp.float8_e4m3fn)
    npt.assert_array_equal(np.asarray(sa, dtype=np.float32), [384, 448, 512])
    assert sa.scale == 128


def test_astype_rejects_integer_dtypes():
    with pytest.raises(TypeError, match="to_array"):
        jsa.as_scaled_array(np.ones(2, np.float32)).astype(np.int32)


@settings(max_examples=30, deadline=None)
@given(st.lists(finite16, min_size=1, max_size=8), st.integers(-20, 20))
def test_to_array_numpy_in_numpy_out(values, e):
    x = np.array(values, np.float16)
    sa = jsa.scaled_array(x, np.float32(2.0**e), npapi=np)
    out = sa.to_array(np.float32)
    assert isinstance(out, np.ndarray)
    npt.assert_array_equal(out, x.astype(np.float32) * np.float32(2.0**e))


def test_aval_is_a_shaped_array():
    sa = jsa.scaled_array([1.0, 2.0], 3.0, dtype=np.float16)
    assert sa.aval == jax.core.ShapedArray((2,), np.float16)


# -- as_scaled_array ---------------------------------------------------------------------------------
@pytest.mark.parametrize("x", [False, 3, np.array([1, 2]), jnp.array([1, 2]), np.int32(2), jnp.array([True])])
def test_as_scaled_array_returns_non_float_inputs_unchanged(x):
    assert jsa.as_scaled_array(x) is x
    assert jsa.as_scaled_array(x, scale=2.0) is x


@settings(max_examples=40, deadline=None)
@given(st.floats(-(2.0**100), 2.0**100, allow_nan=False, allow_subnormal=False, width=32))
def test_as_scaled_array_splits_a_scalar_into_mantissa_and_power_of_two(v):
    sa = jsa.as_scaled_array(v)
    scale = float(sa.scale)
    assert scale > 0 and np.log2(scale) == np.round(np.log2(scale))
    if v != 0:
        assert 1 <= abs(float(sa.data)) < 2
    assert float(np.asarray(sa)) == float(np.float32(v))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-2048, 2048), min_size=1, max_size=6), st.integers(-4, 10), st.booleans())
def test_as_scaled_array_with_scale_keeps_value_and_array_type(values, e, use_jax):
    x = np.array(values, np.float16)  # integers: x / 2^e is exact in float16
    x = jnp.asarray(x) if use_jax else x
    scale = np.float32(2.0**e)
    sa = jsa.as_scaled_array(x, scale=scale)
    assert isinstance(sa.data, jax.Array if use_jax else np.ndarray)
    assert sa.scale is scale
    npt.assert_array_equal(np.asarray(sa, dtype=np.float32), np.asarray(x, np.float32))


def test_as_scaled_array_pytree_keeps_int_leaves_and_scaled_leaves():
    z = jsa.as_scaled_array(jnp.array([1.0, 2.0]))
    tree = {"x": jnp.array([1, 2]), "y": jnp.array([1.0, 2.0]), "z": z}
    out = jsa.as_scaled_array(tree, scale=np.float32(2))
    assert out["x"] is tree["x"] and out["z"] is z
    npt.assert_array_equal(out["y"].data, [0.5, 1.0])


# -- tree ---------------------------------------------------------------------------------------------
def test_tree_helpers_treat_scaled_arrays_as_leaves():
    sa = jsa.as_scaled_array(np.array([1.5, 3.0], np.float32), scale=np.float32(2))
    values = {"a": np.int32(2), "b": sa}
    leaves, treedef = jsa.tree.flatten(values)
    assert leaves[1] is sa and jsa.tree.leaves(values)[1] is sa
    assert jsa.tree.structure(values) == treedef
    assert jsa.tree.unflatten(treedef, leaves)["b"] is sa
    assert jsa.tree.map(lambda v: v.dtype, values) == {"a": np.int32, "b": np.float32}
    cast = jsa.tree.astype(values, np.float16, floating_only=True)
    assert cast["a"].dtype == np.int32 and cast["b"].dtype == np.float16
    assert jsa.tree.astype(values, np.float16)["a"].dtype == np.float16


def test_tree_all():
    assert jsa.tree.all({"a": np.array([1, 2]), "b": jsa.as_scaled_array(np.ones(2, np.float32))})
    assert not jsa.tree.all({"a": np.array([1, 0])})


# -- lax scaling primitives -----------------------------------------------------------------------------
def test_set_scaling_under_scalify_sets_the_scale_and_keeps_the_value():
    x = jsa.as_scaled_array(np.array([-1.0, 2.0], np.float16), scale=np.float32(2))
    # Read data and scale inside the program (program outputs may be re-normalized by the interpreter).
    data, scale = jsa.scalify(lambda v, s: jsa.lax.get_data_scale(jsa.lax.set_scaling(v, s)))(x, np.float32(8))
    npt.assert_array_equal(scale, 8)
    npt.assert_array_equal(data, np.array([-0.125, 0.25], np.float16))
    out = jsa.scalify(jsa.lax.set_scaling)(x, np.float32(8))
    npt.assert_array_equal(np.asarray(out, np.float32), [-1, 2])


def test_set_scaling_zero_scale_gives_zeros():
    out = jsa.scalify(jsa.lax.set_scaling)(np.array([1.0, 2.0], np.float32), np.float32(0))
    npt.assert_array_equal(out.data, 0)
    npt.assert_array_equal(out.scale, 0)


def test_set_scaling_is_identity_outside_scalify():
    x = jnp.array([2.0, 3.0])
    npt.assert_array_equal(jax.jit(jsa.lax.set_scaling)(x, jnp.float32(4)), x)


def test_stop_scaling_and_get_data_scale():
    sa = jsa.scaled_array([2.0, 3.0], np.float32(4), dtype=np.float16)
    out = jsa.scalify(lambda v: jsa.lax.stop_scaling(v, np.float32))(sa)
    assert isinstance(out, jax.Array) and out.dtype == np.float32
    npt.assert_array_equal(out, [8, 12])
    data, scale = jax.jit(jsa.scalify(jsa.lax.get_data_scale))(sa)
    npt.assert_array_equal(data, [2, 3])
    npt.assert_array_equal(scale, 4)
    with jsa.ScalifyConfig(scale_dtype=np.float32):
        d, s = jax.jit(jsa.lax.get_data_scale)(jnp.array([1.0], jnp.float16))
    assert s.dtype == np.float32 and s == 1 and d.dtype == np.float16


def test_rebalance():
    x = np.array([-1.0, 2.0], np.float16)
    assert jsa.lax.rebalance(x, np.float16(2)) is x
    sa = jsa.scaled_array([2.0, 3.0], np.float16(4), dtype=np.float16, npapi=np)
    out = jsa.lax.rebalance(sa, np.float16(0.5))
    npt.assert_array_equal(out.scale, 2)
    npt.assert_array_equal(np.asarray(out), np.asarray(sa))


# -- ops ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
def test_reduce_precision_on_forward_matches_a_cast_and_keeps_the_scale(dtype):
    x = np.array([17, -17, 8, 1, 9, 11, 18], np.float16)
    npt.assert_array_equal(jsa.ops.reduce_precision_on_forward(x, dtype), x.astype(dtype).astype(np.float16))
    sa = jsa.as_scaled_array(np.array([17.0, 19.0], np.float32), scale=np.float32(2))
    out = jsa.scalify(lambda v: jsa.ops.reduce_precision_on_forward(v, dtype))(sa)
    assert isinstance(out, jsa.ScaledArray)
    # The value is rounded like the plain array (the scale a power of two, so rounding commutes).
    npt.assert_array_equal(np.asarray(out), np.array([17.0, 19.0], np.float32).astype(dtype).astype(np.float32))


def test_cast_and_reduce_precision_on_backward_touch_only_the_gradient():
    x = jnp.array([17.0, -17.0, 3.0])
    g = jax.grad(lambda v: jnp.sum(jsa.ops.cast_on_backward(v, jnp.float16) ** 2))(x)
    assert g.dtype == jnp.float16
    npt.assert_array_equal(g, np.asarray(2 * x, np.float16))
    y = jsa.ops.cast_on_forward(x, jnp.float16)
    assert y.dtype == jnp.float16
    # Backward is the identity: the float16 cotangent of the cast passes through uncast.
    g = jax.grad(lambda v: jnp.sum(jsa.ops.cast_on_forward(v, jnp.float16).astype(jnp.float32) * 3))(x)
    npt.assert_array_equal(g, 3)
    g = jax.grad(lambda v: jnp.sum(jsa.ops.reduce_precision_on_backward(v, ml_dtypes.float8_e4m3fn) * 17))(x)
    npt.assert_array_equal(g, 16)  # 17 rounds to 16 in e4m3


def test_dynamic_rescale_of_zeros_gets_a_small_scale():
    out = jsa.ops.dynamic_rescale_max(jsa.scaled_array([0.0, 0.0], np.float32(1), dtype=np.float16))
    assert 0 < float(out.scale) < 1e-3
    npt.assert_array_equal(np.asarray(out), 0)


def test_debug_print_passes_scaled_arrays(capfd):
    sa = jsa.scaled_array([2.0, 3.0], 2.0, dtype=np.float32)
    jsa.scalify(lambda x: jsa.ops.debug_print("IN: {}", x))(sa)
    out = capfd.readouterr().out.strip()
    assert out.startswith("IN: ScaledArray(data=") and "2." in out


def test_jax_debug_print_under_scalify_prints_values(capfd):
    sa = jsa.scaled_array([2.0, 3.0], 2.0, dtype=np.float32)
    jsa.scalify(lambda x: jax.debug.print("v={}", x))(sa)
    assert capfd.readouterr().out.strip() == "v=[4. 6.]"


def test_debug_callback_grad_sees_the_gradient():
    seen = []
    f = jax.grad(lambda v: jnp.sum(3 * jsa.ops.debug_callback_grad(lambda g: seen.append(np.asarray(g)), v)[0]))
    jax.block_until_ready(f(jnp.ones(2)))
    jax.effects_barrier()
    npt.assert_array_equal(seen[0], [3, 3])
