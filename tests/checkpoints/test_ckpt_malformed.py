"""read_checkpoint on hostile folders (issue #14): a tensor in two shards, tensors of the wrong dtype
or rank for their layout. Each is refused with a ValueError naming the file, the tensor and the problem."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qformats as qf
from qformats import _safetensors


def _refused(path, match, *names):
    with pytest.raises(ValueError, match=match) as e:
        qf.read_checkpoint(path)
    for n in names:
        assert str(n) in str(e.value), (n, str(e.value))
    return str(e.value)


def _ct(tmp_path, fmt_name, shape=(32, 64)):
    fmt = qf.get_format(fmt_name)
    w = jnp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)
    qf.write_compressed_tensors(tmp_path, {"p.weight": qf.QuantizedTensor(fmt, *fmt.quantize(w))})
    return tmp_path


def _replace(folder, name, value):
    p = folder / "model.safetensors"
    tensors = dict(_safetensors.iter_tensors(p))
    tensors[name] = value
    _safetensors.write(p, tensors, {"format": "pt"})
    return p


def test_same_tensor_in_two_shards(tmp_path):
    """Used to be read silently from whichever shard came last."""
    _safetensors.write(tmp_path / "a.safetensors", {"x": np.zeros(2, np.float32), "y": np.ones(2, np.float32)})
    _safetensors.write(tmp_path / "b.safetensors", {"x": np.ones(2, np.float32)})
    _refused(tmp_path, "'x'.*both", "a.safetensors", "b.safetensors")


def test_ct_nvfp4_block_scale_of_the_wrong_dtype(tmp_path):
    """A float32 block scale used to be accepted (and decoded without the e4m3 rounding)."""
    d = _ct(tmp_path, "ct_nvfp4")
    block = _safetensors.read_tensor(d / "model.safetensors", "p.weight_scale")
    p = _replace(d, "p.weight_scale", block.astype(np.float32))
    _refused(d, "F32.*F8_E4M3", p, "p.weight_scale")


def test_ct_nvfp4_packed_of_the_wrong_dtype(tmp_path):
    d = _ct(tmp_path, "ct_nvfp4")
    packed = _safetensors.read_tensor(d / "model.safetensors", "p.weight_packed")
    p = _replace(d, "p.weight_packed", packed.view(np.int8))
    _refused(d, "I8.*U8", p, "p.weight_packed")


def test_ct_fp8_scale_of_an_integer_dtype(tmp_path):
    d = _ct(tmp_path, "ct_fp8_channel")
    p = _replace(d, "p.weight_scale", np.ones((32, 1), np.int32))
    _refused(d, "I32", p, "p.weight_scale")


def test_ct_int4_scale_of_an_integer_dtype(tmp_path):
    d = _ct(tmp_path, "ct_int4_g128", (8, 128))
    p = _replace(d, "p.weight_scale", np.ones((8, 1), np.int32))
    _refused(d, "I32", p, "p.weight_scale")


def test_ct_int4_zero_d_packed(tmp_path):
    d = _ct(tmp_path, "ct_int4_g128", (8, 128))
    p = _replace(d, "p.weight_packed", np.int32(3))
    _refused(d, "rank|dimension", p, "p.weight_packed")


def test_ct_mxfp4_scale_shape(tmp_path):
    d = _ct(tmp_path, "ct_mxfp4")
    p = _replace(d, "p.weight_scale", np.zeros((32, 3), np.uint8))
    _refused(d, "shape", p, "p.weight")


def _modelopt(tmp_path):
    fmt = qf.get_format("modelopt_nvfp4")
    w = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)).astype(jnp.bfloat16)
    data, scale = fmt.quantize(w)
    tensors = {
        "p.weight": np.asarray(data),
        "p.weight_scale": np.asarray(scale.block),
        "p.weight_scale_2": np.asarray(scale.tensor, np.float32),
    }
    _safetensors.write(tmp_path / "model.safetensors", tensors)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    return tmp_path, tensors


def test_modelopt_block_scale_of_the_wrong_dtype(tmp_path):
    d, t = _modelopt(tmp_path)
    assert isinstance(qf.read_checkpoint(d)["p.weight"], qf.QuantizedTensor)
    p = _replace(d, "p.weight_scale", t["p.weight_scale"].view(np.uint8))
    _refused(d, "U8.*F8_E4M3", p, "p.weight_scale")


def test_modelopt_scale_2_of_the_wrong_dtype(tmp_path):
    d, _ = _modelopt(tmp_path)
    p = _replace(d, "p.weight_scale_2", np.ones((), ml_dtypes.float8_e4m3fn))
    _refused(d, "F8_E4M3", p, "p.weight_scale_2")


def test_gptoss_blocks_of_the_wrong_dtype(tmp_path):
    tensors = {
        "e.gate_up_proj_blocks": np.zeros((2, 4, 2, 16), np.int8),
        "e.gate_up_proj_scales": np.full((2, 4, 2), 127, np.uint8),
    }
    _safetensors.write(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    _refused(tmp_path, "I8.*U8", tmp_path / "model.safetensors", "e.gate_up_proj_blocks")


def test_ct_writer_refuses_a_name_written_twice(tmp_path):
    """write_compressed_tensors used to let a plain array overwrite a quantized weight's scale."""
    fmt = qf.get_format("ct_nvfp4")
    w = jnp.ones((32, 64), jnp.bfloat16)
    qt = qf.QuantizedTensor(fmt, *fmt.quantize(w))
    with pytest.raises(qf.CheckpointError, match=r"'p\.weight_scale'"):
        qf.write_compressed_tensors(tmp_path, {"p.weight": qt, "p.weight_scale": np.zeros(3, np.float32)})


def test_corrupt_gguf_through_read_checkpoint(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") + b"\0" * 8)
    _refused(p, "tensor count", p)
