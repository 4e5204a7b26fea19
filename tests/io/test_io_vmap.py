"""scalify.vmap: logical in_axes/out_axes for every layout, against the float32 program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from io_helpers import BUILTIN_NAMES, bits, sample

import qformats as qf
import scalify
from scalify import ScaledArray

# Inputs spread over 2^-3..2^3 around N(0, 1) (see conftest.sample).
SPREAD = 2.0**3


def tolerance(fmt) -> float:
    """Bound on the relative L2 error of a scalified program on quantized inputs vs float32 on the originals.

    Float elements round to nearest with a relative step of 2^-mbits (twice the unit roundoff); the
    functions below are 1-Lipschitz in the relative sense (matmul of two rounded operands, tanh), and
    an RMS error is well below the worst case, so 2^-mbits bounds it. Integer elements have an
    absolute step of 1/127 of the block maximum; with inputs spread over SPREAD either way of their
    RMS, the relative step is at most 2 * SPREAD / 127.
    """
    el = fmt.element
    return 2.0**-el.mbits if hasattr(el, "mbits") else 2 * SPREAD / 127


def _with_axis(fmt, axis):
    return fmt.replace(axis=axis) if hasattr(fmt.layout, "axis") else fmt


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def f(a, b):
    return jnp.tanh(a @ b / 8.0)


def test_vmap_matches_float32_program(fmt):
    x, w = sample((3, 4, 64)), sample((64, 32), seed=5)
    sx = scalify.as_scaled_array(x, fmt=fmt)
    sw = scalify.as_scaled_array(w, fmt=_with_axis(fmt, 0))  # blocks along the contraction axis
    out = scalify.vmap(scalify.scalify(f), in_axes=(0, None))(sx, sw)
    assert isinstance(out, ScaledArray) and out.shape == (3, 4, 32)
    # Same float32 arithmetic on the dequantized inputs: equal up to summation order.
    on_deq = jax.vmap(f, in_axes=(0, None))(np.asarray(sx), np.asarray(sw))
    np.testing.assert_allclose(np.asarray(out), on_deq, rtol=1e-5, atol=1e-6)
    # Against the float32 program on the original values: the format's precision.
    assert _rel(out, jax.vmap(f, in_axes=(0, None))(x, w)) < tolerance(fmt)


def test_vmap_in_axes_pytree_and_out_axes(fmt):
    """A batch of quantized weights mapped along 0 (a pytree in_axes), output batch placed on axis 1."""
    ws, x, b = sample((5, 64, 16), seed=2), sample((3, 64), seed=3), sample((16,), seed=4)
    params = {"w": scalify.as_scaled_array(ws, fmt=_with_axis(fmt, -2)), "b": b}

    def g(p, x):
        return x @ p["w"] + p["b"]

    out = scalify.vmap(scalify.scalify(g), in_axes=({"w": 0, "b": None}, None), out_axes=1)(params, x)
    assert out.shape == (3, 5, 16)
    w_deq = np.asarray(params["w"])
    np.testing.assert_allclose(np.asarray(out), np.einsum("mk,bkn->mbn", x, w_deq) + b, rtol=1e-5, atol=1e-5)
    assert _rel(out, np.einsum("mk,bkn->mbn", x, ws) + b) < tolerance(fmt)


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_vmap_identity_moves_axes_exactly(name):
    """Mapping axis 1 in and out at axis 2 is a transpose of the value, bit for bit."""
    fmt = qf.get_format(name)
    sx = scalify.as_scaled_array(sample((6, 4, 64)), fmt=fmt)
    out = jax.jit(scalify.vmap(lambda a: a, in_axes=1, out_axes=2))(sx)
    np.testing.assert_array_equal(np.asarray(out), np.moveaxis(np.asarray(sx), 1, 2))
    if isinstance(fmt.layout, qf.Blocked) and not getattr(fmt, "tensor_scale", False):
        # Block layouts stack back into their format, the block axis still on the same data axis.
        assert out.fmt == fmt.replace(axis=-2)
        np.testing.assert_array_equal(bits(out.data), bits(np.moveaxis(np.asarray(sx.data), 1, 2)))
        np.testing.assert_array_equal(bits(out.scale), bits(np.moveaxis(np.asarray(sx.scale), 1, 2)))
    else:
        # One scale per item cannot be a per-tensor (or per-channel, or NVFP4 tensor) scale: carrier form.
        assert out.fmt is None and out.scale.shape[2] == 4


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["fp8_e4m3", "mxfp4", "int8_per_channel"]), st.integers(-3, 1), st.integers(-3, 2))
def test_vmap_any_axes_property(name, in_axis, out_axis):
    """Property: for any non-block in axis and any out axis, identity under vmap is a moveaxis of the value."""
    assume(not (name == "mxfp4" and in_axis % 3 == 2))  # its block axis cannot be mapped (test_vmap_errors)
    fmt = qf.get_format(name)
    sx = scalify.as_scaled_array(sample((4, 2, 64)), fmt=fmt)
    out = scalify.vmap(lambda a: a, in_axes=in_axis, out_axes=out_axis)(sx)
    np.testing.assert_array_equal(np.asarray(out), np.moveaxis(np.asarray(sx), in_axis, out_axis))


def test_vmap_per_channel_axis_is_passed_as_carrier():
    """Mapping the channel axis leaves one scale per item: items are carrier arrays of the same value."""
    sx = scalify.as_scaled_array(sample((8, 64)), fmt=qf.INT8_PER_CHANNEL)  # channel axis -1

    def item(a):
        assert a.fmt is None and a.shape == (8,)
        return a

    out = scalify.vmap(item, in_axes=1, out_axes=1)(sx)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(sx))


def test_vmap_errors():
    mx = scalify.as_scaled_array(sample((4, 64)), fmt=qf.MXFP8)
    with pytest.raises(ValueError, match="blocks of 32 elements lie along the mapped axis 1"):
        scalify.vmap(lambda a: a, in_axes=1)(mx)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        scalify.vmap(lambda a: a, in_axes=2)(mx)
    with pytest.raises(ValueError, match="sizes"):
        scalify.vmap(lambda a, b: a, in_axes=(0, 0))(mx, jnp.ones(3))
    carrier = scalify.as_scaled_array(sample((4, 64)), scale=jnp.ones((1, 2), jnp.float32))
    with pytest.raises(ValueError, match="scale blocks of 32 elements"):
        scalify.vmap(lambda a: a, in_axes=1)(carrier)


def test_carrier_inputs_and_outputs():
    x = sample((4, 64))
    for scale in (2.0, jnp.full((4, 1), 2.0, jnp.float32), jnp.full((4, 64), 0.5, jnp.float32)):
        sx = scalify.as_scaled_array(x, scale=scale)
        out = scalify.vmap(scalify.scalify(lambda a: a * 2.0), in_axes=0, out_axes=1)(sx)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(sx).T * 2)


# -- plain jax.vmap: the documented in_axes --------------------------------------------------------


def test_plain_jax_vmap_documented_in_axes():
    """docs/io.md: per-tensor scale None; MX scale on the data's axis; NVFP4 block scale mapped, tensor not."""
    x, w = sample((3, 4, 64)), sample((64, 32), seed=5)
    sw = scalify.as_scaled_array(w, fmt=qf.BF16)
    for fmt in (qf.FP8_E4M3, qf.MXFP8, qf.NVFP4):
        sx = scalify.as_scaled_array(x, fmt=fmt)
        scale_axes = {qf.FP8_E4M3: None, qf.MXFP8: 0, qf.NVFP4: qf.NVFP4Scale(block=0, tensor=None)}[fmt]
        axes = ScaledArray(0, scale_axes, fmt=sx.fmt, dtype=sx.dtype)
        out = jax.vmap(scalify.scalify(f), in_axes=(axes, None))(sx, sw)
        ref = scalify.vmap(scalify.scalify(f), in_axes=(0, None))(sx, sw)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_plain_jax_vmap_in_axes_0_fails_on_a_per_tensor_scale():
    """Why scalify.vmap exists: in_axes=0 also maps the 0-d scale."""
    sx = scalify.as_scaled_array(sample((3, 64)), fmt=qf.FP8_E4M3)
    with pytest.raises(ValueError, match="vmap was requested to map its argument along axis 0"):
        jax.vmap(scalify.scalify(lambda a: a * 2.0))(sx)


def test_vmap_keyword_arguments_map_axis_0():
    sx = scalify.as_scaled_array(sample((3, 64)), fmt=qf.FP8_E4M3)
    out = scalify.vmap(scalify.scalify(lambda a, *, k: a * k))(sx, k=jnp.arange(3, dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(sx) * np.arange(3, dtype=np.float32)[:, None])
