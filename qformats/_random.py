"""Uniform random numbers for stochastic rounding, computed in the element loop.

``jax.random.uniform`` costs about ten elementwise passes over the array on CPU (threefry's
rounds, written out before the rounding reads them), more than the rest of a stochastic quantize.
Rounding needs independent, uniformly distributed bits per element, not a cryptographic stream,
so each element's bits here are a keyed hash of its position:

    h = fmix32(fmix32(index XOR k0) + k1)

where ``index`` is the element's row-major linear index (mod 2**32), ``k0, k1`` are two 32-bit
words drawn from the PRNG key with ``jax.random`` (one call per array), and ``fmix32`` is the
MurmurHash3 finalizer (a bijection of 32-bit words with full avalanche: every input bit flips
each output bit with probability close to 1/2). XLA fuses the iota, the hash and the comparison
that uses it into the consumer's loop, so the bits are never written out.

Arrays of more than ``2**32`` elements add a hash of the leading axis' index to ``k1``, so no two
elements of one array share an index.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_U32 = jnp.uint32


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _linear_index(shape):
    """Row-major linear index of each element, as uint32 (mod 2**32)."""
    index = jnp.zeros(shape, _U32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(_U32, shape, axis) * _U32(stride % 2**32)
        stride *= shape[axis]
    return index


def random_bits(key, shape):
    """32 hashed random bits per element of ``shape`` (uint32), keyed by the PRNG ``key``."""
    shape = tuple(int(n) for n in shape)
    k = jax.random.bits(key, (2,), _U32)
    k1 = k[1]
    if shape and math.prod(shape) > 2**32:
        # The linear index wraps: separate the wraps by the leading axis' index.
        k1 = k1 + _fmix32(lax.broadcasted_iota(_U32, shape, 0) ^ _U32(0x9E3779B9))
    return _fmix32(_fmix32(_linear_index(shape) ^ k[0]) + k1)


def uniform(key, shape):
    """Float32 values uniform on ``[0, 1)`` in steps of ``2**-24`` (the top 24 hashed bits)."""
    return (random_bits(key, shape) >> 8).astype(jnp.float32) * np.float32(2.0**-24)
