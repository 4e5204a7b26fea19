"""Int4 with one scale per group of ``group_size`` elements along the last axis, optionally with a
zero point: compressed-tensors ``pack-quantized`` (W4A16, GPTQ/AWQ-style checkpoints).

Storage (as compressed-tensors writes it, for ``W[N, K]``):

* ``data``: int32 ``[N, K/8]``; element ``k`` is the nibble at bits ``4 * (k % 8)`` of word ``k // 8``,
  holding ``q + 8`` (``q`` in ``[-8, 7]``);
* ``scale``: ``[N, K/group]`` in the model dtype (bfloat16);
* asymmetric only: the zero point ``zp`` as int32 ``[ceil(N/8), K/group]``, packed the same way but
  along **N** (axis 0), also offset by 8. The scale is then :class:`Int4Scale` ``(scale, zero_point)``.

Decode: ``w = scale_dtype(f32(q - zp) * f32(scale))`` (``zp = 0`` when symmetric). With a zero point
the map is affine: :meth:`decode` gives ``q - zp`` only through :meth:`dequantize`; :meth:`decode`
alone returns ``q`` and :meth:`scale_values` the multiplier.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qformats import _bits, _elements, _layout
from qformats._fmt_common import div
from qformats._format import ScaledFormat

INT4 = _elements.IntElement("int4", bits=4, step=1.0, qmax=7)
_SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


class Int4Scale(NamedTuple):
    """Group scales (model dtype) and the packed zero points (int32, packed along axis 0)."""

    scale: jax.Array
    zero_point: jax.Array


def unpack_words(words, axis=-1):
    """int32 words -> int32 ``q`` (``nibble - 8``), 8 per word, along ``axis`` (low nibble first)."""
    words = jnp.moveaxis(jnp.asarray(words), axis, -1)
    w = lax.bitcast_convert_type(words, jnp.uint32)
    nib = (w[..., None] >> _SHIFTS) & 0xF
    q = nib.reshape(*w.shape[:-1], w.shape[-1] * 8).astype(jnp.int32) - 8
    return jnp.moveaxis(q, -1, axis)


def pack_words(q, axis=-1):
    """Inverse of :func:`unpack_words`; the packed axis is zero-padded to a multiple of 8."""
    q = jnp.moveaxis(jnp.asarray(q), axis, -1)
    n = q.shape[-1]
    pad = -n % 8
    u = (q + 8).astype(jnp.uint32)
    if pad:
        u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, pad)])
    u = u.reshape(*u.shape[:-1], u.shape[-1] // 8, 8) << _SHIFTS
    w = u[..., 0]
    for i in range(1, 8):
        w = w | u[..., i]
    return jnp.moveaxis(lax.bitcast_convert_type(w, jnp.int32), -1, axis)


@attrs.frozen
class Int4GroupFormat(ScaledFormat):
    """Int4 codes in int32 words, groups of ``group_size`` along the last axis, scale in ``scale_dtype``.

    Quantize (compressed-tensors' min-max recipe; ``r`` rounds each step to ``scale_dtype`` as torch's
    bfloat16 arithmetic does): symmetric ``scale = r(amax / 7.5)``, ``q = round(r(x / scale))``;
    asymmetric ``lo = min(min(x), 0)``, ``hi = max(max(x), 0)``, ``scale = r(r(hi - lo) / 15)``,
    ``zp = clip(round(r(-8 - r(lo / scale))), -8, 7)``, ``q = round(r(r(x / scale) + zp))``; then
    ``clip(q, -8, 7)`` (round half to even); a zero scale becomes ``scale_dtype``'s epsilon.
    """

    name: str = "ct_int4_g128"
    group_size: int = 128
    symmetric: bool = True
    scale_dtype: str = "bfloat16"

    @property
    def element(self):
        return INT4

    @property
    def out_dtype(self):
        return self.scale_dtype

    @property
    def layout(self):
        return _layout.Blocked(-1, self.group_size)

    def data_shape(self, shape):
        shape = tuple(shape)
        if shape[-1] % 8:
            raise ValueError(f"{self.name}: the last axis ({shape[-1]}) must be a multiple of 8 (8 codes per word)")
        return (*shape[:-1], shape[-1] // 8)

    def value_shape(self, data_shape):
        return (*tuple(data_shape)[:-1], data_shape[-1] * 8)

    def check_input(self, x) -> None:
        super().check_input(x)
        self.data_shape(jnp.shape(x))
        if not self.symmetric and jnp.ndim(x) != 2:
            raise ValueError(
                f"{self.name} packs its zero points along the rows (axis 0) of a 2-D [N, K] weight, "
                f"but the input has shape {tuple(jnp.shape(x))}; reshape it to 2-D or use the symmetric "
                f"format (ct_int4_g128)."
            )

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        sd = jnp.dtype(self.scale_dtype)

        def r(v):  # one torch operation in the scale dtype: computed in float32, rounded to sd
            return _bits.round_to(v, sd)

        block = self.block_shape(x.shape)
        eps = np.float32(jnp.finfo(sd).eps)
        if self.symmetric:
            amax = _layout.block_amax(x, block, exact=True)
            s32 = r(div(amax, 7.5))
        else:
            lo = jnp.minimum(_layout.block_reduce(x, block, jnp.min), 0)
            hi = jnp.maximum(_layout.block_reduce(x, block, jnp.max), 0)
            s32 = r(div(r(hi - lo), 15))
        s32 = jnp.where(s32 == 0, eps, s32)
        scale = s32.astype(sd)
        v = r(div(x, _layout.expand(s32, x.shape, block)))
        if self.symmetric:
            zp = jnp.zeros(s32.shape, jnp.float32)
            q = jnp.round(v)
        else:
            zp = jnp.clip(jnp.round(r(np.float32(-8) - r(div(lo, s32)))), -8, 7)
            q = jnp.round(r(v + _layout.expand(zp, x.shape, block)))
        q = jnp.clip(q, -8, 7).astype(jnp.int32)
        data = pack_words(q, -1)
        if self.symmetric:
            return data, scale
        return data, Int4Scale(scale, pack_words(zp.astype(jnp.int32), 0))

    def decode(self, data):
        return unpack_words(data, -1).astype(jnp.float32)

    def _split(self, scale):
        if self.symmetric:
            return scale, None
        return scale.scale, scale.zero_point

    def scale_values(self, scale):
        return jnp.asarray(self._split(scale)[0]).astype(jnp.float32)

    def zero_points(self, scale, rows):
        """The unpacked zero points ``[N, K/group]`` (int32) of an asymmetric scale."""
        return unpack_words(scale.zero_point, 0)[:rows]

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``dtype(f32(q - zp) * f32(scale))``."""
        q = unpack_words(data, -1)
        s, _ = self._split(scale)
        block = self.block_shape(q.shape)
        if not self.symmetric:
            q = q - _layout.expand(self.zero_points(scale, q.shape[-2]), q.shape, block)
        return (q.astype(jnp.float32) * _layout.expand(jnp.asarray(s).astype(jnp.float32), q.shape, block)).astype(
            dtype
        )
