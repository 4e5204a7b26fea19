"""FP8 E4M3 weights with a scale stored in the model dtype (compressed-tensors ``float-quantized``).

``w = to_scale_dtype(f32(q) * f32(scale))``: the float32 product of the E4M3 value and the scale
(a multiplier), rounded once to the output dtype (the dtype the scale is stored in, bfloat16 for a
bfloat16 model). Three granularities:

* ``tensor``: one scale (stored ``[1]``, held here as a 0-d array);
* ``channel``: one scale per output row, stored ``[N, 1]``;
* ``block``: 2-D blocks (default 128 x 128, DeepSeek-V3 style), scale ``[ceil(N/128), ceil(K/128)]``,
  ``w[i, j] = q[i, j] * scale[i // 128, j // 128]``. Edges may be ragged (``N`` or ``K`` not a multiple
  of 128): the last row/column of blocks is partial. :meth:`quantize` and :meth:`dequantize` handle
  that; :meth:`block_shape` (what ``scalify``'s layout rules use) refuses it, since a block tuple
  cannot describe partial blocks.
"""

from __future__ import annotations

import math

import attrs
import jax.numpy as jnp
import numpy as np

from qformats import _bits, _elements, _layout
from qformats._fmt_common import div
from qformats._format import ScaledFormat

_E4M3 = _elements.FLOAT8_E4M3FN
GRANULARITIES = ("tensor", "channel", "block")


def _check_gran(instance, attribute, value):
    if value not in GRANULARITIES:
        raise ValueError(f"granularity={value!r}; choose one of {GRANULARITIES}")


@attrs.frozen
class RaggedBlocks2D(_layout.Layout):
    """2-D blocks of ``rows x cols`` over the last two axes; the last block of an axis may be partial.

    ``scale_shape = (*lead, ceil(N / rows), ceil(K / cols))``. An axis shorter than its block is one
    (whole) block. :meth:`block_shape` raises for a ragged shape (no block tuple describes it).
    """

    rows: int = 128
    cols: int = 128

    def grid(self, shape):
        if len(shape) < 2:
            raise ValueError(f"2-D block scaling needs at least 2 dimensions, got shape {tuple(shape)}")
        n, k = shape[-2:]
        return (*shape[:-2], math.ceil(n / self.rows), math.ceil(k / self.cols))

    def block_shape(self, shape):
        self.grid(shape)
        n, k = shape[-2:]
        # An axis shorter than its block is one whole block; an empty axis has no blocks.
        bn, bk = min(self.rows, n) or self.rows, min(self.cols, k) or self.cols
        if n % bn or k % bk:
            raise ValueError(
                f"shape {tuple(shape)} has ragged {self.rows}x{self.cols} blocks (scale grid "
                f"{self.grid(shape)[-2:]}): quantize/dequantize handle partial edge blocks, but a block "
                f"tuple cannot describe them. Pad the last two axes to multiples of {self.rows}/{self.cols} "
                f"to use this layout in scalify."
            )
        return (*(1 for _ in shape[:-2]), bn, bk)

    def scale_shape(self, shape):
        return self.grid(tuple(shape))

    def describe(self):
        return f"2-D blocks of {self.rows}x{self.cols} over the last two axes (ragged edges allowed)"


def expand_ragged(scale, shape, rows, cols):
    """Each element's block scale for 2-D blocks with partial edge blocks."""
    n, k = shape[-2:]
    s = jnp.repeat(jnp.repeat(scale, rows, axis=-2), cols, axis=-1)
    return s[..., :n, :k]


@attrs.frozen
class FP8CheckpointFormat(ScaledFormat):
    """E4M3 data with a scale in ``scale_dtype``; ``w = scale_dtype(f32(q) * f32(scale))``.

    Quantize (compressed-tensors' recipe): ``scale = scale_dtype(amax / 448)`` per tensor/row/block
    (an all-zero block gets ``scale_dtype``'s epsilon), ``q = e4m3(clip(scale_dtype(x / scale), -448, 448))``:
    the quotient is rounded to the scale dtype before the E4M3 rounding, as torch's bfloat16
    division does.
    """

    name: str = "ct_fp8_block128"
    granularity: str = attrs.field(default="block", validator=_check_gran)
    block: tuple = (128, 128)
    scale_dtype: str = "bfloat16"

    @property
    def element(self):
        return _E4M3

    @property
    def out_dtype(self):
        return self.scale_dtype

    @property
    def layout(self):
        if self.granularity == "tensor":
            return _layout.PerTensor()
        if self.granularity == "channel":
            return _layout.PerChannel(-2)
        return RaggedBlocks2D(*self.block)

    def scale_shape(self, shape):
        return self.layout.scale_shape(tuple(shape))

    def check_input(self, x):
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{self.name}.quantize expects a floating-point array, got dtype {dtype}.")
        self.scale_shape(jnp.shape(x))

    def _expand(self, s, shape):
        if self.granularity == "block":
            return expand_ragged(s, shape, *self.block)
        return _layout.expand(s, shape, self.block_shape(shape))

    def _amax(self, x):
        if self.granularity != "block":
            m = _layout.block_amax(x, self.block_shape(x.shape), exact=True)
            return m.reshape(self.scale_shape(x.shape))
        n, k = x.shape[-2:]
        rows, cols = self.block
        gn, gk = self.scale_shape(x.shape)[-2:]
        pad = [(0, 0)] * (x.ndim - 2) + [(0, gn * rows - n), (0, gk * cols - k)]
        xp = jnp.pad(jnp.abs(x), pad)
        return _layout.block_amax(xp, (*(1 for _ in x.shape[:-2]), rows, cols), exact=True)

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        sd = jnp.dtype(self.scale_dtype)
        amax = self._amax(x)
        s32 = _bits.round_to(div(amax, _E4M3.max_value), sd)
        s32 = jnp.where(s32 == 0, np.float32(jnp.finfo(sd).eps), s32)
        v = _bits.round_to(div(x, self._expand(s32, x.shape)), sd)
        data = _E4M3.encode(jnp.clip(v, -_E4M3.max_value, _E4M3.max_value))
        return data, s32.astype(sd)

    def decode(self, data):
        return _E4M3.decode(data)

    def scale_values(self, scale):
        return jnp.asarray(scale).astype(jnp.float32)

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``dtype(f32(q) * f32(scale))`` with each element's (possibly partial) block scale."""
        q = self.decode(data)
        return (q * self._expand(self.scale_values(scale), q.shape)).astype(dtype)
