"""Bit-exact conformance against the reference vectors (torchao and microxcaling outputs).

Exclusions, all computed independently of the code under test:

* float32 subnormal inputs and outputs: XLA on CPU flushes them to zero in arithmetic, so a value
  whose input or reference output is a nonzero float32 subnormal is not compared;
* microxcaling's MXINT8 scale uses a float32 ``log2``, one too large for some amax just below a
  power of two and for FLT_MAX; those blocks are found by comparing numpy's float32 log2 with the
  exact exponent, and excluded. Its zero blocks get exponent -126 instead of -127 (the data are zero
  either way, and the dequantized values are still compared).
"""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qformats as qf

TINY = np.finfo(np.float32).tiny

MX = {
    "mxfp8_e4m3": qf.MXFP8,
    "mxfp8_e5m2": qf.MXFP8_E5M2,
    "mxfp6_e2m3": qf.MXFP6_E2M3,
    "mxfp6_e3m2": qf.MXFP6_E3M2,
    "mxfp4_e2m1": qf.MXFP4,
    "mxint8": qf.MXINT8,
}


def _format_for(meta):
    f, mode = meta["format"], meta["scale_mode"]
    if f in MX:
        return MX[f].replace(scale_mode=mode)
    if f == "nvfp4":
        return qf.NVFP4.replace(tensor_scale=(mode == "two_level"))
    if f == "per_tensor_fp8_e4m3":
        return qf.FP8_E4M3.replace(scale_mode="exact")
    if f == "per_tensor_fp8_e5m2":
        return qf.FP8_E5M2.replace(scale_mode="exact")
    return None


def _cases():
    root = os.environ.get("QFORMATS_VECTORS", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "vectors"))
    files = sorted(glob.glob(os.path.join(root, "torchao-main_*.npz")))
    files += sorted(glob.glob(os.path.join(root, "microxcaling_mxint8_even*.npz")))
    out = [os.path.basename(p) for p in files if "per_channel" not in p]
    return out or ["<no vectors found>"]


def _subnormal(a):
    return (a != 0) & (np.abs(a) < TINY)


def _bits_equal(a, b):
    return (a.view(np.int32) == b.view(np.int32)) | (np.isnan(a) & np.isnan(b))


def _microxcaling_log2_blocks(x, block=32):
    """Blocks where float32 log2(amax) floors to a different exponent than the exact one."""
    amax = np.abs(x).reshape(x.shape[0], -1, block).max(-1)
    with np.errstate(divide="ignore"):
        approx = np.floor(np.log2(amax.astype(np.float32)))
    exact = np.frexp(amax)[1].astype(np.float64) - 1
    return (approx != exact) & (amax > 0) & np.isfinite(amax)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", _cases())
def test_reference_vectors(name, jit, vectors_dir):
    d = np.load(os.path.join(vectors_dir, name))
    meta = json.loads(str(d["meta"]))
    fmt = _format_for(meta)
    assert fmt is not None, f"no format mapping for {meta['format']}"
    x = d["x"]
    quantize, dequantize = (jax.jit(fmt.quantize), jax.jit(fmt.dequantize)) if jit else (fmt.quantize, fmt.dequantize)
    data, scale = quantize(jnp.asarray(x))
    deq = np.asarray(dequantize(data, scale))
    ref = d["dequant"]
    compared = ~(_subnormal(x) | _subnormal(ref))
    skip_blocks = np.zeros((ref.shape[0], ref.shape[1] // 32), bool)
    if meta["impl"] == "microxcaling":
        skip_blocks = _microxcaling_log2_blocks(x)
        compared &= ~np.repeat(skip_blocks, 32, axis=1)
    assert compared.sum() > 0.5 * x.size
    if meta["format"].startswith("per_tensor"):
        # torchao stores r = max / amax; we store the multiplier amax / max (float32 divisions both)
        amax = np.abs(x).max()
        assert np.asarray(scale) == np.float32(amax) / np.float32(fmt.max_value)
        assert d["scale_f32"] == np.float32(fmt.max_value) / np.float32(amax)
    same = _bits_equal(deq, ref)
    if isinstance(fmt.element, qf.IntElement):
        same |= (deq == 0) & (ref == 0)  # an integer code has no negative zero; microxcaling keeps -0.0
    bad = ~same & compared
    assert not bad.any(), f"{bad.sum()} mismatches, first at {np.argwhere(bad)[:5].tolist()}"
    if "scale_e8m0" in d.files:
        byte = np.asarray(lax.bitcast_convert_type(scale, jnp.uint8))
        ok = byte == d["scale_e8m0"]
        if meta["impl"] == "microxcaling":
            zero_blocks = np.abs(x).reshape(x.shape[0], -1, 32).max(-1) == 0
            ok |= skip_blocks | zero_blocks
        assert ok.all(), f"scale bytes differ at {np.argwhere(~ok)[:5].tolist()}"
    if "scale_e4m3_code" in d.files:
        code = np.asarray(lax.bitcast_convert_type(scale.block, jnp.uint8))
        np.testing.assert_array_equal(code, d["scale_e4m3_code"])
        if meta["scale_mode"] == "two_level":
            np.testing.assert_array_equal(np.asarray(scale.tensor), d["per_tensor_scale"])
    # Element codes are only defined where the block scale is finite (NaN blocks read as NaN anyway).
    s_ref = d["scale_f32"].reshape(-1, 1) if d["scale_f32"].ndim < 2 else d["scale_f32"]
    finite_block = np.isfinite(np.repeat(s_ref, x.shape[1] // s_ref.shape[1], axis=1))
    compared &= finite_block
    if "packed" in d.files and fmt.packed:
        pair_compared = compared[:, 0::2] & compared[:, 1::2]
        np.testing.assert_array_equal(np.asarray(data)[pair_compared], d["packed"][pair_compared])
    if "elem_f32" in d.files:
        elems = np.asarray(fmt.decode(data))
        np.testing.assert_array_equal(elems[compared], d["elem_f32"][compared])


def test_per_channel_int8_against_torchao(vectors_dir):
    """torchao's symmetric int8 uses amax/127.5 and codes down to -128; ours amax/127 in [-127, 127].

    Both are round-to-nearest on their own grid, so our error is within half our step of the input
    and the two dequantized tensors agree to one torchao step.
    """
    d = np.load(os.path.join(vectors_dir, "torchao-main_per_channel_int8.npz"))
    x = d["x"]
    fmt = qf.INT8_PER_CHANNEL.replace(axis=0)
    data, scale = fmt.quantize(jnp.asarray(x))
    deq = np.asarray(fmt.dequantize(data, scale))
    s = np.asarray(scale)
    assert s.shape == (8, 1)
    amax = np.abs(x).max(1, keepdims=True)
    want = np.where(amax == 0, np.float32(1), amax / np.float32(127))  # a true float32 division
    with np.errstate(over="ignore"):  # one step down where 127 * scale would overflow (docs/numerics.md)
        want = np.where(want * np.float32(127) > np.finfo(np.float32).max, np.nextafter(want, np.float32(0)), want)
    np.testing.assert_array_equal(s, want)
    ok = ~_subnormal(x) & (s > 1e-30)
    assert np.all(np.abs(deq - x)[ok] <= np.broadcast_to(s / 2 * (1 + 1e-6), x.shape)[ok])
    ref_step = np.broadcast_to(d["scale_f32"][:, None], x.shape)
    assert np.all(np.abs(deq - d["dequant"])[ok] <= 1.5 * ref_step[ok] + 1e-30)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_tensorwise_float8_against_torchao(element, jit, vectors_dir):
    """torchao's own convention (``fp8_e4m3_tensorwise``: scale ``r = max / amax``, ``data = sat(x * r)``,
    ``value = data / r``) reproduces its per-tensor vectors bit for bit: scale, codes and values."""
    d = np.load(os.path.join(vectors_dir, f"torchao-main_per_tensor_fp8_{element}.npz"))
    fmt = qf.get_format(f"fp8_{element}_tensorwise")
    quantize, dequantize = (jax.jit(fmt.quantize), jax.jit(fmt.dequantize)) if jit else (fmt.quantize, fmt.dequantize)
    data, scale = quantize(jnp.asarray(d["x"]))
    assert np.shape(scale) == () and _bits_equal(np.asarray(scale), d["scale_f32"])
    compared = ~(_subnormal(d["x"]) | _subnormal(d["dequant"]))
    assert compared.sum() > 0.5 * d["x"].size
    np.testing.assert_array_equal(np.asarray(lax.bitcast_convert_type(data, jnp.uint8)), d["elem_code"])
    deq = np.asarray(dequantize(data, scale))
    bad = ~_bits_equal(deq, d["dequant"]) & compared
    assert not bad.any(), f"{bad.sum()} values differ, first at {np.argwhere(bad)[:5].tolist()}"
