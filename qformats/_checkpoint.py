"""``read_checkpoint``: published quantized checkpoints as ``(format, data, scale)`` triples.

A checkpoint is read tensor by tensor (never the whole file at once). Each quantized weight comes
back as a :class:`QuantizedTensor` under its logical name (``proj.weight`` for compressed-tensors'
``proj.weight_packed`` + ``proj.weight_scale`` + ...), still quantized; every other tensor comes back
as a NumPy array of its stored dtype (bfloat16/float8 through ml_dtypes). ``fmt.dequantize(data,
scale, fmt.out_dtype)`` (or :meth:`QuantizedTensor.dequantize`) equals the producer's own
dequantized values bit for bit. See ``docs/checkpoints.md`` for the layouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qformats import _safetensors

SUPPORTED = (
    "compressed-tensors (config.json quantization_config.quant_method='compressed-tensors'): formats "
    "nvfp4-pack-quantized, mxfp4-pack-quantized, float-quantized (FP8 per-tensor, per-channel, 2-D blocks), "
    "pack-quantized (int4, symmetric or with zero point)",
    "ModelOpt NVFP4 (hf_quant_config.json quant_algo='NVFP4', or quant_method='modelopt')",
    "gpt-oss MXFP4 experts (quant_method='mxfp4': *_blocks + *_scales)",
    "GGUF files (.gguf): Q8_0, Q4_0, F32, F16, BF16 tensors",
    "unquantized .safetensors (no quantization_config)",
)


class CheckpointError(ValueError):
    """A checkpoint whose layout or scheme is not supported, or whose tensors do not fit it."""


def unsupported(what: str) -> CheckpointError:
    lines = "\n  - ".join(SUPPORTED)
    return CheckpointError(f"{what}\nqformats.read_checkpoint supports:\n  - {lines}")


class QuantizedTensor(NamedTuple):
    """One quantized tensor: ``fmt.dequantize(data, scale, dtype)`` gives its values.

    A pytree whose children are ``data`` and ``scale`` (the format is static metadata), so it can be
    passed to ``jax.jit``-compiled functions and ``jax.device_put``.
    """

    fmt: Any
    data: Any
    scale: Any

    @property
    def dtype(self):
        """The producer's output dtype for this tensor (``fmt.out_dtype``, float32 if it has none)."""
        return jnp.dtype(getattr(self.fmt, "out_dtype", "float32"))

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape."""
        return tuple(self.fmt.value_shape(np.shape(self.data)))

    def dequantize(self, dtype=None):
        """The values, in ``dtype`` (default: the producer's output dtype, :attr:`dtype`)."""
        return self.fmt.dequantize(self.data, self.scale, self.dtype if dtype is None else dtype)


# A pytree with children (data, scale) and the format as static metadata, so that a checkpoint dict
# can be passed to jit-compiled functions (the format becomes part of the cache key).
jax.tree_util.register_pytree_node(
    QuantizedTensor, lambda q: ((q.data, q.scale), q.fmt), lambda fmt, children: QuantizedTensor(fmt, *children)
)


class SafetensorsSource:
    """The tensors of one or more ``.safetensors`` files, read one at a time on request."""

    def __init__(self, files, mmap: bool = False):
        self.files = [Path(f) for f in files]
        self.mmap = mmap
        self.where: dict[str, Path] = {}
        self.info: dict[str, dict] = {}
        for f in self.files:
            header, _ = _safetensors.read_header(f)  # validated: offsets, sizes, dtypes (a ValueError)
            for k, v in header.items():
                if k == _safetensors.METADATA_KEY:
                    continue
                if k in self.where:
                    raise CheckpointError(
                        f"{self.where[k]}: tensor {k!r} is in both {self.where[k]} and {f}, so which one is meant is "
                        "ambiguous. Remove the stale shard (each tensor of a checkpoint is in one file)."
                    )
                self.where[k] = f
                self.info[k] = v

    def names(self):
        return list(self.where)

    def __contains__(self, name):
        return name in self.where

    def dtype(self, name) -> str:
        return self.info[name]["dtype"]

    def shape(self, name) -> tuple[int, ...]:
        return tuple(self.info[name]["shape"])

    def read(self, name) -> np.ndarray:
        return _safetensors.read_tensor(self.where[name], name, mmap=self.mmap)

    def location(self) -> str:
        """The files, for messages about a tensor that is missing."""
        return ", ".join(map(str, self.files))

    def error(self, name, msg) -> CheckpointError:
        """A :class:`CheckpointError` naming the file that holds ``name``, the tensor and ``msg``."""
        return CheckpointError(f"{self.where.get(name, self.location())}: tensor {name!r} {msg}")

    def check(self, name, dtypes, role: str, *, ndim: int = 0) -> None:
        """Refuse ``name`` unless its stored dtype is one of ``dtypes`` and it has at least ``ndim`` axes
        (checked from the header, before its bytes are read)."""
        dt = self.dtype(name)
        if dt not in dtypes:
            raise self.error(name, f"has dtype {dt}, but {role} is stored as {' or '.join(dtypes)}")
        shape = self.shape(name)
        if len(shape) < ndim:
            raise self.error(name, f"has rank {len(shape)} (shape {shape}), but {role} has at least {ndim} dimensions")


def _load_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path}: cannot read it as JSON (nested too deeply)") from None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(out).__name__}, not an object")
    return out


def _safetensors_files(d: Path):
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no model.safetensors or *.safetensors file in this folder")
    return files


def model_dtype(config: dict, default=None):
    """The model dtype a config names (``torch_dtype``/``dtype``, e.g. ``"bfloat16"``), else ``default``."""
    name = config.get("torch_dtype") or config.get("dtype")
    if isinstance(name, str):
        return name.replace("torch.", "")
    return default


def read_checkpoint(path, *, mmap: bool = False) -> dict:
    """Read a quantized checkpoint: ``{logical name: QuantizedTensor | np.ndarray}``.

    ``path`` is a folder (its ``config.json`` / ``hf_quant_config.json`` name the scheme; the tensors
    are in ``model.safetensors`` or ``*.safetensors``), a ``.safetensors`` file (the scheme is read
    from the JSON files beside it) or a ``.gguf`` file. Quantized tensors stay quantized; an unknown
    layout or scheme raises :class:`CheckpointError` naming it and listing the supported ones.

    ``mmap=True`` returns the tensors of ``.safetensors`` files as read-only ``np.memmap`` views of
    the file (no copy; pages load on first access). GGUF tensors are always copied, since their
    block scales are split from their codes.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_file() and path.suffix.lower() == ".gguf":
        from qformats import _ckpt_gguf

        return _ckpt_gguf.read(path)
    if path.is_dir():
        folder, files = path, _safetensors_files(path)
    elif path.suffix.lower() == ".safetensors":
        folder, files = path.parent, [path]
    else:
        raise unsupported(f"{path}: not a folder, a .safetensors file or a .gguf file")
    config = _load_json(folder / "config.json") if (folder / "config.json").exists() else {}
    hfq = _load_json(folder / "hf_quant_config.json") if (folder / "hf_quant_config.json").exists() else None
    source = SafetensorsSource(files, mmap=mmap)
    qcfg = config.get("quantization_config")
    if qcfg is not None and not isinstance(qcfg, dict):
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config is {type(qcfg).__name__}, not an object")
    method = (qcfg or {}).get("quant_method")
    if hfq is not None and method in (None, "modelopt"):
        method = "modelopt"
    if method is None:
        return _plain(source, folder)
    if method == "compressed-tensors":
        from qformats import _ckpt_compressed_tensors

        return _ckpt_compressed_tensors.read(source, config)
    if method == "modelopt":
        from qformats import _ckpt_modelopt

        return _ckpt_modelopt.read(source, config, hfq or qcfg)
    if method == "mxfp4":
        from qformats import _ckpt_gptoss

        return _ckpt_gptoss.read(source, config)
    raise unsupported(f"{folder}: quantization scheme quant_method={method!r} is not supported.")


_QUANT_SUFFIXES = ("_packed", "_scale", "_scales", "_blocks", "_global_scale", "_zero_point", "_scale_2")


def _plain(source: SafetensorsSource, folder) -> dict:
    quantish = [n for n in source.names() if n.endswith(_QUANT_SUFFIXES)]
    if quantish:
        raise unsupported(
            f"{folder}: the tensors look quantized ({', '.join(quantish[:3])}, ...) but there is no "
            "config.json with a quantization_config nor an hf_quant_config.json to say which scheme. "
            "Pass the checkpoint folder with its config files."
        )
    return {n: source.read(n) for n in source.names()}


def take_rest(source: SafetensorsSource, used: set, out: dict) -> dict:
    """Add every tensor not in ``used`` to ``out`` as a plain array (read one at a time)."""
    for n in source.names():
        if n not in used and n not in out:
            out[n] = source.read(n)
    return out
