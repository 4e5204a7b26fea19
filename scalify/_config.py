"""Scalify configuration: power-of-two rounding of scales and the output-format policy.

``ScalifyConfig`` is a context manager; the active configuration is read at trace time (like
``jax.default_matmul_precision``), so a jitted scalified function keeps the configuration it was
traced with.
"""

from __future__ import annotations

import enum
import threading

import attrs
import numpy as np

# The contraction strategies (scalify/_contraction.py).
CONTRACTIONS = ("auto", "dequantize", "native", "scaled_dot")


class Pow2RoundMode(enum.IntEnum):
    """How a new scale is rounded to a power of two (jax-scalify's modes)."""

    NONE = 0
    """No rounding: scales are arbitrary float32 values."""
    DOWN = 1
    """Round down to the power of two below (the default: data stays in ``[1, 2)`` x the norm)."""
    UP = 2
    """Round up to the power of two above."""
    STOCHASTIC = 3
    """Round up or down at random, with probability proportional to the distance (unbiased in log)."""


@attrs.frozen(kw_only=True)
class ScalifyConfig:
    """Configuration of the scalify interpreter, usable as a context manager.

    Args:
        rounding_mode: power-of-two rounding of every scale a rule creates.
        keep_format: when True, the output of an elementwise or structural rule whose scaled input
            carried a format (``as_scaled_array(x, fmt=...)``) is re-quantized into that format (as
            long as the output shape fits the format's layout). When False (default) rules return
            the *carrier* form: data in the logical dtype and float32 scales.
        dot_output_format: format of the output of contractions (dot_general, conv). ``None``
            (default) gives a carrier array (per-tensor scale for blocked operands, as MX hardware
            accumulates in float32); a ``qformats`` format re-quantizes the output into it.
        stochastic_seed: seed of the stochastic rounding mode.
        scale_dtype: jax-scalify's default scale dtype. Here it is the dtype of the scale that
            ``scalify.lax.get_data_scale`` gives a plain array (``None``: the array's dtype) and
            the dtype ``get_data_scale`` returns a scale in. Scales the rules create are float32
            whatever its value (a power of two is exact in float32, and one dtype keeps every rule
            simple).
        renormalize: how rules whose output magnitude can drift (contractions, sums) pick the output
            scale. ``"amax"`` (default): the output's measured absolute max, rounded to a power of
            two, moves into the scale, so the data's amax lies in ``[1, 2)`` and unchanged training
            programs cannot drift out of range (one reduction over the output). ``"static"``:
            jax-scalify's static estimate, a power of two near ``sqrt(K)`` for a K-term sum (no
            reduction; the data drifts with the values' correlation, so training needs hand-placed
            ``dynamic_rescale_*``).
        contraction: how a contraction (``dot_general``, ``conv_general_dilated``) with an operand
            in a ``qformats`` format runs (see ``docs/performance.md``, "Contraction strategies"):
            ``"dequantize"`` (values exact in bfloat16 or float32, one GEMM with float32
            accumulation), ``"native"`` (the stored values as they are: float8 data in an FP8
            GEMM), ``"scaled_dot"`` (``jax.nn.scaled_matmul`` on elements and block scales: MXFP8,
            MXFP4, NVFP4 blocked along the contracted axis; convolutions run ``"dequantize"``) or
            ``"auto"`` (default: ``"scaled_dot"`` where the GPU has block-scaled GEMMs, ``"native"``
            on other GPUs, ``"dequantize"`` elsewhere). All equal the float32 contraction of the
            dequantized operands up to summation order. Contractions of carriers only (no format,
            jax-scalify's arrays) keep jax-scalify's rule under ``"auto"``.
        fast_accumulation: let FP8 GEMMs (``"native"`` on Hopper) use the tensor cores' fast,
            reduced-precision accumulation, as Transformer Engine and torchao do for forward GEMMs
            (H100, 8192^3: 1.64x the bfloat16 GEMM's throughput and relative error 8e-3, against
            1.48x and 1.5e-4 without). Default False (``Precision.HIGHEST`` on float8 GEMMs).
    """

    rounding_mode: Pow2RoundMode = Pow2RoundMode.DOWN
    keep_format: bool = False
    dot_output_format: object = None
    stochastic_seed: int = 0
    scale_dtype: object = attrs.field(default=None, converter=lambda d: None if d is None else np.dtype(d))
    renormalize: str = attrs.field(default="amax", validator=attrs.validators.in_(("amax", "static")))
    contraction: str = attrs.field(default="auto", validator=attrs.validators.in_(CONTRACTIONS))
    fast_accumulation: bool = False

    def __enter__(self):
        _STACK.stack.append(self)
        return self

    def __exit__(self, *exc):
        _STACK.stack.pop()
        return False


class _Stack(threading.local):
    def __init__(self):
        self.stack = [ScalifyConfig()]
        self.counter = 0


_STACK = _Stack()


def get_config() -> ScalifyConfig:
    """The active :class:`ScalifyConfig`."""
    return _STACK.stack[-1]
