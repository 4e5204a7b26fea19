"""qformats: low-precision number formats with pluggable scaling for JAX.

Every format maps a float array to ``(data, scale)`` with ``value = decode(data) * expand(scale)``::

    import qformats as qf
    data, scale = qf.MXFP8.quantize(x)
    y = qf.MXFP8.dequantize(data, scale)
"""

from qformats._blockwise_float8 import BlockwiseFloat8
from qformats._builtins import (
    BF16,
    FP8_E4M3,
    FP8_E5M2,
    FP16,
    INT8_PER_CHANNEL,
    MXFP4,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8,
    MXFP8_E4M3,
    MXFP8_E5M2,
    MXINT8,
    NVFP4,
)
from qformats._checkpoint import CheckpointError, QuantizedTensor, read_checkpoint
from qformats._ckpt_writers import write_compressed_tensors, write_gguf
from qformats._cli._engine import compare
from qformats._elements import FloatElement, IntElement
from qformats._float8_training import ReciprocalScaleFloat8
from qformats._format import ScaledFormat
from qformats._hadamard import RandomHadamard
from qformats._layout import AlongAxis, Blocked, Layout, PerChannel, PerTensor, Tiles, block_amax, block_reduce, expand
from qformats._mx import MXFormat
from qformats._nvfp4 import NVFP4Format, NVFP4Scale
from qformats._per_channel import PerChannelIntFormat
from qformats._per_tensor import PerTensorFormat
from qformats._registry import UnknownFormatError, get_format, list_formats, register_format, unregister_format

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP16",
    "INT8_PER_CHANNEL",
    "MXFP4",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "MXINT8",
    "NVFP4",
    "AlongAxis",
    "Blocked",
    "BlockwiseFloat8",
    "FloatElement",
    "IntElement",
    "Layout",
    "MXFormat",
    "NVFP4Format",
    "NVFP4Scale",
    "PerChannel",
    "PerChannelIntFormat",
    "PerTensor",
    "PerTensorFormat",
    "RandomHadamard",
    "ReciprocalScaleFloat8",
    "ScaledFormat",
    "CheckpointError",
    "QuantizedTensor",
    "read_checkpoint",
    "write_compressed_tensors",
    "write_gguf",
    "Tiles",
    "UnknownFormatError",
    "block_amax",
    "compare",
    "block_reduce",
    "expand",
    "get_format",
    "list_formats",
    "register_format",
    "unregister_format",
]
