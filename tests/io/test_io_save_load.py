"""scalify.io.save / load: bit-exact round trips, files other readers open, delegation and errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from io_helpers import DICT_FMT, assert_same_tree, bits, sample

import qformats as qf
import scalify
from qformats import _safetensors as sf


def _tree(fmt):
    return {
        "layers": [
            {"w": scalify.as_scaled_array(sample((8, 64), seed=i), fmt=fmt), "b": jnp.full((3,), i, jnp.float32)}
            for i in range(2)
        ],
        "head": (scalify.as_scaled_array(sample((4, 32)), scale=2.0), None),
        "step": jnp.int32(7),
    }


def test_round_trip_every_format(tmp_path, fmt):
    tree = _tree(fmt)
    scalify.io.save(tmp_path / "m.safetensors", tree)
    back = scalify.io.load(tmp_path / "m.safetensors")
    assert_same_tree(back, tree)
    assert back["layers"][0]["w"].fmt == fmt
    assert isinstance(back["layers"][0]["b"], jax.Array)


def test_round_trip_changed_fields_and_logical_dtype(tmp_path):
    fmt = qf.MXFP8.replace(axis=0, scale_mode="rceil")
    sa = scalify.as_scaled_array(sample((64, 8)).astype(jnp.bfloat16), fmt=fmt)
    scalify.io.save(tmp_path / "a.safetensors", {"w": sa})
    back = scalify.io.load(tmp_path / "a.safetensors")["w"]
    assert back.fmt == fmt and back.dtype == jnp.bfloat16
    assert_same_tree(back, sa)


def test_names_and_metadata_readable_by_safetensors(tmp_path):
    """The package's own reader sees our names, the float32/uint8 tensors and the metadata."""
    safe_open = pytest.importorskip("safetensors", reason="the safetensors package is not installed").safe_open
    tree = {"w": scalify.as_scaled_array(sample((4, 64)), fmt=qf.NVFP4), "c": scalify.as_scaled_array(sample())}
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, tree)
    with safe_open(str(p), framework="numpy") as f:
        assert set(f.keys()) == {"w.data", "w.scale.block", "w.scale.tensor", "c.data", "c.scale"}
        np.testing.assert_array_equal(f.get_tensor("w.data"), np.asarray(tree["w"].data))  # packed fp4 as uint8
        assert f.get_tensor("w.data").dtype == np.uint8
        np.testing.assert_array_equal(f.get_tensor("w.scale.tensor"), np.asarray(tree["w"].scale.tensor))
        np.testing.assert_array_equal(f.get_tensor("c.data"), np.asarray(tree["c"].data))
        meta = f.metadata()
    desc = json.loads(meta["scalify.io.tree"])
    assert meta["scalify.io.version"] == "1"
    assert desc["dict"]["w"]["scaled"]["fmt"] == {"name": "nvfp4", "fields": {}}
    assert desc["dict"]["w"]["scaled"]["dtype"] == "float32"
    # The fp8 block scale is stored as F8_E4M3 with its bits.
    header, _ = sf.read_header(p)
    assert header["w.scale.block"]["dtype"] == "F8_E4M3"
    np.testing.assert_array_equal(bits(sf.read_tensor(p, "w.scale.block")), bits(tree["w"].scale.block))


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8"])
def test_readable_by_torch_backend(tmp_path, name):
    pytest.importorskip("torch", reason="torch is not installed: the framework='pt' reader (bf16/fp8) needs it")
    from safetensors import safe_open

    sa = scalify.as_scaled_array(sample((4, 64)), fmt=qf.get_format(name))
    scalify.io.save(tmp_path / "m.safetensors", {"w": sa})
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        data = f.get_tensor("w.data")
        raw = data.view(-1).view(__import__("torch").uint8).numpy()
    np.testing.assert_array_equal(raw, bits(sa.data))


def test_dict_scale_user_format_names(tmp_path):
    sa = scalify.as_scaled_array(sample(), fmt=DICT_FMT)
    scalify.io.save(tmp_path / "u.safetensors", {"w": sa})
    header, _ = sf.read_header(tmp_path / "u.safetensors")
    assert {"w.data", "w.scale.s"} <= set(header)
    assert_same_tree(scalify.io.load(tmp_path / "u.safetensors"), {"w": sa})


def test_root_leaf_and_64_bit_leaves(tmp_path):
    sa = scalify.as_scaled_array(sample(), fmt=qf.MXFP4)
    scalify.io.save(tmp_path / "a.safetensors", sa)
    assert_same_tree(scalify.io.load(tmp_path / "a.safetensors"), sa)
    x = np.arange(3, dtype=np.float64) / 3
    scalify.io.save(tmp_path / "b.safetensors", {"x": x})
    back = scalify.io.load(tmp_path / "b.safetensors")["x"]
    np.testing.assert_array_equal(bits(back), bits(x))  # kept as NumPy when x64 is off


def test_save_errors(tmp_path):
    with pytest.raises(scalify.io.ScalifyIOError, match="collides"):
        scalify.io.save(tmp_path / "a.safetensors", {"a.b": jnp.ones(2), "a": {"b": jnp.ones(2)}})
    with pytest.raises(scalify.io.ScalifyIOError, match="dict keys must be strings"):
        scalify.io.save(tmp_path / "a.safetensors", {1: jnp.ones(2)})
    with pytest.raises(scalify.io.ScalifyIOError, match="got object"):
        scalify.io.save(tmp_path / "a.safetensors", {"x": object()})
    with pytest.raises(scalify.io.ScalifyIOError, match="traced value"):
        jax.jit(lambda x: scalify.io.save(tmp_path / "a.safetensors", {"x": x}))(jnp.ones(2))
    assert not list(tmp_path.iterdir())


def _saved(tmp_path):
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, {"w": scalify.as_scaled_array(sample(), fmt=qf.MXFP8)})
    return p


def _rewrite_meta(p, edit):
    header, _ = sf.read_header(p)
    tensors = dict(sf.iter_tensors(p))
    meta = edit(dict(header["__metadata__"]))
    sf.write(p, tensors, meta)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors: no such file"):
        scalify.io.load(tmp_path / "missing.safetensors")
    p = _saved(tmp_path)
    _rewrite_meta(p, lambda m: {**m, "scalify.io.tree": m["scalify.io.tree"].replace('"mxfp8"', '"mxfp99"')})
    with pytest.raises(qf.UnknownFormatError, match="'mxfp99' is not registered") as e:
        scalify.io.load(p)
    assert str(p) in str(e.value)
    _rewrite_meta(p, lambda m: {**m, "scalify.io.tree": "{not json"})
    with pytest.raises(scalify.io.ScalifyIOError, match="not valid JSON"):
        scalify.io.load(p)
    _rewrite_meta(p, lambda m: {**m, "scalify.io.version": "2"})
    with pytest.raises(scalify.io.ScalifyIOError, match="format version '2'"):
        scalify.io.load(p)
    p.write_bytes(p.read_bytes()[:100])  # corrupted: truncated header
    with pytest.raises(sf.SafetensorsError, match="header length field"):
        scalify.io.load(p)


def test_load_other_files_delegates_to_read_checkpoint(tmp_path, monkeypatch):
    """Paths not written by save go to qformats.read_checkpoint; QuantizedTensors become ScaledArrays."""
    x = sample((4, 64))
    data, scale = qf.MXFP4.quantize(x)
    calls = []

    class QT(tuple):  # stands in for qformats.QuantizedTensor (fmt, data, scale)
        dtype = jnp.dtype(jnp.bfloat16)

    def fake_read_checkpoint(path):
        calls.append(path)
        return {"proj.weight": QT((qf.MXFP4, np.asarray(data), np.asarray(scale))), "norm": np.ones(4, np.float32)}

    monkeypatch.setattr(qf, "read_checkpoint", fake_read_checkpoint, raising=False)
    plain = tmp_path / "plain.safetensors"
    sf.write(plain, {"x": np.ones(2, np.float32)})
    for p in (plain, tmp_path, tmp_path / "model.gguf"):
        if p.suffix == ".gguf":
            p.write_bytes(b"GGUF")
        out = scalify.io.load(p)
        assert calls[-1] == p
        w = out["proj.weight"]
        assert isinstance(w, scalify.ScaledArray) and w.fmt == qf.MXFP4 and w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(bits(w.data), bits(data))
        np.testing.assert_array_equal(bits(w.scale), bits(scale))
        np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(qf.MXFP4.dequantize(data, scale)))
        assert isinstance(out["norm"], jax.Array)


def test_load_other_files_without_read_checkpoint(tmp_path, monkeypatch):
    monkeypatch.delattr(qf, "read_checkpoint", raising=False)
    plain = tmp_path / "plain.safetensors"
    sf.write(plain, {"x": np.ones(2, ml_dtypes.bfloat16)})
    with pytest.raises(scalify.io.ScalifyIOError, match=r"plain\.safetensors: has no 'scalify\.io\.tree'") as e:
        scalify.io.load(plain)
    assert "read_checkpoint" in str(e.value) and "scalify.io.save" in str(e.value)


def test_load_plain_safetensors_through_the_real_read_checkpoint(tmp_path):
    """Integration with qformats.read_checkpoint (when this qformats has it): an unquantized file."""
    if not hasattr(qf, "read_checkpoint"):
        pytest.skip("this qformats has no read_checkpoint (published-checkpoint readers not installed)")
    tensors = {"a": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3), "b": np.ones(4, np.int32)}
    sf.write(tmp_path / "model.safetensors", tensors)
    out = scalify.io.load(tmp_path / "model.safetensors")
    assert set(out) == set(tensors)
    for k, v in tensors.items():
        assert isinstance(out[k], jax.Array) and out[k].dtype == v.dtype
        np.testing.assert_array_equal(bits(out[k]), bits(v))
