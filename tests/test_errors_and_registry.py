"""Bad input raises errors that name the problem and the fix; the registry behaves like a mapping."""

import importlib.metadata

import jax.numpy as jnp
import pytest

import qformats as qf
from qformats import _registry


def test_block_axis_not_multiple():
    with pytest.raises(ValueError, match=r"axis -1 has length 33, which is not a multiple of 32.*Pad") as e:
        qf.MXFP8.quantize(jnp.ones((4, 33)))
    assert "fmt.replace(axis=...)" in str(e.value)
    with pytest.raises(ValueError, match=r"axis 0 has length 20, which is not a multiple of 16"):
        qf.NVFP4.replace(axis=0).quantize(jnp.ones((20, 16)))


def test_non_float_input():
    with pytest.raises(TypeError, match=r"mxfp8.quantize expects a floating-point array, got dtype int32.*astype"):
        qf.MXFP8.quantize(jnp.ones((4, 32), jnp.int32))
    with pytest.raises(TypeError, match="floating-point"):
        qf.INT8_PER_CHANNEL.quantize(jnp.ones((4, 32), bool))


def test_wrong_axis():
    with pytest.raises(ValueError, match=r"axis 2, but the input has only 2 dimension.*replace\(axis"):
        qf.MXFP4.replace(axis=2).quantize(jnp.ones((4, 32)))
    with pytest.raises(ValueError, match=r"per-channel format scales along axis -3"):
        qf.INT8_PER_CHANNEL.replace(axis=-3).quantize(jnp.ones((4, 32)))


def test_unknown_format_lists_known_names():
    with pytest.raises(qf.UnknownFormatError, match=r"unknown format 'mxfp9'. Known formats: fp16, bf16") as e:
        qf.get_format("mxfp9")
    assert "nvfp4" in str(e.value) and "register_format" in str(e.value)
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)


def test_bad_scale_mode_and_field():
    with pytest.raises(
        ValueError,
        match=r"'nearest' is not an MX scale mode; choose one of \('floor', 'ceil', 'even', 'rceil', 'rceil_log2'\)",
    ):
        qf.MXFP8.replace(scale_mode="nearest")
    with pytest.raises(ValueError, match="per-tensor scale mode"):
        qf.FP8_E4M3.replace(scale_mode="floor")
    with pytest.raises(
        TypeError, match=r"MXFormat has no field among \['blocksize'\]; its fields are: name, element, axis"
    ):
        qf.MXFP8.replace(blocksize=16)


def test_lookup_is_case_insensitive_and_aliases():
    assert qf.get_format("MXFP8") is qf.MXFP8
    assert qf.get_format("mxfp8_e4m3") is qf.MXFP8 is qf.MXFP8_E4M3
    assert qf.get_format("mxfp4_e2m1") is qf.MXFP4
    assert qf.get_format(qf.NVFP4) is qf.NVFP4
    builtins = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8_per_channel", "mxfp8", "mxfp8_e5m2", "mxfp6_e2m3",
                "mxfp6_e3m2", "mxfp4", "mxint8", "nvfp4"]  # fmt: skip
    assert qf.list_formats()[: len(builtins)] == builtins
    assert "mxfp8_e4m3" in qf.list_formats(aliases=True)
    for name in builtins:
        assert qf.get_format(name).name == name


def test_register_taken_name_needs_overwrite():
    fmt = qf.MXFP8.replace(name="my_mx", scale_mode="rceil")
    try:
        assert qf.register_format(fmt) is fmt
        assert qf.get_format("My_MX") is fmt
        qf.register_format(fmt)  # the same value again is harmless
        other = fmt.replace(block_size=16)
        with pytest.raises(ValueError, match=r"already registered as 'my_mx'.*overwrite=True"):
            qf.register_format(other)
        qf.register_format(other, overwrite=True)
        assert qf.get_format("my_mx") is other
        with pytest.raises(ValueError, match="already registered as 'mxfp8'"):
            qf.register_format(other, name="mxfp8")
    finally:
        qf.unregister_format("my_mx")
    with pytest.raises(TypeError, match=r"expects a qformats\.ScaledFormat"):
        qf.register_format("mxfp8")


def test_entry_point_plugins(monkeypatch):
    class EP:
        name, value = "demo", "demo_pkg:FORMATS"

        def load(self):
            return lambda: [qf.MXFP4.replace(name="ep_mxfp4_rceil", scale_mode="rceil")]

    class Broken(EP):
        name = "broken"

        def load(self):
            raise ImportError("no module named demo_pkg")

    def fake_entry_points(group):
        assert group == "qformats.formats"
        return [EP(), Broken()]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(_registry, "_entry_points_loaded", False)
    try:
        with pytest.warns(UserWarning, match="could not load qformats format plug-in 'broken'"):
            names = qf.list_formats()
        assert "ep_mxfp4_rceil" in names
        assert qf.get_format("ep_mxfp4_rceil").scale_mode == "rceil"
    finally:
        qf.unregister_format("ep_mxfp4_rceil")


def test_repr_shows_spec_and_formats_are_hashable():
    r = repr(qf.MXFP8.replace(scale_mode="rceil"))
    assert "MXFormat(name='mxfp8'" in r and "float8_e4m3fn" in r and "scale_mode='rceil'" in r
    assert len({qf.get_format(n) for n in qf.list_formats()}) == len(qf.list_formats())
    assert qf.MXFP8 != qf.MXFP8.replace(axis=0)


def test_unhashable_format_called_eagerly_names_the_fix():
    """A format whose class is mutable (``attrs.define`` compares by value, so it has no hash)
    cannot key the program an eager call compiles: the error says so and how to fix it. Traced,
    inside the caller's program, it needs no hash and works."""
    import attrs
    import jax
    import numpy as np

    @attrs.define
    class MutableMXFP8(qf.ScaledFormat):
        name: str = "mutable_mxfp8"

        element = property(lambda self: qf.MXFP8.element)
        layout = property(lambda self: qf.MXFP8.layout)

        def quantize(self, x):
            return qf.MXFP8.quantize(x)

        def decode(self, data):
            return qf.MXFP8.decode(data)

        def scale_values(self, scale):
            return qf.MXFP8.scale_values(scale)

    fmt = MutableMXFP8()
    x = jnp.linspace(-3, 3, 64, dtype=jnp.float32).reshape(2, 32)
    with pytest.raises(TypeError, match=r"MutableMXFP8 is not hashable.*@attrs.frozen"):
        fmt.quantize(x)
    got = jax.jit(lambda v: fmt.dequantize(*fmt.quantize(v)))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(qf.MXFP8.fake_quantize(x)))
