"""NVFP4: fp4 e2m1 elements, blocks of 16 with an E4M3 scale, and a float32 tensor scale on top."""

from __future__ import annotations

from typing import NamedTuple

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qformats import _elements, _layout, _packing
from qformats._format import ScaledFormat

_E4M3 = _elements.FLOAT8_E4M3FN
_FP4 = _elements.FLOAT4_E2M1FN
_E4M3_TINY = np.float32(2.0**-6)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)


class NVFP4Scale(NamedTuple):
    """The two scale levels: ``block`` (float8_e4m3fn per block) and ``tensor`` (float32 scalar)."""

    block: jax.Array
    tensor: jax.Array


@attrs.frozen
class NVFP4Format(ScaledFormat):
    """``value = fp4(data) * e4m3(block_scale) * tensor_scale``.

    * two-level (``tensor_scale=True``): ``tensor = amax(x) / (448 * 6)`` and
      ``block = e4m3(clamp(block_amax / 6 / tensor, 2**-6, 448))``;
    * single-level: ``tensor = 1`` and ``block = e4m3(clamp(block_amax / 6, 2**-6, 448))``.

    Elements are ``x / (tensor * block)`` rounded to fp4 (nearest even, saturating at 6). Inf
    saturates (E4M3 has no Inf); NaN propagates to the block (single-level) or tensor (two-level).
    """

    name: str = "nvfp4"
    axis: int = -1
    block_size: int = 16
    tensor_scale: bool = True
    packed: bool = True
    tile_axis: int | None = None

    @property
    def element(self):
        return _FP4

    @property
    def layout(self):
        if self.tile_axis is not None:
            return _layout.Tiles(self.axis, self.tile_axis, self.block_size)
        return _layout.Blocked(self.axis, self.block_size)

    def aim(self, contracted, free=None):
        """Blocks along the contracted axis; a tiled format (``tile_axis`` set) tiles with ``free``."""
        if self.tile_axis is None:
            return self.replace(axis=contracted)
        if free is None:
            raise ValueError(
                f"{self.name} with {self.block_size}x{self.block_size} tiles needs a second (free) axis, "
                f"but this GEMM operand has none; use 1-D blocks (tile_axis=None) for it."
            )
        return self.replace(axis=contracted, tile_axis=free)

    def quantize_stochastic(self, x, key):
        """:meth:`quantize` with the scaled elements rounded stochastically (same two scale levels)."""
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        code, tensor, total = self._scales(_layout.block_amax(x, block))
        return self._encode(x, block, total, key), NVFP4Scale(code, tensor)

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        amax = _layout.block_amax(x, block)
        code, tensor, total = self._scales(amax)
        if _layout.has_fast_block_max(x.shape, block):
            # A cond (its branches are the same loop) makes XLA write the per-block scales out once
            # instead of re-deriving them (an E4M3 encode and decode) inside the element loop.
            def encode(x, total):
                return self._encode(x, block, total)

            data = lax.cond(_layout.has_nan(x), encode, encode, x, total)
        else:
            data = self._encode(x, block, total)
        return data, NVFP4Scale(code, tensor)

    def _pack(self, codes):
        return _packing.pack(codes, 4, self.axis % codes.ndim) if self.packed else codes

    def _scales(self, amax):
        """``(block code, tensor scale, block code value * tensor scale)`` from the block max."""
        block_scale = amax / np.float32(_FP4.max_value)
        if self.tensor_scale:
            tensor = jnp.max(amax) / np.float32(_E4M3.max_value * _FP4.max_value)
            tensor = jnp.where(tensor == 0, np.float32(1), jnp.maximum(tensor, _F32_TINY))
            block_scale = block_scale / tensor
        else:
            tensor = jnp.float32(1)
        code = _E4M3.encode(jnp.clip(block_scale, _E4M3_TINY, _E4M3.max_value))
        # Decoding the E4M3 code from its bits is cheaper than XLA's float8 convert (same values).
        return code, tensor, tensor * _E4M3.decode(code)

    def _encode(self, x, block, total, key=None):
        """Element data (packed if ``self.packed``) for per-block multipliers ``total``; with a PRNG
        ``key`` the scaled elements round stochastically instead of to nearest."""
        v = x / _layout.expand(total, x.shape, block)
        if key is not None:
            v = _FP4.stochastic_round(v, key)
        return self._pack(_FP4.encode(v))

    def decode(self, data):
        if self.packed:
            data = _packing.unpack(data, 4, self.axis % data.ndim)
        return _FP4.decode(data)

    def scale_values(self, scale):
        return scale.tensor * scale.block.astype(jnp.float32)

    def factored(self, data, scale):
        """FP4 elements times their E4M3 block scales (at most 6 significant bits: exact in
        bfloat16), and the float32 tensor scale as the factor."""
        elems = self.decode(data)
        block = _layout.expand(_E4M3.decode(scale.block), elems.shape, self.block_shape(elems.shape))
        return (elems * block).astype(jnp.bfloat16), jnp.asarray(scale.tensor, jnp.float32)

    def block_scaled(self, data, scale):
        """FP4 elements, E4M3 block scales and the tensor scale (1-D blocks only; tiles have none)."""
        if self.tile_axis is not None:
            return None
        return self.decode(data).astype(jnp.float4_e2m1fn), scale.block, jnp.asarray(scale.tensor, jnp.float32)

    def data_shape(self, shape):
        return _packing.packed_shape(shape, 4, self.axis) if self.packed else tuple(shape)

    def value_shape(self, data_shape):
        return _packing.unpacked_shape(data_shape, 4, self.axis) if self.packed else tuple(data_shape)
