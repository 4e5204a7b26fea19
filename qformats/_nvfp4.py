"""NVFP4: fp4 e2m1 elements, blocks of 16 with an E4M3 scale, and a float32 tensor scale on top."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qformats import _elements, _layout, _packing
from qformats._fmt_common import BlocksOrTiles, div
from qformats._format import ScaledFormat

_E4M3 = _elements.FLOAT8_E4M3FN
_FP4 = _elements.FLOAT4_E2M1FN
_E4M3_TINY = np.float32(2.0**-6)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)


NAN_SCOPES = ("tensor", "block")
# Factor applied to the input before dividing by a block's scale product, where that product
# (tensor * block) would be a float32 subnormal: 2**32 makes it normal (it is >= 2**-132).
_SUB_LIFT = np.float32(2.0**32)


def _check_nan_scope(instance, attribute, value):
    if value not in NAN_SCOPES:
        raise ValueError(f"nan_scope={value!r}; choose one of {NAN_SCOPES}")


class NVFP4Scale(NamedTuple):
    """The two scale levels: ``block`` (float8_e4m3fn per block) and ``tensor`` (float32 scalar)."""

    block: jax.Array
    tensor: jax.Array


@attrs.frozen
class NVFP4Format(BlocksOrTiles, ScaledFormat):
    """``value = fp4(data) * e4m3(block_scale) * tensor_scale``.

    * two-level (``tensor_scale=True``): ``tensor = amax(x) / (448 * 6)`` and
      ``block = e4m3(clamp(block_amax / 6 / tensor, 2**-6, 448))``;
    * single-level: ``tensor = 1`` and ``block = e4m3(clamp(block_amax / 6, 2**-6, 448))``.

    Elements are ``x / (tensor * block)`` rounded to fp4 (nearest even, saturating at 6).

    Non-finite values: Inf saturates within its block (E4M3 has no Inf: the block scale clamps to
    448 and the Inf to 6 times it); the two-level tensor scale is computed from the amax of the
    *finite* values, so an Inf affects only its own block. NaN makes its block NaN; in two-level
    scaling with ``nan_scope="tensor"`` (default, torchao's result bit for bit) it makes the tensor
    scale, and so the whole tensor, NaN; ``nan_scope="block"`` confines it to its block.

    At the bottom of float32's range the tensor scale is at least ``2**-126``, and where
    ``tensor * block`` is below float32's smallest normal (XLA on CPU would flush it) the two
    factors are applied one after the other instead of as their float32 product.
    """

    axis_fields: ClassVar[tuple[str, ...]] = ("axis", "tile_axis")

    name: str = "nvfp4"
    axis: int = -1
    block_size: int = 16
    tensor_scale: bool = True
    packed: bool = True
    tile_axis: int | None = None
    nan_scope: str = attrs.field(default="tensor", validator=_check_nan_scope)

    @property
    def local_scales(self) -> bool:
        """Single-level scales see their block alone; the two-level tensor scale sees every value."""
        return not self.tensor_scale

    @property
    def element(self):
        return _FP4

    def quantize_stochastic(self, x, key):
        """:meth:`quantize` with the scaled elements rounded stochastically (same two scale levels)."""
        x, block, code, tensor, factors = self._prepared(x)
        return self._encode(x, block, factors, key), NVFP4Scale(code, tensor)

    def quantize(self, x):
        x, block, code, tensor, factors = self._prepared(x)
        if _layout.has_fast_block_max(x.shape, block):
            # A cond (its branches are the same loop) makes XLA write the per-block scales out once
            # instead of re-deriving them (an E4M3 encode and decode) inside the element loop.
            def encode(x, factors):
                return self._encode(x, block, factors)

            data = lax.cond(_layout.has_nan(x), encode, encode, x, factors)
        else:
            data = self._encode(x, block, factors)
        return data, NVFP4Scale(code, tensor)

    def _prepared(self, x):
        """``(x as float32, block, block codes, tensor scale, factors)``: what every quantizing
        method starts from (see :meth:`_scales`)."""
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        code, tensor, factors = self._scales(_layout.block_amax(x, block), x)
        return x, block, code, tensor, factors

    def _pack(self, codes):
        return _packing.pack(codes, 4, self.axis % codes.ndim) if self.packed else codes

    def _scales(self, amax, x):
        """``(block code, tensor scale, (lift, divisor))`` from the block max (and ``x``, for the
        finite values' amax where a block holds NaN or Inf); elements are ``(x * lift) / divisor``:
        ``(1, tensor * block)`` where that product is a normal float32, else
        ``(2**32, (tensor * 2**32) * block)``."""
        # True divisions (div), as torchao computes them; XLA would multiply by reciprocals. The
        # block maximum is divided twice (by 6, then by the tensor scale), and div keeps XLA from
        # making that one division by 6 * tensor.
        block_scale = div(amax, _FP4.max_value)
        if self.tensor_scale:
            finite = amax <= np.finfo(np.float32).max
            # The tensor amax over the finite values: the block maxima's where every block is
            # finite, else (rarely: a cond) a pass over the finite elements themselves.
            t_amax = lax.cond(
                jnp.all(finite),
                lambda: jnp.max(amax, initial=np.float32(0)),
                lambda: jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), np.float32(0)), initial=np.float32(0)),
            )
            tensor = div(t_amax, _E4M3.max_value * _FP4.max_value)
            tensor = jnp.where(t_amax == 0, np.float32(1), jnp.maximum(tensor, _F32_TINY))
            if self.nan_scope == "tensor":
                tensor = jnp.where(jnp.any(jnp.isnan(amax)), np.float32(np.nan), tensor)
            # amax / 6 is subnormal below 6 * 2**-126 (and reads as 0 here): divide lifted values.
            low = amax < np.float32(_FP4.max_value * _F32_TINY)
            lifted = div(div(amax * _SUB_LIFT, _FP4.max_value), tensor * _SUB_LIFT)
            block_scale = jnp.where(low, lifted, div(block_scale, tensor))
        else:
            tensor = jnp.float32(1)
        code = _E4M3.encode(jnp.clip(block_scale, _E4M3_TINY, _E4M3.max_value))
        # Decoding the E4M3 code from its bits is cheaper than XLA's float8 convert (same values).
        block_value = _E4M3.decode(code)
        total = tensor * block_value
        sub = total < _F32_TINY
        lift = jnp.where(sub, _SUB_LIFT, np.float32(1))
        divisor = jnp.where(sub, (tensor * _SUB_LIFT) * block_value, total)
        return code, tensor, (lift, divisor)

    def _encode(self, x, block, factors, key=None):
        """Element data (packed if ``self.packed``) for per-block factors ``(lift, divisor)`` (see
        :meth:`_scales`); with a PRNG ``key`` the scaled elements round stochastically instead of
        to nearest."""
        return self._pack(self._codes(x, block, factors, key))

    def _codes(self, x, block, factors, key=None):
        """Unpacked fp4 codes of :meth:`_encode`."""
        lift, divisor = factors
        # A true division (div), as torchao's ``data_hp / total_scale``: XLA would multiply by the
        # reciprocal, which moves a quotient on an exact fp4 rounding tie by one code.
        v = div(x * _layout.expand(lift, x.shape, block), _layout.expand(divisor, x.shape, block))
        if key is not None:
            v = _FP4.stochastic_round(v, key)
        return _FP4.encode(v)

    def fake_quantize(self, x, key=None):
        """``dequantize(*quantize(x))`` (with ``key``: of :meth:`quantize_stochastic`) in one element
        loop: the codes are decoded where they are made, never packed or written out."""
        x, block, code, tensor, factors = self._prepared(x)
        elems = _FP4.decode(self._codes(x, block, factors, key))
        return self._scaled(elems, tensor, code.astype(jnp.float32))

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``decode(data) * (tensor * block)`` (see :meth:`_scaled`)."""
        return self._scaled(self.decode(data), scale.tensor, scale.block.astype(jnp.float32), dtype)

    def _scaled(self, elems, tensor, block_value, dtype=jnp.float32):
        """``elems * (tensor * block_value)``; where that product is below float32's smallest normal
        (which XLA on CPU flushes), ``(elems * block_value) * tensor`` instead."""
        grid = self.block_shape(elems.shape)
        tensor = jnp.asarray(tensor, jnp.float32)
        total = tensor * block_value
        sub = total < _F32_TINY
        head = jnp.where(sub, block_value, total)
        tail = jnp.where(sub, tensor, np.float32(1))
        out = elems * _layout.expand(head, elems.shape, grid) * _layout.expand(tail, elems.shape, grid)
        return out.astype(dtype)

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
