"""Reader for NVIDIA ModelOpt's Hugging Face NVFP4 export (``hf_quant_config.json`` quant_algo NVFP4).

For ``W[N, K]`` under module prefix ``p``: ``p.weight`` u8 ``[N, K/2]`` (two E2M1 codes per byte, low
nibble first), ``p.weight_scale`` f8e4m3 ``[N, K/16]``, ``p.weight_scale_2`` f32 0-d and
``p.input_scale`` f32 0-d. Both scales are **multipliers**:
``w = dtype(code * (f32(weight_scale) * weight_scale_2))``, and code 0x8 is +0.0 -> ``modelopt_nvfp4``.
The output dtype is the model dtype from ``config.json`` (bfloat16 when no config names one).
"""

from __future__ import annotations

import numpy as np

from qformats._checkpoint import CheckpointError, QuantizedTensor, model_dtype, take_rest, unsupported
from qformats._fmt_checkpoints import MODELOPT_NVFP4
from qformats._nvfp4 import NVFP4Scale


def read(source, config: dict, quant: dict) -> dict:
    q = quant.get("quantization", quant) if isinstance(quant, dict) else {}
    if not isinstance(q, dict):
        raise CheckpointError(f"ModelOpt quantization config is {type(q).__name__}, not an object: {q!r:.200}")
    algo = q.get("quant_algo")
    if algo != "NVFP4":
        raise unsupported(f"ModelOpt quant_algo={algo!r} is not supported (only 'NVFP4').")
    gs = q.get("group_size") or 16
    if type(gs) is not int or gs <= 0:
        raise CheckpointError(f"ModelOpt group_size={gs!r} is not a positive integer")
    fmt = MODELOPT_NVFP4.replace(out_dtype=model_dtype(config, "bfloat16"), block_size=gs)
    out: dict = {}
    used: set = set()
    for n in source.names():
        if n.endswith(".weight") and source.dtype(n) == "U8" and n + "_scale" in source:
            if n + "_scale_2" not in source:
                raise source.error(n, f"is a ModelOpt NVFP4 weight without {n}_scale_2")
            source.check(n, ("U8",), "a ModelOpt NVFP4 packed weight", ndim=1)
            source.check(n + "_scale", ("F8_E4M3",), "a ModelOpt NVFP4 block scale", ndim=1)
            source.check(n + "_scale_2", ("F32", "BF16", "F16"), "a ModelOpt NVFP4 global scale")
            data, block, s2 = (source.read(x) for x in (n, n + "_scale", n + "_scale_2"))
            used |= {n, n + "_scale", n + "_scale_2"}
            if s2.size != 1:
                raise source.error(n + "_scale_2", f"has shape {s2.shape}; expected one value")
            try:
                want = tuple(fmt.scale_shape(fmt.value_shape(data.shape)))
            except (ValueError, TypeError, IndexError) as e:
                raise source.error(n, f"of shape {data.shape} does not fit {fmt.name}: {e}") from None
            if want != block.shape:
                raise source.error(
                    n + "_scale", f"has shape {block.shape}; does not fit {data.shape} with groups of {gs} ({want})"
                )
            out[n] = QuantizedTensor(fmt, data, NVFP4Scale(block, s2.astype(np.float32).reshape(())))
    return take_rest(source, used, out)
