"""Per-tensor scaled formats (FP16, BF16, FP8 E4M3/E5M2): one float32 scale for the tensor."""

from __future__ import annotations

from typing import ClassVar

import attrs
import jax.numpy as jnp
import numpy as np

from qformats import _bits, _elements, _layout
from qformats._fmt_common import div, mul
from qformats._format import ScaledFormat

_TINY = np.float32(np.finfo(np.float32).tiny)
SCALE_MODES = ("rceil", "exact")


def _check_mode(instance, attribute, value):
    if value not in SCALE_MODES:
        raise ValueError(f"{attribute.name}={value!r} is not a per-tensor scale mode; choose one of {SCALE_MODES}")


# Kept importable from here (it moved to _bits, which the MX formats share).
rceil_exponent = _bits.rceil_exponent


@attrs.frozen
class PerTensorFormat(ScaledFormat):
    """``value = element(data) * scale`` with one float32 ``scale`` per tensor.

    ``scale_mode``:

    * ``"rceil"`` (default): ``scale = 2**ceil(log2(amax / max_value))``, the smallest power of two
      that maps ``amax`` into range; it never saturates and applying it is exact. The exponent is
      kept within ``[-126, 127 - emax]``: at the bottom the scale stays a normal float32, and at
      the top ``max_value * scale`` stays finite (an amax beyond ``max_value * 2**(127 - emax)``
      saturates there instead of rounding up to ``inf``).
    * ``"exact"``: ``scale = amax / max_value`` (not rounded), so ``amax`` lands on ``max_value``;
      at least float32's smallest normal, and one float32 step smaller where ``max_value * scale``
      would overflow (an amax within an ulp of ``FLT_MAX``), so no finite input dequantizes to
      ``inf``. The elements are torchao's: ``sat(x * (max_value / amax))`` (float32 division, then
      product), ``x * 2**126`` where the scale is clamped.

    A zero tensor gets scale 1; a tensor holding NaN or Inf gets a NaN scale.
    """

    local_scales: ClassVar[bool] = True

    name: str
    element: _elements.FloatElement
    scale_mode: str = attrs.field(default="rceil", validator=_check_mode)

    @property
    def layout(self):
        return _layout.PerTensor()

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        amax = _layout.block_amax(x, x.shape).reshape(()) if x.size else jnp.float32(0)
        finite = amax <= np.float32(np.finfo(np.float32).max)
        if self.scale_mode == "rceil":
            e = jnp.clip(_bits.rceil_exponent(amax, self.max_value), -126, 127 - self.element.emax)
            e = jnp.where(amax == 0, 0, e)
            scale = _bits.pow2(e)
            data = self.element.encode(_bits.mul_pow2(x, -e))
        else:
            # A true division (div): XLA rewrites a division by a constant, eagerly or under jit,
            # into a multiply by its reciprocal, which for bf16's max is a subnormal that reads as
            # zero (every scale was then 2**-126 under jit).
            max_value = jnp.asarray(self.max_value, jnp.float32)
            ratio = div(amax, max_value)
            scale = jnp.where(amax == 0, np.float32(1), jnp.maximum(ratio, _TINY))
            # max_value * scale may round past FLT_MAX (amax within an ulp of it): one step down.
            overflows = ~(max_value * scale <= np.float32(np.finfo(np.float32).max)) & finite
            scale = jnp.where(overflows, jnp.nextafter(scale, np.float32(0)), scale)
            data = self.element.encode(mul(x, self._reciprocal(amax, ratio)))
        scale = jnp.where(finite, scale, np.float32(np.nan))
        return data, scale

    def _reciprocal(self, amax, ratio):
        """The ``exact`` mode's element multiplier: torchao's ``r = max_value / amax`` (a true float32
        division), so that ``data = sat(x * r)`` are torchao's codes bit for bit; ``2**126`` where the
        scale is clamped to ``2**-126`` (``ratio`` below it; ``max_value / amax`` may overflow
        there) and 1 for a zero tensor. Not ``x / scale``: XLA applies that as ``x * (1 / scale)``,
        and ``1 / (amax / max_value)`` is not always ``max_value / amax`` (one code off at a tie)."""
        r = div(self.max_value, jnp.where(amax == 0, np.float32(1), amax))
        r = jnp.where(ratio < _TINY, np.float32(2.0**126), r)
        return jnp.where(amax == 0, np.float32(1), r)

    def decode(self, data):
        return self.element.decode(data)

    def scale_values(self, scale):
        return jnp.asarray(scale, jnp.float32)

    def factored(self, data, scale):
        """The stored elements (float8, float16 data as they are) times the tensor scale.

        Elements beyond 2^32 (bfloat16's) could overflow a float32 product: they are dequantized.
        """
        if self.max_value > 2.0**32:
            return super().factored(data, scale)
        values = data if data.dtype == self.element.dtype else self.decode(data).astype(self.element.exact_dtype)
        return values, self.scale_values(scale)
