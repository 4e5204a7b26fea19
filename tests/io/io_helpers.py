"""Helpers of the io tests: the built-in formats, a user format with a dict scale, bit comparison.

(A uniquely named module rather than conftest.py, so that ``from io_helpers import ...`` cannot pick up
another directory's conftest when several test directories are collected together.)
"""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp
import numpy as np

import qformats as qf

# The built-in formats of the brief (not qf.list_formats(): other tests register more).
BUILTIN_NAMES = [
    "fp16",
    "bf16",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8_per_channel",
    "mxfp8",
    "mxfp8_e5m2",
    "mxfp6_e2m3",
    "mxfp6_e3m2",
    "mxfp4",
    "mxint8",
    "nvfp4",
]


@attrs.frozen
class DictScaleFP8(qf.ScaledFormat):
    """A tiny user format: FP8 e4m3 elements, one float32 scale per tensor stored as ``{"s": scale}``."""

    name: str = "test_dict_scale_fp8"
    scale_mode: str = "rceil"

    @property
    def element(self):
        return qf.FP8_E4M3.element

    @property
    def layout(self):
        return qf.PerTensor()

    def _inner(self):
        return qf.FP8_E4M3.replace(scale_mode=self.scale_mode)

    def quantize(self, x):
        data, s = self._inner().quantize(x)
        return data, {"s": s}

    def decode(self, data):
        return self.element.decode(data)

    def scale_values(self, scale):
        return scale["s"]


DICT_FMT = qf.register_format(DictScaleFP8(), overwrite=True)
ALL_NAMES = [*BUILTIN_NAMES, DICT_FMT.name]


def bits(x) -> np.ndarray:
    """The raw bytes of an array leaf (any dtype, 0-d included) as uint8, for bit-exact comparison."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.reshape(-1).view(np.uint8)


def assert_same_tree(a, b):
    """Same structure (formats included) and every leaf bit-identical with the same dtype and shape."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.shape(x) == np.shape(y)
        np.testing.assert_array_equal(bits(x), bits(y))


def sample(shape=(4, 64), seed=0):
    """Normal values with a few binades of spread (so scales and elements are non-trivial)."""
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
    return x * jnp.exp2(jnp.round(jax.random.uniform(jax.random.PRNGKey(seed + 1), shape, minval=-3, maxval=3)))
