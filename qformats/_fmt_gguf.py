"""llama.cpp's GGUF block formats Q8_0 and Q4_0: blocks of 32 along the last axis, a float16 scale.

In the file each block is the float16 scale ``d`` followed by its codes; here the two are split into
``data`` and ``scale`` (float16 ``[..., K/32]``), which is a copy but not a dequantization.

* Q8_0: ``data`` int8 ``[..., K]``; ``w = f32(q) * f32(d)``. Quantize (ggml's reference):
  ``d = amax / 127``, ``q = roundf(x * (1/d))`` (half away from zero), ``d`` stored as float16.
* Q4_0: ``data`` uint8 ``[..., K/2]`` as ggml packs it: in each block of 32, byte ``i`` holds element
  ``i`` in its low nibble and element ``i + 16`` in its high nibble (not ``2i``/``2i+1``), each as
  ``q + 8``; ``w = f32(d) * f32(q)`` with ``q`` in ``[-8, 7]``. The scale may be **negative**:
  quantize takes the block's signed value of largest magnitude ``m`` and ``d = m / -8``, so that
  ``m`` maps to ``q = -8``; ``q = min(15, trunc(x * (1/d) + 8.5)) - 8``.

Both quantizers use the float32 ``d`` for the codes and round it to float16 only for storage, as
ggml does.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import jax.numpy as jnp
import numpy as np

from qformats import _elements, _layout
from qformats._fmt_common import div, mul
from qformats._format import ScaledFormat

Q8_ELEMENT = _elements.IntElement("int8", bits=8, step=1.0, qmax=127)
Q4_ELEMENT = _elements.IntElement("int4", bits=4, step=1.0, qmax=8)


def _blocks(x, size=32):
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


@attrs.frozen
class GGUFQ8_0Format(ScaledFormat):
    """GGUF Q8_0: ``w = f32(int8 q) * f32(float16 d)`` per block of 32 (see the module docstring)."""

    local_scales: ClassVar[bool] = True

    name: str = "gguf_q8_0"
    out_dtype: str = "float32"

    @property
    def element(self):
        return Q8_ELEMENT

    @property
    def layout(self):
        return _layout.Blocked(-1, 32)

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        b = _blocks(x)
        d = div(_layout.block_amax(x, self.block_shape(x.shape), exact=True), 127)
        inv = jnp.where(d == 0, np.float32(0), div(1, jnp.where(d == 0, np.float32(1), d)))
        v = mul(b, inv[..., None])
        a = jnp.abs(v)
        fl = jnp.floor(a)
        r = fl + jnp.floor(np.float32(2) * (a - fl))  # roundf: half away from zero
        q = jnp.clip(jnp.sign(v) * r, -127, 127).astype(jnp.int8)
        return q.reshape(x.shape), d.astype(jnp.float16)

    def decode(self, data):
        return jnp.asarray(data).astype(jnp.float32)

    def scale_values(self, scale):
        return jnp.asarray(scale).astype(jnp.float32)


def _unpack_q4(data):
    """uint8 ``[..., K/2]`` (ggml order) -> int32 ``q`` in ``[-8, 7]``, ``[..., K]``."""
    b = _blocks(jnp.asarray(data), 16)
    q = jnp.concatenate([b & 0xF, b >> 4], axis=-1).astype(jnp.int32) - 8
    return q.reshape(*data.shape[:-1], data.shape[-1] * 2)


def _q4_thresholds():
    """``T[n - 1] = min{p in float32 : fl(p + 8.5) >= n}`` for ``n = 1..15``, found with NumPy's
    float32 addition (IEEE, never fused): ``fl(p + 8.5)`` is monotone in ``p``, so
    ``min(15, trunc(fl(p + 8.5))) = #{n : p >= T[n - 1]}`` for ``p >= -8.5``."""
    out = []
    for n in range(1, 16):
        p = np.float32(n - 8.5)
        while np.float32(np.nextafter(p, np.float32(-np.inf)) + np.float32(8.5)) >= n:
            p = np.nextafter(p, np.float32(-np.inf))
        out.append(p)
    return np.array(out, np.float32)


_Q4_THRESHOLDS = _q4_thresholds()


def _q4_codes(p):
    """ggml's ``min(15, trunc(p + 8.5))`` (``p = x * id``, the sum rounded to float32 before the
    truncation), as int32 in ``[0, 15]``, counted against :data:`_Q4_THRESHOLDS`: XLA would contract
    ``x * id + 8.5`` into one fused multiply-add, which truncates one code lower where ``x * id``
    rounds onto a half-integer (75 of a million bfloat16-valued weights), and a comparison cannot be
    contracted. ``p < -8.5`` (only through rounding) gives 0, as ggml's clamp does."""
    return jnp.sum(p[..., None] >= _Q4_THRESHOLDS, axis=-1, dtype=jnp.int32)


def _pack_q4(q):
    u = _blocks((q + 8).astype(jnp.uint8), 32)
    return (u[..., :16] | (u[..., 16:] << 4)).reshape(*q.shape[:-1], q.shape[-1] // 2)


@attrs.frozen
class GGUFQ4_0Format(ScaledFormat):
    """GGUF Q4_0: ``w = f32(float16 d) * f32(q)``, ``q = nibble - 8``, ``d`` signed (module docstring).

    :meth:`scale_values` returns the signed ``d``, so a block's multiplier can be negative.
    """

    local_scales: ClassVar[bool] = True

    name: str = "gguf_q4_0"
    out_dtype: str = "float32"

    @property
    def element(self):
        return Q4_ELEMENT

    @property
    def layout(self):
        return _layout.Blocked(-1, 32)

    def data_shape(self, shape):
        self.block_shape(tuple(shape))
        return (*tuple(shape)[:-1], shape[-1] // 2)

    def value_shape(self, data_shape):
        return (*tuple(data_shape)[:-1], data_shape[-1] * 2)

    def quantize(self, x):
        self.check_input(x)
        x = jnp.asarray(x).astype(jnp.float32)
        b = _blocks(x)
        i = jnp.argmax(jnp.abs(b), axis=-1)  # first index of the largest magnitude
        m = jnp.take_along_axis(b, i[..., None], axis=-1)[..., 0]
        d = div(m, -8)
        inv = jnp.where(d == 0, np.float32(0), div(1, jnp.where(d == 0, np.float32(1), d)))
        q = _q4_codes(mul(b, inv[..., None])) - 8
        return _pack_q4(q.reshape(x.shape)), d.astype(jnp.float16)

    def decode(self, data):
        return _unpack_q4(data).astype(jnp.float32)

    def scale_values(self, scale):
        return jnp.asarray(scale).astype(jnp.float32)
