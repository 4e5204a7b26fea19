"""Reader for gpt-oss MXFP4 expert weights (``quant_method: mxfp4``), as OpenAI publishes them.

``<p>_blocks`` u8 ``[E, N, K/32, 16]`` (32 E2M1 codes per block, low nibble first) and ``<p>_scales``
u8 ``[E, N, K/32]`` (E8M0, bias 127) become one :class:`QuantizedTensor` named ``<p>`` (e.g.
``model.layers.0.mlp.experts.gate_up_proj``) in the file's ``[E, out, in]`` orientation (OpenAI's
reader; transformers returns the transpose ``[E, in, out]``), with ``data`` the blocks viewed as
``[E, N, K/2]``. Values: ``w = bf16(code * 2**(e - 127))`` -> ``ct_mxfp4`` (the same bytes as
compressed-tensors' MXFP4). Fused ``gate_up_proj`` rows interleave gate (even) and up (odd).
"""

from __future__ import annotations

from qformats._checkpoint import QuantizedTensor, model_dtype, take_rest
from qformats._fmt_checkpoints import CT_MXFP4


def read(source, config: dict) -> dict:
    # transformers dequantizes to the model dtype (bfloat16 for the published gpt-oss models)
    fmt = CT_MXFP4.replace(out_dtype=model_dtype(config, "bfloat16"))
    out: dict = {}
    used: set = set()
    for n in source.names():
        if not n.endswith("_blocks"):
            continue
        base = n[: -len("_blocks")]
        if base + "_scales" not in source:
            raise source.error(n, f"is gpt-oss MXFP4 blocks without {base}_scales")
        source.check(n, ("U8",), "gpt-oss MXFP4 blocks", ndim=2)
        source.check(base + "_scales", ("U8",), "gpt-oss MXFP4 scales (E8M0 bytes)", ndim=1)
        if source.shape(n)[-1] != 16 or source.shape(n)[:-1] != source.shape(base + "_scales"):
            raise source.error(
                n,
                f"({base}): blocks {source.shape(n)} and scales {source.shape(base + '_scales')} do not fit "
                "[..., G, 16] / [..., G]",
            )
        blocks, scales = source.read(n), source.read(base + "_scales")
        used |= {n, base + "_scales"}
        out[base] = QuantizedTensor(fmt, blocks.reshape(*scales.shape[:-1], scales.shape[-1] * 16), scales)
    return take_rest(source, used, out)
