"""Train real models in every number format: ``python -m examples.train`` (from the repository root).

An application of the library, not part of it: it uses the public API only (``scalify``,
``scalify.amp``, ``scalify.recipes``, ``scalify.tree``, ``qformats``) and needs the ``train``
extra (optax; scikit-learn for the digits, matplotlib for ``--plot``, tqdm for progress bars).

Models (plain JAX, :mod:`examples.train.models`): an MLP classifier on scikit-learn's bundled 8x8
digits (``--model mlp``) and a character-level GPT-style transformer on the source of
standard-library modules (``--model transformer``). Modes (``--format``): ``fp32``, ``bf16``,
``fp16`` (plain jit, no scaling), ``fp16-scalify`` (float16 ScaledArray parameters, whole step under
``scalify``), every registered qformats format (the float32 loss under ``scalify.amp`` with the
format as the matmul policy) and ``--recipe NAME`` (``scalify.recipes.apply``). See
:mod:`examples.train.loop` for the exact mechanism of each mode and ``docs/accuracy.md`` for
measured results.

    from examples.train import train
    r = train("mlp", "mxfp8", steps=300, seed=0)
    r.metrics()  # {"format": "mxfp8", "steps": 300, "train_loss": ..., "val_loss": ..., ...}
"""

from examples.train.cli import main, markdown_table, plot_histories
from examples.train.data import MissingExtraError, load_digits, load_text
from examples.train.loop import MODELS, TrainResult, describe_mode, get_mode, list_modes, train

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
