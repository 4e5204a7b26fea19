"""Train real models in every number format: ``python -m scalify.train``.

Models: an MLP classifier on scikit-learn's bundled 8x8 digits (``--model mlp``, needs the
``train`` extra) and a character-level GPT-style transformer on the source of standard-library
modules (``--model transformer``). Modes (``--format``): ``fp32``, ``bf16``, ``fp16`` (plain
jit, no scaling), ``fp16-scalify`` (float16 ScaledArrays, whole step under ``scalify``) and every
registered qformats format (whole step under ``scalify``, matmul operands quantized with
``scalify.ops.quantize``). See :mod:`scalify.train._loop` for the exact mechanism of each mode and
``docs/accuracy.md`` for measured results.

    from scalify.train import train
    r = train("mlp", "mxfp8", steps=300, seed=0)
    r.metrics()  # {"format": "mxfp8", "steps": 300, "train_loss": ..., "val_loss": ..., ...}
"""

from scalify.train._cli import main, markdown_table, plot_histories
from scalify.train._data import MissingExtraError, load_digits, load_text
from scalify.train._loop import MODELS, TrainResult, describe_mode, get_mode, list_modes, train

__all__ = [
    "MODELS",
    "MissingExtraError",
    "TrainResult",
    "describe_mode",
    "get_mode",
    "list_modes",
    "load_digits",
    "load_text",
    "main",
    "markdown_table",
    "plot_histories",
    "train",
]
