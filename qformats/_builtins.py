"""The built-in formats, registered under the lower-case form of their constant names."""

from __future__ import annotations

from qformats import _elements as el
from qformats._mx import MXFormat
from qformats._nvfp4 import NVFP4Format
from qformats._per_channel import PerChannelIntFormat
from qformats._per_tensor import PerTensorFormat
from qformats._registry import register_format

FP16 = PerTensorFormat("fp16", el.FLOAT16)
BF16 = PerTensorFormat("bf16", el.BFLOAT16)
FP8_E4M3 = PerTensorFormat("fp8_e4m3", el.FLOAT8_E4M3FN)
FP8_E5M2 = PerTensorFormat("fp8_e5m2", el.FLOAT8_E5M2)
INT8_PER_CHANNEL = PerChannelIntFormat("int8_per_channel")
MXFP8_E4M3 = MXFP8 = MXFormat("mxfp8", el.FLOAT8_E4M3FN)
MXFP8_E5M2 = MXFormat("mxfp8_e5m2", el.FLOAT8_E5M2)
MXFP6_E2M3 = MXFormat("mxfp6_e2m3", el.FLOAT6_E2M3FN)
MXFP6_E3M2 = MXFormat("mxfp6_e3m2", el.FLOAT6_E3M2FN)
MXFP4 = MXFormat("mxfp4", el.FLOAT4_E2M1FN)
MXINT8 = MXFormat("mxint8", el.MXINT8_ELEMENT)
NVFP4 = NVFP4Format("nvfp4")

BUILTINS = {
    FP16: ("float16",),
    BF16: ("bfloat16",),
    FP8_E4M3: ("float8_e4m3fn", "e4m3"),
    FP8_E5M2: ("float8_e5m2", "e5m2"),
    INT8_PER_CHANNEL: ("int8",),
    MXFP8: ("mxfp8_e4m3",),
    MXFP8_E5M2: (),
    MXFP6_E2M3: ("mxfp6",),
    MXFP6_E3M2: (),
    MXFP4: ("mxfp4_e2m1",),
    MXINT8: (),
    NVFP4: (),
}

for _fmt, _aliases in BUILTINS.items():
    register_format(_fmt, aliases=_aliases)

# Operand formats of the float8 training recipes (torchao's and TE's conventions): found by name, not listed,
# because they are GEMM-operand codecs for scalify.recipes rather than formats to carry a program in.
from qformats._blockwise_float8 import FP8_E4M3_BLOCK128, FP8_E4M3_BLOCK128_POW2  # noqa: E402
from qformats._float8_training import (  # noqa: E402
    FP8_E4M3_ROWWISE,
    FP8_E4M3_TENSORWISE,
    FP8_E5M2_ROWWISE,
    FP8_E5M2_TENSORWISE,
)

for _fmt in (
    FP8_E4M3_TENSORWISE,
    FP8_E5M2_TENSORWISE,
    FP8_E4M3_ROWWISE,
    FP8_E5M2_ROWWISE,
    FP8_E4M3_BLOCK128,
    FP8_E4M3_BLOCK128_POW2,
):
    register_format(_fmt, listed=False)

# Storage layouts of published checkpoints (qformats.read_checkpoint): found by name, not listed.
from qformats._fmt_checkpoints import CHECKPOINT_FORMATS  # noqa: E402

for _fmt in CHECKPOINT_FORMATS:
    register_format(_fmt, listed=False)
