"""Symmetric int8 with one float32 scale per channel."""

from __future__ import annotations

from typing import ClassVar

import attrs
import jax.numpy as jnp
import numpy as np

from qformats import _elements, _layout
from qformats._fmt_common import div
from qformats._format import ScaledFormat

_TINY = np.float32(np.finfo(np.float32).tiny)


@attrs.frozen
class PerChannelIntFormat(ScaledFormat):
    """``value = code * scale[channel]``, ``scale = channel_amax / qmax``, codes in ``[-qmax, qmax]``.

    The channel axis is ``axis`` (default: last); the scale has the data's rank with size 1 on every
    other axis. Rounding is to nearest, ties to even. An all-zero channel gets scale 1; a channel
    holding NaN or Inf gets a NaN scale. A scale is at least float32's smallest normal (a channel
    whose amax is below ``qmax * 2**-126`` then has codes below ``qmax``), and one float32 step
    below ``amax / qmax`` where ``qmax * scale`` would round past ``FLT_MAX``, so finite channels
    dequantize to finite values.
    """

    axis_fields: ClassVar[tuple[str, ...]] = ("axis",)
    local_scales: ClassVar[bool] = True

    name: str = "int8_per_channel"
    axis: int = -1
    element: _elements.IntElement = _elements.INT8

    @property
    def layout(self):
        return _layout.PerChannel(self.axis)

    def aim(self, contracted, free=None):
        """One scale per index of the free axis (per output channel of the GEMM)."""
        if free is None:
            raise ValueError(
                f"{self.name} puts one scale per index of a free (non-contracted) axis, but this GEMM "
                f"operand has none (every axis but axis {contracted} is a batch axis or it is a vector). "
                f"Use a per-tensor or block format for it."
            )
        return self.replace(axis=free)

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        block = self.block_shape(x.shape)
        amax = _layout.block_amax(x, block)
        finite = amax <= np.finfo(np.float32).max
        # True divisions (div): XLA would multiply by 1/qmax and by each channel's reciprocal, one
        # float32 step off the quotient (and, at an exact rounding tie, one code).
        scale = jnp.where(amax == 0, np.float32(1), jnp.maximum(div(amax, self.element.qmax), _TINY))
        overflows = ~(scale * np.float32(self.element.qmax) <= np.finfo(np.float32).max) & finite
        scale = jnp.where(overflows, jnp.nextafter(scale, np.float32(0)), scale)
        scale = jnp.where(finite, scale, np.float32(np.nan))
        data = self.element.encode(div(x, _layout.expand(scale, x.shape, block)))
        return data, scale

    def decode(self, data):
        return self.element.decode(data)

    def scale_values(self, scale):
        return jnp.asarray(scale, jnp.float32)

    def factored(self, data, scale):
        """The integer codes (exact in bfloat16) times the per-channel scales."""
        return self.decode(data).astype(self.element.exact_dtype), self.scale_values(scale)
