"""Saving and loading ScaledArrays.

* :func:`save` / :func:`load`: pytrees of ScaledArrays and arrays in ``.safetensors`` files (bit-exact;
  readable by any safetensors reader); :func:`load` also reads published quantized checkpoints through
  :func:`qformats.read_checkpoint`.
* :func:`register_flax`: ScaledArray state dicts for ``flax.serialization`` (automatic once flax is
  imported).
* :func:`register_scale_type`: a user scale pytree class for ``jax.export``, flax and :func:`save`.
* :func:`format_to_spec` / :func:`format_from_spec`: a format as JSON data (registry name plus
  changed fields).

See ``docs/io.md``.
"""

from scalify._serialization import (
    FormatSerializationError,
    format_from_spec,
    format_to_spec,
    register_flax,
    register_scale_type,
)
from scalify.io._files import ScalifyIOError, load, save

__all__ = [
    "FormatSerializationError",
    "ScalifyIOError",
    "format_from_spec",
    "format_to_spec",
    "load",
    "register_flax",
    "register_scale_type",
    "save",
]
