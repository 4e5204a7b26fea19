"""read_checkpoint against the producers' own dequantized values (bit for bit).

The reference folders (``shared/vectors/checkpoints``) were written by compressed-tensors, ModelOpt,
transformers' gpt-oss path and the gguf package; ``reference.npz`` holds each library's own
dequantization. -0.0 and +0.0 compare equal; every other bit must match.
"""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import qformats as qf
from qformats import _safetensors

FOLDERS = [
    "nvfp4_bfloat16",
    "nvfp4_float32",
    "nvfp4a16_bfloat16",
    "mxfp4a16_bfloat16",
    "fp8_tensor_bfloat16",
    "fp8_channel_bfloat16",
    "fp8_block128_bfloat16",
    "fp8_block128_ragged_N300_K576_bfloat16",
    "w4a16_bfloat16",
    "w4a16_asym_bfloat16",
    "modelopt_nvfp4_bfloat16",
]
EXPECTED_FORMAT = {
    "nvfp4_bfloat16": "ct_nvfp4",
    "nvfp4_float32": "ct_nvfp4",
    "nvfp4a16_bfloat16": "ct_nvfp4",
    "mxfp4a16_bfloat16": "ct_mxfp4",
    "fp8_tensor_bfloat16": "ct_fp8_tensor",
    "fp8_channel_bfloat16": "ct_fp8_channel",
    "fp8_block128_bfloat16": "ct_fp8_block128",
    "fp8_block128_ragged_N300_K576_bfloat16": "ct_fp8_block128",
    "w4a16_bfloat16": "ct_int4_g128",
    "w4a16_asym_bfloat16": "ct_int4_g128_asym",
    "modelopt_nvfp4_bfloat16": "modelopt_nvfp4",
}


def ref_bits(ref, key):
    """(bits, dtype) of a reference array: bf16 as uint16 bits, else float32 bits."""
    if key + "__bf16_bits" in ref:
        return ref[key + "__bf16_bits"], np.dtype(ml_dtypes.bfloat16)
    return ref[key].astype(np.float32).view(np.uint32), np.dtype(np.float32)


def assert_bits_equal(got, want_bits):
    got = np.asarray(got)
    bits = got.view(np.uint16 if got.dtype.itemsize == 2 else np.uint32)
    assert bits.shape == want_bits.shape
    sign = np.array(1 << (8 * got.dtype.itemsize - 1), bits.dtype)
    same = (bits == want_bits) | (((bits | want_bits) & ~sign) == 0)  # -0.0 == +0.0
    assert same.all(), f"{(~same).sum()} of {same.size} values differ, first at {np.argwhere(~same)[:3].tolist()}"


@pytest.mark.parametrize("folder", FOLDERS)
def test_dequantize_matches_producer(ckpt_root, folder):
    d = os.path.join(ckpt_root, folder)
    ref = np.load(os.path.join(d, "reference.npz"))
    out = qf.read_checkpoint(d)
    qt = out["proj.weight"]
    assert isinstance(qt, qf.QuantizedTensor)
    assert qt.fmt.name == EXPECTED_FORMAT[folder]
    assert qf.get_format(qt.fmt.name).name == qt.fmt.name  # registered
    want, dtype = ref_bits(ref, "dequant_ref")
    assert qt.dtype == dtype
    got = qt.fmt.dequantize(qt.data, qt.scale, dtype)
    assert_bits_equal(got, want)
    assert qt.shape == want.shape


@pytest.mark.parametrize("folder", FOLDERS)
def test_names_and_stays_quantized(ckpt_root, folder):
    d = os.path.join(ckpt_root, folder)
    stored = json.load(open(os.path.join(d, "summary.json")))["stored_tensors"]
    out = qf.read_checkpoint(d)
    activation = {k for k in stored if ".input_" in k}
    assert set(out) == {"proj.weight"} | activation
    for k in activation:
        assert isinstance(out[k], np.ndarray)
    qt = out["proj.weight"]
    n, k = json.load(open(os.path.join(d, "summary.json")))["weight_shape_NK"]
    assert qt.shape == (n, k)
    import jax

    assert all(np.asarray(a).dtype.itemsize <= 4 for a in jax.tree.leaves((qt.data, qt.scale)))
    assert np.asarray(qt.data).nbytes <= n * k  # never dense: 8 bits or less per element
    assert np.asarray(qt.data).dtype in (np.uint8, np.int32, np.dtype(ml_dtypes.float8_e4m3fn))


@pytest.mark.parametrize("folder", FOLDERS)
def test_quantize_matches_producer_bytes(ckpt_root, folder):
    """The format's quantize, on the producer's input weight, writes the producer's bytes."""
    import jax

    d = os.path.join(ckpt_root, folder)
    ref = np.load(os.path.join(d, "reference.npz"))
    qt = qf.read_checkpoint(d)["proj.weight"]
    w = ref["weight_original"]
    if "weight_original__bf16_bits" in ref:
        w = ref["weight_original__bf16_bits"].view(ml_dtypes.bfloat16)
    for quantize in (qt.fmt.quantize, jax.jit(qt.fmt.quantize)):
        data, scale = quantize(w)
        got = jax.tree.leaves((data, scale))
        want = jax.tree.leaves((qt.data, qt.scale))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize
            u = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
            np.testing.assert_array_equal(a.view(u), b.view(u))


def test_gptoss_experts(ckpt_root):
    d = os.path.join(ckpt_root, "gptoss_mxfp4")
    ref = np.load(os.path.join(d, "reference.npz"))
    out = qf.read_checkpoint(d)
    pre = "model.layers.0.mlp.experts."
    for proj in ("gate_up_proj", "down_proj"):
        qt = out[pre + proj]
        assert qt.fmt.name == "ct_mxfp4"
        want, dtype = ref_bits(ref, f"dequant_ref/{proj}")  # transformers: [E, in, out]
        e, kin, nout = want.shape
        assert qt.shape == (e, nout, kin)  # the file's [E, out, in]
        got = qt.fmt.dequantize(qt.data, qt.scale, dtype)
        assert_bits_equal(np.asarray(got), np.swapaxes(want, 1, 2))
        assert not any(k.startswith(pre + proj + "_") and k.endswith(("_blocks", "_scales")) for k in out)
    assert out[pre + "gate_up_proj_bias"].dtype == ml_dtypes.bfloat16  # plain tensors stay as stored


def test_modelopt_tinyllama_names(ckpt_root):
    d = os.path.join(ckpt_root, "modelopt_nvfp4_hf_export_tinyllama")
    out = qf.read_checkpoint(d)
    header, _ = _safetensors.read_header(os.path.join(d, "model.safetensors"))
    q = {k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "U8"}
    assert {k for k, v in out.items() if isinstance(v, qf.QuantizedTensor)} == q
    assert not any(k.endswith(("weight_scale", "weight_scale_2")) for k in out)
    for k in q:
        qt = out[k]
        n, kb = header[k]["shape"]
        assert qt.shape == (n, 2 * kb) and qt.fmt.name == "modelopt_nvfp4" and qt.dtype == ml_dtypes.bfloat16
        assert np.isfinite(np.asarray(qt.dequantize(), np.float32)).all()
    assert out["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert "model.layers.0.self_attn.q_proj.input_scale" in out


def _check_gguf(folder):
    ref = np.load(os.path.join(folder, "reference.npz"))
    out = qf.read_checkpoint(os.path.join(folder, "model.gguf"))
    names = {k.split("/", 1)[1] for k in ref.files if k.startswith("dequant_ref/")}
    assert set(out) == names
    kinds = {}
    for name in names:
        want = ref[f"dequant_ref/{name}"]
        v = out[name]
        if isinstance(v, qf.QuantizedTensor):
            kinds[name] = v.fmt.name
            assert v.shape == want.shape
            got = np.asarray(v.fmt.dequantize(v.data, v.scale, np.float32))
            # the format's quantize writes gguf's own codes and scales
            data, scale = v.fmt.quantize(ref[f"weight_original/{name}"])
            np.testing.assert_array_equal(np.asarray(data), v.data)
            np.testing.assert_array_equal(np.asarray(scale).view(np.uint16), v.scale.view(np.uint16))
        else:
            got = v
        assert got.shape == want.shape
        assert_bits_equal(got.astype(np.float32), want.astype(np.float32).view(np.uint32))
    assert sorted(kinds.values()) == ["gguf_q4_0", "gguf_q8_0"]


def test_gguf_reference(ckpt_root):
    pytest.importorskip("gguf")
    _check_gguf(os.path.join(ckpt_root, "gguf_q8_q4"))


@pytest.mark.parametrize("seed,rows,cols", [(1, 16, 64), (7, 3, 96), (123, 40, 512)])
def test_gguf_generated(ckpt_root, tmp_path, seed, rows, cols):
    """More cases, written by the gguf package itself (make/make_gguf.py)."""
    pytest.importorskip("gguf")
    script = os.path.join(ckpt_root, "make", "make_gguf.py")
    subprocess.run(
        [sys.executable, script, str(tmp_path), str(seed), str(rows), str(cols)], check=True, capture_output=True
    )
    _check_gguf(str(tmp_path))


@pytest.mark.parametrize("folder", ["nvfp4_bfloat16", "w4a16_asym_bfloat16", "gptoss_mxfp4"])
def test_mmap_gives_the_same_tensors(ckpt_root, folder):
    import jax

    def leaves(v):
        return jax.tree.leaves((v.data, v.scale)) if isinstance(v, qf.QuantizedTensor) else [v]

    d = os.path.join(ckpt_root, folder)
    a, b = qf.read_checkpoint(d), qf.read_checkpoint(d, mmap=True)
    assert set(a) == set(b)
    for k in a:
        if isinstance(b[k], qf.QuantizedTensor):
            data = b[k].data
            assert isinstance(data, np.memmap) or isinstance(data.base, np.memmap)  # no copy
        for x, y in zip(leaves(a[k]), leaves(b[k]), strict=True):
            np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


def test_quantized_tensor_is_a_pytree(ckpt_root):
    import jax

    qt = qf.read_checkpoint(os.path.join(ckpt_root, "nvfp4a16_bfloat16"))["proj.weight"]
    assert len(jax.tree.leaves(qt)) == 3  # data, block scale, tensor scale; the format is static
    got = jax.jit(lambda t: t.dequantize())(qt)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(qt.dequantize()).view(np.uint16))
    moved = jax.device_put(qt)
    assert isinstance(moved, qf.QuantizedTensor) and moved.fmt == qt.fmt
