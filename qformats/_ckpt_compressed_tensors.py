"""Reader for compressed-tensors checkpoints (the layout llm-compressor writes and vLLM loads).

For ``W[N, K]`` under module prefix ``p``:

* ``nvfp4-pack-quantized``: ``p.weight_packed`` u8 ``[N, K/2]``, ``p.weight_scale`` f8e4m3 ``[N, K/16]``,
  ``p.weight_global_scale`` f32 ``[1]`` (a divisor) -> ``ct_nvfp4`` (bfloat16 output, always);
* ``mxfp4-pack-quantized``: ``p.weight_packed`` u8 ``[N, K/2]``, ``p.weight_scale`` u8 E8M0 ``[N, K/32]``
  -> ``ct_mxfp4`` (bfloat16 output);
* ``float-quantized``: ``p.weight`` f8e4m3 ``[N, K]``, ``p.weight_scale`` in the model dtype, ``[1]``
  (tensor), ``[N, 1]`` (channel) or ``[ceil(N/bn), ceil(K/bk)]`` (block) -> ``ct_fp8_*``;
* ``pack-quantized`` (4-bit int, group strategy): ``p.weight_packed`` i32 ``[N, K/8]``,
  ``p.weight_scale`` ``[N, K/g]``, ``p.weight_shape`` i64 ``[2]``, optional ``p.weight_zero_point`` i32
  ``[ceil(N/8), K/g]`` -> ``ct_int4_g*`` (output in the scale dtype).

Activation parameters (``input_scale``, ``input_global_scale``, ...) and unquantized tensors are
returned as plain arrays under their own names.
"""

from __future__ import annotations

import numpy as np

from qformats._checkpoint import CheckpointError, QuantizedTensor, SafetensorsSource, take_rest, unsupported
from qformats._fmt_checkpoints import (
    CT_FP8_BLOCK128,
    CT_FP8_CHANNEL,
    CT_FP8_TENSOR,
    CT_INT4_G128,
    CT_INT4_G128_ASYM,
    CT_MXFP4,
    CT_NVFP4,
)
from qformats._fmt_int4 import Int4Scale
from qformats._nvfp4 import NVFP4Scale

FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "float-quantized", "pack-quantized")
_ST_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_FLOATS = tuple(_ST_NAMES)


def _groups(qcfg: dict):
    """``[(format, weights args)]`` for every config group."""
    out = []
    default = qcfg.get("format")
    groups = qcfg.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise CheckpointError(f"compressed-tensors config_groups is {type(groups).__name__}, not an object")
    for name, g in groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("weights") or {}, dict):
            raise CheckpointError(f"compressed-tensors config group {name!r} is malformed: {g!r:.200}")
        fmt = g.get("format") or default
        out.append((fmt, g.get("weights") or {}, name))
    if not out:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups")
    return out


def read(source: SafetensorsSource, config: dict) -> dict:
    qcfg = config["quantization_config"]
    groups = _groups(qcfg)
    for fmt, _, gname in groups:
        if fmt not in FORMATS:
            raise unsupported(
                f"compressed-tensors format {fmt!r} (config group {gname!r}) is not supported; "
                f"supported compressed-tensors formats: {', '.join(FORMATS)}."
            )
    status = qcfg.get("quantization_status")
    if status not in (None, "compressed"):
        raise unsupported(f"compressed-tensors quantization_status={status!r}: only 'compressed' checkpoints are read.")
    formats = {f for f, _, _ in groups}
    out: dict = {}
    used: set = set()
    names = source.names()
    for n in names:
        if n.endswith(".weight_packed"):
            base = n[: -len("_packed")]
            if source.dtype(n) == "I32":
                out[base] = _int4(source, base, groups, used)
            elif "nvfp4-pack-quantized" in formats and base + "_global_scale" in source:
                out[base] = _nvfp4(source, base, used)
            elif "mxfp4-pack-quantized" in formats:
                out[base] = _mxfp4(source, base, used)
            else:
                raise unsupported(f"{n}: packed weight ({source.dtype(n)}) does not fit the config's formats {formats}")
        elif n.endswith(".weight") and source.dtype(n) == "F8_E4M3" and n + "_scale" in source:
            out[n] = _fp8(source, n, groups, config, used)
    return take_rest(source, used, out)


def _take(source, used, name, dtypes, role, ndim=0):
    """Read ``name`` after checking its dtype and rank in the header."""
    if name not in source:
        raise CheckpointError(
            f"{source.location()}: compressed-tensors checkpoint: expected tensor {name!r} ({role}) is missing"
        )
    source.check(name, dtypes, role, ndim=ndim)
    used.add(name)
    return source.read(name)


def _nvfp4(source, base, used):
    data = _take(source, used, base + "_packed", ("U8",), "an NVFP4 packed weight", 1)
    block = _take(source, used, base + "_scale", ("F8_E4M3",), "an NVFP4 block scale", 1)
    g = _take(source, used, base + "_global_scale", _FLOATS, "an NVFP4 global scale").astype(np.float32)
    if g.size != 1:
        raise source.error(base + "_global_scale", f"has shape {g.shape}; expected one value")
    fmt = CT_NVFP4
    _check_shape(source, fmt, base, data, block)
    return QuantizedTensor(fmt, data, NVFP4Scale(block, g.reshape(())))


def _mxfp4(source, base, used):
    data = _take(source, used, base + "_packed", ("U8",), "an MXFP4 packed weight", 1)
    scale = _take(source, used, base + "_scale", ("U8",), "an MXFP4 scale (E8M0 bytes)", 1)
    fmt = CT_MXFP4
    _check_shape(source, fmt, base, data, scale)
    return QuantizedTensor(fmt, data, scale)


def _check_shape(source, fmt, base, data, scale, name=None):
    name = name or base + "_packed"
    try:
        shape = fmt.value_shape(data.shape)
        want = tuple(fmt.scale_shape(shape))
    except (ValueError, TypeError, IndexError) as e:
        raise source.error(name, f"of shape {data.shape} does not fit {fmt.name}: {e}") from None
    got = tuple(np.shape(scale))
    if want != got:
        raise source.error(
            name, f"({base}): scale shape {got} does not fit {fmt.name} for logical shape {shape} (expected {want})"
        )


def _fp8(source, name, groups, config, used):
    data = _take(source, used, name, ("F8_E4M3",), "an FP8 weight", 1)
    scale = _take(source, used, name + "_scale", _FLOATS, "an FP8 weight scale")
    sdt = _ST_NAMES[source.dtype(name + "_scale")]
    strategies = {
        (w.get("strategy"), tuple(w.get("block_structure") or ())) for f, w, _ in groups if f == "float-quantized"
    }
    if scale.size == 1:
        fmt = CT_FP8_TENSOR.replace(scale_dtype=sdt)
        return QuantizedTensor(fmt, data, scale.reshape(()))
    if scale.shape == (*data.shape[:-1], 1):
        fmt = CT_FP8_CHANNEL.replace(scale_dtype=sdt)
        return QuantizedTensor(fmt, data, scale)
    for strategy, blk in strategies:
        if strategy == "block" and len(blk) == 2:
            fmt = CT_FP8_BLOCK128.replace(block=tuple(int(b) for b in blk), scale_dtype=sdt)
            if fmt.block != (128, 128):
                fmt = fmt.replace(name=f"ct_fp8_block{fmt.block[0]}x{fmt.block[1]}")
            if fmt.scale_shape(data.shape) == scale.shape:
                return QuantizedTensor(fmt, data, scale)
    raise unsupported(
        f"{name}: FP8 weight {data.shape} with scale {scale.shape} fits no float-quantized strategy of the "
        f"config ({sorted(strategies)}); supported: tensor [1], channel [N, 1], block [ceil(N/bn), ceil(K/bk)]."
    )


def _int4(source, base, groups, used):
    data = _take(source, used, base + "_packed", ("I32",), "an int4 packed weight", 1)
    scale = _take(source, used, base + "_scale", _FLOATS, "an int4 group scale", 1)
    shape = None
    if base + "_shape" in source:
        shape = tuple(int(s) for s in _take(source, used, base + "_shape", ("I64", "I32"), "a weight shape", 1))
    args = [w for f, w, _ in groups if f == "pack-quantized"]
    if not args:
        raise unsupported(f"{base}_packed is int32-packed but no config group has format 'pack-quantized'")
    symmetric = base + "_zero_point" not in source

    def fits(w):
        gs = int(w.get("group_size") or 0)
        return gs > 0 and gs * scale.shape[-1] == data.shape[-1] * 8 and bool(w.get("symmetric", True)) == symmetric

    w = next((w for w in args if fits(w)), args[0])
    if w.get("num_bits") != 4 or w.get("type", "int") != "int" or w.get("strategy") != "group":
        raise unsupported(
            f"{base}: pack-quantized with num_bits={w.get('num_bits')}, type={w.get('type')}, "
            f"strategy={w.get('strategy')}; only 4-bit int with strategy 'group' is supported."
        )
    k = data.shape[-1] * 8
    if shape is not None and shape[-1] != k:
        raise unsupported(
            f"{base}: logical K={shape[-1]} is not a multiple of 8 (ragged int4 packing is not supported)"
        )
    sdt = _ST_NAMES.get(source.dtype(base + "_scale"))
    gs = int(w.get("group_size") or 0)
    zp_name = base + "_zero_point"
    fmt = (CT_INT4_G128 if symmetric else CT_INT4_G128_ASYM).replace(scale_dtype=sdt)
    if gs != 128:
        fmt = fmt.replace(name=f"ct_int4_g{gs}" + ("" if symmetric else "_asym"), group_size=gs)
    _check_shape(source, fmt, base, data, scale)
    if symmetric:
        return QuantizedTensor(fmt, data, scale)
    zp = _take(source, used, zp_name, ("I32",), "int4 zero points (packed)", 1)
    want = (-(-data.shape[0] // 8), scale.shape[-1])
    if zp.shape != want:
        raise source.error(zp_name, f"has shape {zp.shape}; expected {want} (int4 zero points packed along N)")
    return QuantizedTensor(fmt, data, Int4Scale(scale, zp))
