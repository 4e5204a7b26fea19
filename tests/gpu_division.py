"""A float32 division as an NVIDIA GPU computes it, on the CPU, for tests of qformats' repair.

XLA compiles float32 division on NVIDIA GPUs to PTX ``div.full.f32``, specified to within 2 ulps,
not correctly rounded; off the CPU qformats repairs the quotient (``qformats._fmt_common.div``).
The ``inexact_division`` fixture (registered in ``conftest.py``) swaps the backend's quotient for
one moved by -2..2 ulps, so the repair can be tested where no GPU is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

F32 = np.float32


def exact_quotient(a, b):
    """NumPy's IEEE float32 ``a / b``, subnormal quotients included, wherever it runs: the float64
    quotient (correctly rounded: 53 >= 2 * 24 + 2 bits) rounded to float32 in integers below
    float32's smallest normal, since XLA's CPU threads (where callbacks run) flush subnormals."""
    with np.errstate(all="ignore"):
        wide = []
        for v in (a, b):
            bits = v.view(np.uint32)
            field, mant = (bits >> 23) & 0xFF, (bits & 0x7FFFFF).astype(np.float64)
            mag = np.where(field > 0, np.ldexp(mant + 2.0**23, field.astype(np.int32) - 150), np.ldexp(mant, -149))
            wide.append(np.where(field == 255, np.abs(v).astype(np.float64), mag) * np.where(bits >> 31, -1.0, 1.0))
        q = wide[0] / wide[1]
        small = np.abs(q) < 2.0**-126
        units = np.rint(np.abs(np.where(small, q, 0)) * 2.0**149).astype(np.uint32)
        sub = (units | np.where(np.signbit(q), np.uint32(0x80000000), np.uint32(0))).view(F32)
        return np.where(small, sub, q.astype(F32))


def nudged_quotient(a, b):
    """The exact ``a / b`` moved by -2..2 ulps (a hash of the operands' bits picks how far): a
    division within 2 ulps, as PTX ``div.full.f32`` (XLA's float32 division on NVIDIA GPUs) is
    specified, subnormal quotients included (XLA on CPU flushes them; a GPU does not)."""

    def nudged(a, b):
        a, b = np.broadcast_arrays(np.asarray(a, F32), np.asarray(b, F32))
        q = exact_quotient(a, b)
        with np.errstate(over="ignore"):  # the hash wraps
            h = (a.view(np.uint32) * np.uint32(0x9E3779B1)) ^ b.view(np.uint32)
            k = ((h * np.uint32(0x85EBCA77)) >> np.uint32(29)).astype(np.int64) % 5 - 2
        mag = q.view(np.uint32) & np.uint32(0x7FFFFFFF)
        moved = np.clip(mag.astype(np.int64) + k, 0, 0x7F7FFFFF).astype(np.uint32)
        moved = (moved | (q.view(np.uint32) & np.uint32(0x80000000))).view(F32)
        return np.where(mag < 0x7F800000, moved, q)

    out = jax.ShapeDtypeStruct(jnp.broadcast_shapes(a.shape, b.shape), jnp.float32)
    return jax.pure_callback(nudged, out, a, b, vmap_method="broadcast_all")


@pytest.fixture
def inexact_division(monkeypatch):
    """Make the CPU divide as an NVIDIA GPU does (within 2 ulps); yields a function that sets
    whether qformats repairs the quotient there (as it does off the CPU)."""
    from qformats import _fmt_common

    monkeypatch.setattr(_fmt_common, "_quotient", nudged_quotient)

    def repair(on):
        monkeypatch.setattr(_fmt_common, "IEEE_DIVISION_PLATFORMS", () if on else ("cpu",))
        jax.clear_caches()  # traced branches hold the division they were traced with

    yield repair
    jax.clear_caches()
