"""The built-in recipes: torchao's MX and float8 training recipes and NVIDIA's NVFP4 recipe."""

from __future__ import annotations

import qformats as qf
from scalify.recipes._recipe import Recipe

MXFP8 = Recipe.uniform("mxfp8", qf.MXFP8)
"""torchao MX training, MXFP8: E4M3 elements in blocks of 32 along each GEMM's contracted axis, E8M0
scales rounded down (OCP ``floor``), for all six operands."""

MXFP8_RCEIL = Recipe.uniform("mxfp8_rceil", qf.MXFP8.replace(scale_mode="rceil_log2"))
"""MXFP8 with torchao's ``RCEIL`` scales: ``amax / 448`` rounded up to a power of two through a float32
``log2`` (``scale_mode="rceil_log2"``; ``"rceil"`` is the exact rounding of NVIDIA's hardware)."""

MXFP4 = Recipe.uniform("mxfp4", qf.MXFP4)
"""torchao MX training with FP4 (E2M1) elements, floor scales."""

MXFP4_RCEIL = Recipe.uniform("mxfp4_rceil", qf.MXFP4.replace(scale_mode="rceil_log2"))
"""MXFP4 with torchao's ``RCEIL`` scales (see ``MXFP8_RCEIL``)."""

_E4M3_T = qf.get_format("fp8_e4m3_tensorwise")
_E5M2_T = qf.get_format("fp8_e5m2_tensorwise")
FLOAT8_TENSORWISE = Recipe(
    "float8_tensorwise",
    fwd_lhs=_E4M3_T,
    fwd_rhs=_E4M3_T,
    dgrad_lhs=_E5M2_T,
    dgrad_rhs=_E4M3_T,
    wgrad_lhs=_E5M2_T,
    wgrad_rhs=_E4M3_T,
)
"""torchao float8 training, ``tensorwise``: one scale per tensor stored as ``448 / amax`` (torchao's
convention), E4M3 inputs and weights, E5M2 output gradients."""

FLOAT8_TENSORWISE_POW2 = Recipe(
    "float8_tensorwise_pow2",
    *(f.replace(pow2=True) for f in (_E4M3_T, _E4M3_T, _E5M2_T, _E4M3_T, _E5M2_T, _E4M3_T)),
)
"""``FLOAT8_TENSORWISE`` with the scales rounded down to powers of two (``round_scales_to_power_of_2``)."""

FLOAT8_ROWWISE = Recipe.uniform("float8_rowwise", qf.get_format("fp8_e4m3_rowwise"))
"""torchao float8 training, ``rowwise``: E4M3 everywhere (gradients too), one power-of-two scale per
row along each GEMM's contracted axis."""

_NVFP4_TILES = qf.NVFP4.replace(tile_axis=-2)
NVFP4 = Recipe(
    "nvfp4",
    fwd_lhs=qf.NVFP4,
    fwd_rhs=_NVFP4_TILES,
    dgrad_lhs=qf.NVFP4,
    dgrad_rhs=_NVFP4_TILES,
    wgrad_lhs=qf.NVFP4,
    wgrad_rhs=qf.NVFP4,
    stochastic_rounding=("dgrad_lhs", "wgrad_lhs"),
    wgrad_hadamard=qf.RandomHadamard(16),
)
"""NVIDIA's NVFP4 pretraining recipe (Transformer Engine's ``NVFP4BlockScaling``): E2M1 elements with
E4M3 block-16 scales and a float32 tensor scale; weights in 16x16 tiles (so a weight and its
transpose quantize alike); output gradients rounded stochastically; a 16x16 random Hadamard
transform on both weight-gradient operands."""


def _blockwise(name: str, fmt) -> Recipe:
    """E4M3 everywhere: 1 x 128 blocks along each GEMM's summed axis, 128 x 128 tiles for weights."""
    tiles = fmt.replace(tile_axis=-2)
    return Recipe(name, fmt, tiles, fmt, tiles, fmt, fmt)


FLOAT8_BLOCKWISE = _blockwise("float8_blockwise", qf.get_format("fp8_e4m3_block128"))
"""DeepSeek-V3's float8 recipe as torchao's blockwise float8 training runs it: E4M3 elements, float32
scales stored as ``1 / r`` with ``r = 448 / amax`` per block; activations and gradients in blocks of 128
along each GEMM's summed axis, weights in 128 x 128 tiles (a weight and its transpose quantize alike).
Every dimension a GEMM blocks must be a multiple of 128."""

FLOAT8_BLOCKWISE_POW2 = _blockwise("float8_blockwise_pow2", qf.get_format("fp8_e4m3_block128_pow2"))
"""Transformer Engine's ``Float8BlockScaling`` with its default power-of-two scales: as
``FLOAT8_BLOCKWISE`` with ``r``'s mantissa bits zeroed and TE's rule for degenerate blocks (no
``amax`` clamp; ``r = 1`` where ``amax`` is 0, Inf or NaN)."""

BUILTINS = {
    r.name: r
    for r in (
        MXFP8,
        MXFP8_RCEIL,
        MXFP4,
        MXFP4_RCEIL,
        FLOAT8_TENSORWISE,
        FLOAT8_TENSORWISE_POW2,
        FLOAT8_ROWWISE,
        FLOAT8_BLOCKWISE,
        FLOAT8_BLOCKWISE_POW2,
        NVFP4,
    )
}


def get_recipe(name) -> Recipe:
    """The built-in recipe called ``name`` (case-insensitive); a Recipe is returned as is."""
    if isinstance(name, Recipe):
        return name
    try:
        return BUILTINS[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; the built-in recipes are {sorted(BUILTINS)}") from None
