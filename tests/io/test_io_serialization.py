"""ScaledArray pytrees through flax.serialization, orbax, jax.export and pickle, bit for bit."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from io_helpers import DICT_FMT, assert_same_tree, bits, sample

import qformats as qf
import scalify
from scalify import _serialization


def _tree(fmt, shape=(4, 64)):
    return {"w": scalify.as_scaled_array(sample(shape), fmt=fmt), "b": jnp.arange(3, dtype=jnp.float32)}


# -- format specs ---------------------------------------------------------------------------------


def test_format_spec_round_trip(fmt):
    spec = _serialization.format_to_spec(fmt)
    assert spec == {"name": fmt.name, "fields": {}}
    assert _serialization.format_from_spec(spec) == fmt


@pytest.mark.parametrize(
    "fmt, fields",
    [
        (qf.MXFP8.replace(axis=0, scale_mode="rceil"), {"axis": 0, "scale_mode": "rceil"}),
        (qf.NVFP4.replace(tensor_scale=False), {"tensor_scale": False}),
        (qf.FP8_E4M3.replace(scale_mode="exact"), {"scale_mode": "exact"}),
        (DICT_FMT.replace(scale_mode="exact"), {"scale_mode": "exact"}),
    ],
)
def test_format_spec_of_variants(fmt, fields):
    spec = _serialization.format_to_spec(fmt)
    assert spec["fields"] == fields
    assert _serialization.format_from_spec(spec) == fmt


def test_format_spec_errors():
    with pytest.raises(qf.UnknownFormatError, match="'no_such_fmt' is not registered"):
        _serialization.format_from_spec({"name": "no_such_fmt", "fields": {}}, where="f.safetensors")
    with pytest.raises(_serialization.FormatSerializationError, match="malformed format spec"):
        _serialization.format_from_spec({"fields": {}})
    with pytest.raises(_serialization.FormatSerializationError, match="cannot rebuild"):
        _serialization.format_from_spec({"name": "mxfp8", "fields": {"no_field": 1}})
    # A variant whose changed field is not JSON data must be registered under its own name.
    odd = qf.MXFP8.replace(element=qf.FP8_E5M2.element)
    with pytest.raises(_serialization.FormatSerializationError, match="register_format"):
        _serialization.format_to_spec(odd)


# -- flax -----------------------------------------------------------------------------------------


def test_flax_bytes_and_state_dict(fmt):
    serialization = pytest.importorskip("flax.serialization", reason="flax is not installed")
    tree = _tree(fmt)
    state = serialization.to_state_dict(tree)
    assert set(state["w"]) == {"data", "scale"}  # the format is static: not in the state
    np.testing.assert_array_equal(bits(state["w"]["data"]), bits(tree["w"].data))
    assert_same_tree(serialization.from_state_dict(tree, state), tree)
    # from_bytes restores into a target with the same format and zero values.
    target = jax.tree.map(jnp.zeros_like, tree)
    assert_same_tree(serialization.from_bytes(target, serialization.to_bytes(tree)), tree)


def test_flax_nested_scale_state_dict():
    serialization = pytest.importorskip("flax.serialization", reason="flax is not installed")
    state = serialization.to_state_dict(_tree(qf.NVFP4))
    assert set(state["w"]["scale"]) == {"block", "tensor"}
    state = serialization.to_state_dict(_tree(DICT_FMT))
    assert set(state["w"]["scale"]) == {"s"}


def test_flax_state_dict_missing_key_is_an_error():
    serialization = pytest.importorskip("flax.serialization", reason="flax is not installed")
    tree = _tree(qf.MXFP8)
    state = serialization.to_state_dict(tree)
    del state["w"]["scale"]
    with pytest.raises(ValueError, match="needs keys 'data' and 'scale'"):
        serialization.from_state_dict(tree, state)


def test_flax_registration_when_flax_is_imported_after_scalify():
    """The import hook registers the handlers when flax.serialization is first imported."""
    pytest.importorskip("flax.serialization", reason="flax is not installed")
    code = textwrap.dedent(
        """
        import sys
        import scalify, qformats as qf, jax.numpy as jnp
        assert "flax.serialization" not in sys.modules
        from flax import serialization
        sa = scalify.as_scaled_array(jnp.ones((2, 32)), fmt=qf.MXFP8)
        assert set(serialization.to_state_dict(sa)) == {"data", "scale"}
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- orbax ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8_per_channel", "mxfp6_e2m3", "mxfp4", "nvfp4", DICT_FMT.name])
def test_orbax_standard_checkpointer(tmp_path, name):
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed (optional)")
    tree = _tree(qf.get_format(name))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", tree)
    ckpt.wait_until_finished()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    assert_same_tree(ckpt.restore(tmp_path / "ckpt", abstract), tree)


# -- jax.export -----------------------------------------------------------------------------------


def _export_round_trip(f, *args):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    exported = jax.export.export(jax.jit(f))(*args)
    blob = exported.serialize()
    restored = jax.export.deserialize(blob)
    assert restored.in_tree == exported.in_tree
    assert restored.out_tree == exported.out_tree
    return restored.call(*args), jax.jit(f)(*args)


def test_jax_export_scalified_function(fmt):
    tree = _tree(fmt)

    def f(t, y):
        return t["w"] * 2.0, jnp.tanh(t["w"]), y + t["b"]

    got, ref = _export_round_trip(scalify.scalify(f), tree, jnp.ones(3, jnp.float32))
    assert_same_tree(got, ref)


def test_jax_export_returns_formatted_arrays(fmt):
    """A ScaledArray output keeps its format (and a replaced field) through serialize/deserialize."""
    if "axis" in {a.name for a in attrs.fields(type(fmt))}:
        fmt = fmt.replace(axis=0)
    tree = _tree(fmt, (64, 64))
    got, ref = _export_round_trip(lambda t: t, tree)
    assert got["w"].fmt == fmt
    assert_same_tree(got, ref)
    assert_same_tree(got, tree)


def test_jax_export_unknown_format_at_deserialization():
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    tmp = qf.register_format(DICT_FMT.replace(name="test_tmp_fmt"))
    blob = jax.export.export(jax.jit(lambda t: t))(_tree(tmp)).serialize()
    qf.unregister_format("test_tmp_fmt")
    with pytest.raises(qf.UnknownFormatError, match="'test_tmp_fmt' is not registered"):
        jax.export.deserialize(blob)


# -- pickle ---------------------------------------------------------------------------------------


def test_pickle(fmt):
    tree = _tree(fmt)
    assert_same_tree(pickle.loads(pickle.dumps(tree)), tree)


# -- user scale classes ---------------------------------------------------------------------------


def test_register_scale_type_rejects_other_classes():
    class Plain:
        pass

    with pytest.raises(TypeError, match="NamedTuple, attrs class or dataclass"):
        scalify.io.register_scale_type(Plain)


def test_registered_namedtuple_scale_through_export_and_flax():
    from typing import NamedTuple

    class TwoScales(NamedTuple):
        a: jax.Array
        b: jax.Array

    scalify.io.register_scale_type(TwoScales, "tests.TwoScales")
    sa = scalify.ScaledArray(jnp.ones((2, 4), jnp.float16), TwoScales(jnp.float32(2.0), jnp.float32(3.0)))
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    got, _ = _export_round_trip(lambda s: s, sa)
    assert type(got.scale) is TwoScales
    assert_same_tree(got, sa)
    serialization = pytest.importorskip("flax.serialization", reason="flax is not installed")
    assert_same_tree(serialization.from_bytes(sa, serialization.to_bytes(sa)), sa)


def test_registered_attrs_scale_through_export_flax_and_files(tmp_path):
    """An attrs scale class registered as a pytree (all fields children) and with register_scale_type."""

    @attrs.frozen
    class GridAndGlobal:
        grid: jax.Array
        glob: jax.Array

    jax.tree_util.register_dataclass(GridAndGlobal, data_fields=["grid", "glob"], meta_fields=[])
    scalify.io.register_scale_type(GridAndGlobal, "tests.GridAndGlobal")
    sa = scalify.ScaledArray(
        jnp.ones((2, 4), jnp.bfloat16), GridAndGlobal(jnp.full((2, 1), 0.5, jnp.float32), jnp.float32(3.0))
    )
    scalify.io.save(tmp_path / "a.safetensors", {"x": sa})
    back = scalify.io.load(tmp_path / "a.safetensors")["x"]
    assert type(back.scale) is GridAndGlobal
    assert_same_tree(back, sa)
    serialization = pytest.importorskip("flax.serialization", reason="flax is not installed")
    assert set(serialization.to_state_dict(sa)["scale"]) == {"grid", "glob"}
    assert_same_tree(serialization.from_bytes(sa, serialization.to_bytes(sa)), sa)
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
    got, _ = _export_round_trip(lambda s: s, sa)
    assert type(got.scale) is GridAndGlobal
    assert_same_tree(got, sa)
