"""The storage formats of published checkpoints, one value per layout (registered unlisted).

Readers use these values (``fmt.replace(...)`` where a checkpoint differs, e.g. its output dtype).
"""

from __future__ import annotations

from qformats._fmt_fp4ckpt import MXFP4CheckpointFormat, NVFP4CheckpointFormat
from qformats._fmt_fp8ckpt import FP8CheckpointFormat
from qformats._fmt_gguf import GGUFQ4_0Format, GGUFQ8_0Format
from qformats._fmt_int4 import Int4GroupFormat

CT_NVFP4 = NVFP4CheckpointFormat("ct_nvfp4", global_scale="divisor", negative_zero=True, out_dtype="bfloat16")
MODELOPT_NVFP4 = NVFP4CheckpointFormat(
    "modelopt_nvfp4", global_scale="multiplier", negative_zero=False, out_dtype="bfloat16"
)
CT_MXFP4 = MXFP4CheckpointFormat(name="ct_mxfp4", out_dtype="bfloat16")
CT_FP8_TENSOR = FP8CheckpointFormat("ct_fp8_tensor", granularity="tensor")
CT_FP8_CHANNEL = FP8CheckpointFormat("ct_fp8_channel", granularity="channel")
CT_FP8_BLOCK128 = FP8CheckpointFormat("ct_fp8_block128", granularity="block", block=(128, 128))
CT_INT4_G128 = Int4GroupFormat("ct_int4_g128", group_size=128, symmetric=True)
CT_INT4_G128_ASYM = Int4GroupFormat("ct_int4_g128_asym", group_size=128, symmetric=False)
GGUF_Q8_0 = GGUFQ8_0Format()
GGUF_Q4_0 = GGUFQ4_0Format()

CHECKPOINT_FORMATS = (
    CT_NVFP4,
    MODELOPT_NVFP4,
    CT_MXFP4,
    CT_FP8_TENSOR,
    CT_FP8_CHANNEL,
    CT_FP8_BLOCK128,
    CT_INT4_G128,
    CT_INT4_G128_ASYM,
    GGUF_Q8_0,
    GGUF_Q4_0,
)
