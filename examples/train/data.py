"""Offline data sets: scikit-learn's bundled 8x8 digits and Python's own standard-library source."""

from __future__ import annotations

import functools
import importlib
import inspect

import numpy as np

# Standard-library modules whose source is the character-level corpus. Pure-Python modules present
# in every CPython >= 3.10; the text differs slightly between Python versions (the split is fixed).
TEXT_MODULES = (
    "textwrap",
    "string",
    "functools",
    "heapq",
    "bisect",
    "fractions",
    "shlex",
    "fnmatch",
    "glob",
    "operator",
    "copy",
    "contextlib",
)
VOCAB_SIZE = 128  # ASCII; other characters become "?". A multiple of 32, so MX blocks fit.
VAL_FRACTION = 0.1


class MissingExtraError(ImportError):
    """An optional dependency of ``examples.train`` is not installed."""


def require_sklearn():
    try:
        import sklearn.datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MissingExtraError(
            "The digits data set needs scikit-learn (bundled 8x8 digits, no download): "
            "`pip install scikit-learn` or `pip install 'qformats[train]'`."
        ) from e
    return sklearn.datasets


@functools.lru_cache(maxsize=1)
def load_digits():
    """(x_train, y_train, x_val, y_val): 64 pixel features in [0, 1], labels 0..9, fixed 80/20 split."""
    datasets = require_sklearn()
    d = datasets.load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))  # fixed split, independent of --seed
    n_val = len(x) // 5
    val, train = perm[:n_val], perm[n_val:]
    return x[train], y[train], x[val], y[val]


@functools.lru_cache(maxsize=1)
def load_text():
    """(train_ids, val_ids): int32 character codes of the stdlib corpus; the last 10% is validation."""
    parts = []
    for name in TEXT_MODULES:
        try:
            parts.append(inspect.getsource(importlib.import_module(name)))
        except (OSError, TypeError, ImportError):  # pragma: no cover - stripped installs
            continue
    if not parts:  # pragma: no cover
        raise RuntimeError("No standard-library source found (is this a stripped Python install?).")
    text = "\n".join(parts)
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int32)
    codes = np.where(codes < VOCAB_SIZE, codes, ord("?"))
    n_val = int(len(codes) * VAL_FRACTION)
    return codes[:-n_val], codes[-n_val:]


def digits_batches(x, y, batch_size, seed):
    """Endless shuffled mini-batches (epoch by epoch)."""
    rng = np.random.default_rng(seed)
    n = len(x)
    while True:
        perm = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = perm[i : i + batch_size]
            yield x[idx], y[idx]


def text_batches(ids, batch_size, context, seed):
    """Endless random windows: (inputs, targets) of shape (batch, context)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(ids) - context - 1, size=batch_size)
        idx = starts[:, None] + np.arange(context)[None, :]
        yield ids[idx], ids[idx + 1]


def text_eval_windows(ids, batch_size, context, n_batches):
    """Fixed, evenly spaced validation windows (the same for every run)."""
    starts = np.linspace(0, len(ids) - context - 2, batch_size * n_batches).astype(np.int64)
    idx = starts[:, None] + np.arange(context)[None, :]
    x, y = ids[idx], ids[idx + 1]
    return [
        (x[i * batch_size : (i + 1) * batch_size], y[i * batch_size : (i + 1) * batch_size]) for i in range(n_batches)
    ]
