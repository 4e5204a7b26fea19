"""Reader for llama.cpp GGUF files through the ``gguf`` package's ``GGUFReader`` (extra ``gguf``).

GGUF lists shapes in ggml order (fastest axis first); tensors here are in NumPy orientation
(``reversed``), as ``GGUFReader.tensors[i].data`` is. Quantized types are split from the file's
interleaved blocks (float16 ``d`` then codes) into ``data`` and ``scale``:

* Q8_0 (34-byte blocks): ``data`` int8 ``[..., K]``, ``scale`` float16 ``[..., K/32]`` -> ``gguf_q8_0``;
* Q4_0 (18-byte blocks): ``data`` uint8 ``[..., K/2]`` (ggml nibble order), ``scale`` float16 (signed)
  -> ``gguf_q4_0``.

F32, F16 and BF16 tensors come back as arrays; other types raise an error naming them.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from qformats._checkpoint import CheckpointError, QuantizedTensor, unsupported
from qformats._fmt_checkpoints import GGUF_Q4_0, GGUF_Q8_0


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading .gguf files needs the gguf package: pip install 'qformats[gguf]'") from None
    return gguf


def read(path) -> dict:
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(path))
    out: dict = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(list(t.shape)))
        kind = T(t.tensor_type)
        raw = t.data
        if kind == T.F32:
            out[t.name] = np.array(raw, np.float32).reshape(shape)
        elif kind == T.F16:
            out[t.name] = np.array(raw, np.float16).reshape(shape)
        elif kind == T.BF16:
            out[t.name] = np.array(raw).view(np.uint16).view(ml_dtypes.bfloat16).reshape(shape)
        elif kind in (T.Q8_0, T.Q4_0):
            bsize = 34 if kind == T.Q8_0 else 18
            b = np.asarray(raw, np.uint8).reshape(*shape[:-1], shape[-1] // 32, bsize)
            d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0]
            codes = np.ascontiguousarray(b[..., 2:])
            if kind == T.Q8_0:
                out[t.name] = QuantizedTensor(GGUF_Q8_0, codes.view(np.int8).reshape(shape), d)
            else:
                out[t.name] = QuantizedTensor(GGUF_Q4_0, codes.reshape(*shape[:-1], shape[-1] // 2), d)
        else:
            raise unsupported(
                f"{path}: tensor {t.name!r} has GGUF type {kind.name}; "
                "supported GGUF types: Q8_0, Q4_0, F32, F16, BF16."
            )
    if not out and not reader.tensors:
        raise CheckpointError(f"{path}: the GGUF file holds no tensors")
    return out
