"""Writers: GGUF read back by the gguf package itself; compressed-tensors read back by our reader and
decoded from the raw bytes with numpy per the published formulas (independent of the code under test)."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qformats as qf
from qformats import _safetensors

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def weight(n, k, seed=0, dtype=ml_dtypes.bfloat16):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :64] = 0
    w[2, 5] = 3.0
    return w.astype(dtype)


def nibbles(u8):
    return np.stack([u8 & 0xF, u8 >> 4], -1).reshape(*u8.shape[:-1], -1)


def to_bf16_bits(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same(a, b):
    a, b = bits(a), bits(b)
    sign = np.array(1 << (8 * a.dtype.itemsize - 1), a.dtype)
    assert a.shape == b.shape
    assert ((a == b) | (((a | b) & ~sign) == 0)).all()


def test_gguf_roundtrip_through_gguf_reader(tmp_path):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(5)
    x8 = rng.standard_normal((8, 96)).astype(np.float32)
    x4 = (rng.standard_normal((6, 64)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)
    q8, q4 = qf.get_format("gguf_q8_0"), qf.get_format("gguf_q4_0")
    tensors = {
        "a.weight": qf.QuantizedTensor(q8, *q8.quantize(x8)),
        "b.weight": qf.QuantizedTensor(q4, *q4.quantize(x4)),
        "norm.weight": rng.standard_normal(16).astype(np.float32),
    }
    qf.write_gguf(tmp_path / "m.gguf", tensors)
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    by = {t.name: t for t in r.tensors}
    T = gguf.GGMLQuantizationType
    assert by["a.weight"].tensor_type == T.Q8_0 and by["b.weight"].tensor_type == T.Q4_0
    for name, x, qt in (("a.weight", x8, T.Q8_0), ("b.weight", x4, T.Q4_0)):
        t = tensors[name]
        got = gguf.quants.dequantize(by[name].data, by[name].tensor_type).reshape(x.shape)
        np.testing.assert_array_equal(got, np.asarray(t.dequantize(np.float32)))
        # the bytes are those gguf's own quantizer writes
        np.testing.assert_array_equal(np.asarray(by[name].data), gguf.quants.quantize(x, qt))
    np.testing.assert_array_equal(np.asarray(by["norm.weight"].data), tensors["norm.weight"])
    back = qf.read_checkpoint(tmp_path / "m.gguf")
    np.testing.assert_array_equal(back["a.weight"].data, np.asarray(tensors["a.weight"].data))


def numpy_decode(folder, name):
    """Decode ``name`` from the raw safetensors bytes and config.json with the published formulas."""
    cfg = json.load(open(folder / "config.json"))["quantization_config"]
    path = folder / "model.safetensors"
    header, _ = _safetensors.read_header(path)
    t = {k: _safetensors.read_tensor(path, k) for k in header if k != "__metadata__" and k.startswith(name)}
    fmt = next(g["format"] for g in cfg["config_groups"].values() if name[: -len(".weight")] in g["targets"])
    if fmt == "nvfp4-pack-quantized":
        q = E2M1[nibbles(t[name + "_packed"])]
        eff = t[name + "_scale"].astype(np.float32) / t[name + "_global_scale"].astype(np.float32)[0]
        n, k = q.shape
        return to_bf16_bits((q.reshape(n, -1, 16) * eff[..., None]).reshape(n, k))
    if fmt == "mxfp4-pack-quantized":
        q = E2M1[nibbles(t[name + "_packed"])]
        n, k = q.shape
        e = t[name + "_scale"].astype(np.int32) - 127
        return to_bf16_bits(np.ldexp(q.reshape(n, -1, 32), e[..., None]).astype(np.float32).reshape(n, k))
    if fmt == "float-quantized":
        q = t[name].astype(np.float32)
        s = t[name + "_scale"]
        n, k = q.shape
        if s.size == 1:
            full = np.full((n, k), s.astype(np.float32)[0])
        elif s.shape == (n, 1):
            full = np.broadcast_to(s.astype(np.float32), (n, k))
        else:
            full = np.repeat(np.repeat(s.astype(np.float32), 128, 0), 128, 1)[:n, :k]
        return (q * full).astype(s.dtype).view(np.uint16)
    if fmt == "pack-quantized":
        words = t[name + "_packed"]
        n = words.shape[0]
        q = nibbles(words.astype("<i4").view(np.uint8).reshape(n, -1)).astype(np.int32) - 8
        s = t[name + "_scale"]
        g = s.shape[1]
        zp = np.zeros((n, g), np.int32)
        if name + "_zero_point" in t:
            zw = t[name + "_zero_point"]
            zu8 = np.ascontiguousarray(zw.T).astype("<i4").view(np.uint8).reshape(g, -1)
            zp = (nibbles(zu8)[:, :n].astype(np.int32) - 8).T
        x = (q.reshape(n, g, -1) - zp[..., None]).astype(np.float32) * s.astype(np.float32)[..., None]
        return x.reshape(n, -1).astype(s.dtype).view(np.uint16)
    raise AssertionError(fmt)


CT_FORMATS = [
    "ct_nvfp4",
    "ct_mxfp4",
    "ct_fp8_tensor",
    "ct_fp8_channel",
    "ct_fp8_block128",
    "ct_int4_g128",
    "ct_int4_g128_asym",
]


def test_compressed_tensors_roundtrip(tmp_path):
    tensors = {}
    for i, name in enumerate(CT_FORMATS):
        fmt = qf.get_format(name)
        shape = (300, 576) if name == "ct_fp8_block128" else (64, 256)
        w = weight(*shape, seed=i)
        tensors[f"layers.{i}.proj.weight"] = qf.QuantizedTensor(fmt, *fmt.quantize(jnp.asarray(w)))
    tensors["layers.0.proj.input_global_scale"] = np.array([3.0], np.float32)
    tensors["norm.weight"] = np.ones(8, ml_dtypes.bfloat16)
    qf.write_compressed_tensors(tmp_path, tensors, config={"architectures": ["Test"], "torch_dtype": "bfloat16"})
    back = qf.read_checkpoint(tmp_path)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        b = back[name]
        if isinstance(t, qf.QuantizedTensor):
            assert b.fmt == t.fmt
            import jax

            for x, y in zip(jax.tree.leaves((t.data, t.scale)), jax.tree.leaves((b.data, b.scale)), strict=True):
                x, y = np.asarray(x), np.asarray(y)
                assert x.shape == y.shape
                np.testing.assert_array_equal(bits(x), bits(y))
            got = np.asarray(b.dequantize())
            assert_same(got, numpy_decode(tmp_path, name))
        else:
            np.testing.assert_array_equal(bits(b), bits(t))
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["Test"]
    assert cfg["quantization_config"]["format"] == "mixed-precision"


def test_writers_refuse_other_formats(tmp_path):
    fmt = qf.get_format("modelopt_nvfp4")
    t = qf.QuantizedTensor(fmt, *fmt.quantize(jnp.ones((4, 32), jnp.float32)))
    with pytest.raises(qf.CheckpointError, match="no compressed-tensors layout"):
        qf.write_compressed_tensors(tmp_path, {"p.weight": t})
    pytest.importorskip("gguf")
    with pytest.raises(qf.CheckpointError, match="no GGUF type"):
        qf.write_gguf(tmp_path / "x.gguf", {"p.weight": t})
