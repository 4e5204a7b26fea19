"""Per-tensor scaled formats (FP16, BF16, FP8 E4M3/E5M2): one float32 scale for the tensor."""

from __future__ import annotations

import attrs
import jax.numpy as jnp
import numpy as np

from qformats import _bits, _elements, _layout
from qformats._format import ScaledFormat

_TINY = np.float32(np.finfo(np.float32).tiny)
SCALE_MODES = ("rceil", "exact")


def _check_mode(instance, attribute, value):
    if value not in SCALE_MODES:
        raise ValueError(f"{attribute.name}={value!r} is not a per-tensor scale mode; choose one of {SCALE_MODES}")


@attrs.frozen
class PerTensorFormat(ScaledFormat):
    """``value = element(data) * scale`` with one float32 ``scale`` per tensor.

    ``scale_mode``:

    * ``"rceil"`` (default): ``scale = 2**ceil(log2(amax / max_value))``, the smallest power of two
      that maps ``amax`` into range; it never saturates and applying it is exact.
    * ``"exact"``: ``scale = amax / max_value`` (not rounded), so ``amax`` lands on ``max_value``.

    A zero tensor gets scale 1; a tensor holding NaN or Inf gets a NaN scale.
    """

    name: str
    element: _elements.FloatElement
    scale_mode: str = attrs.field(default="rceil", validator=_check_mode)

    @property
    def layout(self):
        return _layout.PerTensor()

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        amax = jnp.max(jnp.abs(x)) if x.size else jnp.float32(0)
        finite = amax <= np.float32(np.finfo(np.float32).max)
        ratio = amax / np.float32(self.max_value)
        if self.scale_mode == "rceil":
            e = jnp.clip(_bits.ceil_log2(jnp.maximum(ratio, _TINY)), -126, 127)
            e = jnp.where(amax == 0, 0, e)
            scale = _bits.pow2(e)
            data = self.element.encode(x * _bits.pow2(-jnp.minimum(e, 126)) * jnp.where(e > 126, np.float32(0.5), np.float32(1)))
        else:
            scale = jnp.where(amax == 0, np.float32(1), jnp.maximum(ratio, _TINY))
            data = self.element.encode(x / scale)
        scale = jnp.where(finite, scale, np.float32(np.nan))
        return data, scale

    def decode(self, data):
        return self.element.decode(data)

    def scale_values(self, scale):
        return jnp.asarray(scale, jnp.float32)
