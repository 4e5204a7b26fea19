"""Shared helpers: the formats every operator test runs with, and the comparison helper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from user_formats import DICT_MXFP8

import qformats as qf
import scalify as jsa

# "scale" is the plain per-tensor case of the seed (scale only, no format).
FORMATS = {
    "scale": None,
    "fp16": qf.FP16,
    "fp8_e4m3": qf.FP8_E4M3,
    "int8_per_channel": qf.INT8_PER_CHANNEL,
    "mxfp8": qf.MXFP8,
    "nvfp4": qf.NVFP4,
    "user_dict_mxfp8": DICT_MXFP8,  # a user format whose scale is a dict (tests/user_formats.py)
}


@pytest.fixture(params=list(FORMATS), ids=list(FORMATS))
def fmt(request):
    return FORMATS[request.param]


def make_scaled(x, fmt, scale=4.0):
    """A ScaledArray of ``x`` in ``fmt`` (None: carrier with a power-of-two scale)."""
    if fmt is None:
        return jsa.as_scaled_array(jnp.asarray(x), scale=np.float32(scale))
    return jsa.as_scaled_array(jnp.asarray(x), fmt=fmt)


def values(tree):
    return jax.tree.map(
        lambda v: (
            np.asarray(v, np.float64)
            if not isinstance(v, jsa.ScaledArray)
            else np.asarray(v.to_array(jnp.float32), np.float64)
        ),
        tree,
        is_leaf=jsa.is_scaled_leaf,
    )


def check_against_dequantized(f, *scaled, rtol=1e-5, atol=1e-5):
    """``scalify(f)(scaled)`` equals ``f`` on the dequantized inputs (both evaluated in float32).

    Tolerance: the logical dtype is float32 and scales are powers of two, so every rescaling is
    exact; differences come only from float32 rounding in a different order of operations (block
    sums, sqrt(n) pre-scaling), i.e. a few ulps relative to the output magnitude.
    """
    deq = [np.asarray(s.to_array(jnp.float32)) if isinstance(s, jsa.ScaledArray) else s for s in scaled]
    expected = values(f(*deq))
    got = values(jsa.scalify(f)(*scaled))
    jax.tree.map(
        lambda g, e: np.testing.assert_allclose(
            g, e, rtol=rtol, atol=atol * max(1.0, float(np.max(np.abs(e), initial=0.0)))
        ),
        got,
        expected,
    )
    return got


def fast_jit(f, *args):
    """``jax.jit(f)(*args)`` compiled at XLA optimization level 0 (halves test compile times)."""
    return jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)
