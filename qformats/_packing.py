"""Sub-byte packing of element codes along one axis.

fp4: two codes per byte, element ``2i`` in the low nibble (the order of
``lax.bitcast_convert_type(uint8 -> float4_e2m1fn)`` and of torchao).
fp6: four 6-bit codes in three bytes, little-endian: the 24-bit word
``c0 | c1 << 6 | c2 << 12 | c3 << 18`` stored as bytes ``w & 0xFF, (w >> 8) & 0xFF, w >> 16``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from qformats._layout import reshape


def _split(x, axis, k):
    """Reshape ``axis`` of length ``n`` into ``(n // k, k)``; returns the k slices."""
    shape = x.shape
    g = reshape(x, (*shape[:axis], shape[axis] // k, k, *shape[axis + 1 :]))
    return [jnp.take(g, i, axis=axis + 1) for i in range(k)]


def _join(parts, axis):
    st = jnp.stack(parts, axis=axis + 1)
    shape = parts[0].shape
    return reshape(st, (*shape[:axis], shape[axis] * len(parts), *shape[axis + 1 :]))


def _group_word(x, k, word):
    """View the last axis of uint8 ``x`` as words of ``k`` bytes (little-endian), shape ``(..., n // k)``."""
    return lax.bitcast_convert_type(reshape(x, (*x.shape[:-1], x.shape[-1] // k, k)), word)


def _word_bytes(w, k):
    """Inverse of :func:`_group_word`: the low ``k`` bytes of each word, flattened into the last axis."""
    b = lax.bitcast_convert_type(w, jnp.uint8)
    if k == 3:
        b = b[..., :3]
    return reshape(b, (*w.shape[:-1], w.shape[-1] * k))


def _pack_last(codes, bits, materialized):
    # Bit operations on whole words (one load and one store per group): XLA fuses this into the
    # encoder's loop; gathering strided slices and stacking them is several times slower on CPU.
    if bits == 4:
        w = _group_word(codes, 2, jnp.uint16)  # c0 | c1 << 8
        return (w | (w >> 4)).astype(jnp.uint8)
    if materialized:
        # Codes already in memory: each output byte straight from the two codes it takes bits
        # from, stacked in threes, is about 2x faster than the words below. (Fused into an element
        # encoder, XLA would recompute the codes for every byte, several times slower.)
        g = reshape(codes, (*codes.shape[:-1], codes.shape[-1] // 4, 4))
        c0, c1, c2, c3 = (g[..., i] for i in range(4))
        packed = jnp.stack([c0 | (c1 << 6), (c1 >> 2) | (c2 << 4), (c2 >> 4) | (c3 << 2)], axis=-1)
        return reshape(packed, (*codes.shape[:-1], codes.shape[-1] * 3 // 4))
    w = _group_word(codes, 4, jnp.uint32)  # c0 | c1 << 8 | c2 << 16 | c3 << 24
    w = (w & 0x3F) | ((w >> 2) & 0xFC0) | ((w >> 4) & 0x3F000) | ((w >> 6) & 0xFC0000)
    return _word_bytes(w, 3)


def _unpack4_last(packed):
    # Each output code reads its (broadcast) byte and shifts by its position: an elementwise
    # expression that fuses into the decoder. (For fp6 the slices + stack below measured faster.)
    codes = (packed[..., :, None] >> jnp.array([0, 4], jnp.uint8)) & 0xF
    return reshape(codes, (*packed.shape[:-1], packed.shape[-1] * 2))


def pack(codes, bits: int, axis: int, *, materialized: bool = False):
    """Pack ``uint8`` codes of width ``bits`` (4 or 6) along ``axis``.

    ``materialized=True`` picks the form that is fastest when ``codes`` is read from memory rather
    than computed in the same loop (same result).
    """
    if bits in (4, 6) and axis % codes.ndim == codes.ndim - 1:
        return _pack_last(codes, bits, materialized)
    if bits == 4:
        lo, hi = _split(codes, axis, 2)
        return lo | (hi << 4)
    if bits == 6:
        c = [p.astype(jnp.uint32) for p in _split(codes, axis, 4)]
        w = c[0] | (c[1] << 6) | (c[2] << 12) | (c[3] << 18)
        parts = [(w & 0xFF).astype(jnp.uint8), ((w >> 8) & 0xFF).astype(jnp.uint8), (w >> 16).astype(jnp.uint8)]
        return _join(parts, axis)
    raise ValueError(f"cannot pack {bits}-bit codes; only 4 and 6 are supported")


def unpack(packed, bits: int, axis: int):
    """Inverse of :func:`pack`."""
    if bits == 4 and axis % packed.ndim == packed.ndim - 1:
        return _unpack4_last(packed)
    if bits == 4:
        return _join([packed & 0xF, packed >> 4], axis)
    if bits == 6:
        b = [p.astype(jnp.uint32) for p in _split(packed, axis, 3)]
        w = b[0] | (b[1] << 8) | (b[2] << 16)
        return _join([((w >> s) & 0x3F).astype(jnp.uint8) for s in (0, 6, 12, 18)], axis)
    raise ValueError(f"cannot unpack {bits}-bit codes; only 4 and 6 are supported")


def packed_shape(shape, bits: int, axis: int) -> tuple[int, ...]:
    """Shape of ``bits``-wide codes of logical ``shape`` once packed along ``axis``."""
    a = axis % len(shape)
    return tuple(packed_length(n, bits) if i == a else n for i, n in enumerate(shape))


def unpacked_shape(data_shape, bits: int, axis: int) -> tuple[int, ...]:
    """Inverse of :func:`packed_shape`."""
    a = axis % len(data_shape)
    return tuple(unpacked_length(n, bits) if i == a else n for i, n in enumerate(data_shape))


def packed_length(n: int, bits: int) -> int:
    return n * bits // 8


def unpacked_length(n: int, bits: int) -> int:
    return n * 8 // bits
