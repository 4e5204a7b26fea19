"""Writers for published layouts: GGUF (Q8_0, Q4_0) and compressed-tensors (NVFP4, MXFP4, FP8, int4).

Both take ``{name: QuantizedTensor | np.ndarray}``, as :func:`qformats.read_checkpoint` returns it
(so a checkpoint read can be written back unchanged), where each quantized tensor's format is one of
the checkpoint storage formats (make one with ``QuantizedTensor(fmt, *fmt.quantize(w))``, e.g. with
``fmt = qf.get_format("ct_nvfp4")``).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from qformats import _safetensors
from qformats._checkpoint import CheckpointError, QuantizedTensor
from qformats._fmt_fp4ckpt import MXFP4CheckpointFormat, NVFP4CheckpointFormat
from qformats._fmt_fp8ckpt import FP8CheckpointFormat
from qformats._fmt_gguf import GGUFQ4_0Format, GGUFQ8_0Format
from qformats._fmt_int4 import Int4GroupFormat, Int4Scale


def _np(x):
    return np.asarray(jax.device_get(x))


# -- GGUF ---------------------------------------------------------------------------------------------
def write_gguf(path, tensors: dict, *, arch: str = "llama", metadata: dict | None = None) -> None:
    """Write ``tensors`` to a ``.gguf`` file with the ``gguf`` package's ``GGUFWriter``.

    Quantized tensors must be ``gguf_q8_0`` / ``gguf_q4_0``: each block is written as its float16
    ``d`` followed by its codes (34 / 18 bytes). Arrays are written as F32, F16 or BF16. Names and
    shapes are taken as given (NumPy orientation; GGUF stores the shape reversed). ``metadata`` adds
    string/int/float key-value pairs.
    """
    from qformats._ckpt_gguf import _gguf

    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (metadata or {}).items():
        {str: w.add_string, int: w.add_int64, float: w.add_float32}[type(v)](k, v)
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            if isinstance(t.fmt, GGUFQ8_0Format):
                kind, codes = T.Q8_0, _np(t.data).astype(np.int8).view(np.uint8)
            elif isinstance(t.fmt, GGUFQ4_0Format):
                kind, codes = T.Q4_0, _np(t.data).astype(np.uint8)
            else:
                raise CheckpointError(
                    f"{name}: format {t.fmt.name!r} has no GGUF type; GGUF takes gguf_q8_0 and gguf_q4_0 "
                    f"(re-quantize with qf.get_format('gguf_q8_0').quantize(values))."
                )
            d = _np(t.scale).astype(np.float16)
            nb = d.shape[-1]
            blocks = np.concatenate([d[..., None].view(np.uint8), codes.reshape(*d.shape, -1)], axis=-1)
            w.add_tensor(name, blocks.reshape(*d.shape[:-1], nb * blocks.shape[-1]), raw_dtype=kind)
        else:
            a = np.asarray(t)
            if a.dtype.name == "bfloat16":
                w.add_tensor(name, a.view(np.uint16), raw_shape=a.shape, raw_dtype=T.BF16)
            elif a.dtype in (np.float32, np.float16):
                w.add_tensor(name, a)
            else:
                raise CheckpointError(f"{name}: dtype {a.dtype} cannot be written to GGUF (use float32/16 or bfloat16)")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# -- compressed-tensors --------------------------------------------------------------------------------
def _ct_entry(name, t: QuantizedTensor):
    """``(format name, weights args, {stored name: array})`` for one quantized weight ``name``."""
    if not name.endswith(".weight"):
        raise CheckpointError(f"{name}: compressed-tensors stores quantized tensors as '<module>.weight'")
    f = t.fmt
    if isinstance(f, NVFP4CheckpointFormat) and f.global_scale == "divisor" and f.block_size == 16:
        args = {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.float8_e4m3fn",
        }
        g = np.asarray(_np(t.scale.tensor), np.float32).reshape(1)
        return (
            "nvfp4-pack-quantized",
            args,
            {name + "_packed": _np(t.data), name + "_scale": _np(t.scale.block), name + "_global_scale": g},
        )
    if isinstance(f, MXFP4CheckpointFormat) and f.block_size == 32:
        args = {
            "num_bits": 4,
            "type": "float",
            "strategy": "group",
            "group_size": 32,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.uint8",
        }
        s = _np(t.scale)
        s = s.view(np.uint8) if s.dtype.itemsize == 1 else s.astype(np.uint8)
        return "mxfp4-pack-quantized", args, {name + "_packed": _np(t.data), name + "_scale": s}
    if isinstance(f, FP8CheckpointFormat):
        args = {"num_bits": 8, "type": "float", "strategy": f.granularity, "symmetric": True, "dynamic": False}
        if f.granularity == "block":
            args["block_structure"] = list(f.block)
        s = _np(t.scale)
        if f.granularity == "tensor":
            s = s.reshape(1)
        return "float-quantized", args, {name: _np(t.data), name + "_scale": s}
    if isinstance(f, Int4GroupFormat):
        args = {
            "num_bits": 4,
            "type": "int",
            "strategy": "group",
            "group_size": f.group_size,
            "symmetric": f.symmetric,
            "dynamic": False,
        }
        data = _np(t.data)
        out = {name + "_packed": data, name + "_shape": np.array([*data.shape[:-1], data.shape[-1] * 8], np.int64)}
        if f.symmetric:
            out[name + "_scale"] = _np(t.scale)
        else:
            sc: Int4Scale = t.scale
            out[name + "_scale"] = _np(sc.scale)
            out[name + "_zero_point"] = _np(sc.zero_point)
        return "pack-quantized", args, out
    raise CheckpointError(
        f"{name}: format {f.name!r} has no compressed-tensors layout; supported: ct_nvfp4, ct_mxfp4, "
        f"ct_fp8_tensor/channel/block128, ct_int4_g128(_asym)."
    )


def write_compressed_tensors(folder, tensors: dict, *, config: dict | None = None) -> Path:
    """Write ``tensors`` as a compressed-tensors checkpoint: ``model.safetensors`` + ``config.json``.

    Each quantized weight ``<module>.weight`` is stored under compressed-tensors' names (see
    ``docs/checkpoints.md``); ``config.json`` is ``config`` (e.g. the model's own) plus a
    ``quantization_config`` with one config group per (format, weight arguments), targeting the
    modules by name. Arrays are written as they are (activation scales, norms, ...).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stored: dict = {}
    groups: dict = {}
    owner: dict = {}  # stored name -> the input name it comes from
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            fmt, args, arrays = _ct_entry(name, t)
            key = (fmt, json.dumps(args, sort_keys=True))
            groups.setdefault(key, []).append(name[: -len(".weight")])
        else:
            arrays = {name: np.asarray(t)}
        for k, a in arrays.items():
            if k in owner:
                raise CheckpointError(
                    f"tensor names clash after renaming: {k!r} is written for both {owner[k]!r} and {name!r} "
                    f"(a quantized '<module>.weight' is stored as {k!r}); rename or drop one of them."
                )
            owner[k] = name
            stored[k] = a
    config_groups = {
        f"group_{i}": {
            "targets": modules,
            "format": fmt,
            "weights": json.loads(args),
            "input_activations": None,
            "output_activations": None,
        }
        for i, ((fmt, args), modules) in enumerate(sorted(groups.items()))
    }
    formats = {fmt for fmt, _ in groups}
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": [],
        "kv_cache_scheme": None,
    }
    cfg = dict(config or {})
    cfg["quantization_config"] = qcfg
    _safetensors.write(folder / "model.safetensors", stored, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder
