"""The settle of a carrier (its data's amax measured, a power of two moved into the scale) costs
one pass over the data for the measurement.

Masking non-finite elements before the reduction (``max(where(isfinite(v), |v|, 0))``) kept
XLA on CPU from fusing the reduction with ``|v|``: three passes over every settled parameter and
Adam moment at the exit of a training step. The mask now applies only when the plain max is not
finite; the result is the masked max either way (checked here against NumPy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scalify as jsa
from scalify._rules_common import block_amax
from scalify._walk import sub_jaxprs

MODES = {"eager": lambda f: f, "jit": jax.jit}


def _masked_amax(v, grid):
    a = np.where(np.isfinite(v), np.abs(v), 0).astype(np.float32)
    if not grid:
        return a.max()
    inter = [d for g, n in zip(grid, v.shape, strict=True) for d in (g, n // g)]
    return a.reshape(inter).max(axis=tuple(range(1, 2 * v.ndim, 2)))


@settings(max_examples=40, deadline=None)
@given(
    grid=st.sampled_from([(), (1, 1), (4, 1), (1, 8), (2, 4), (8, 16)]),
    specials=st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3),
    log2=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(list(MODES)),
)
def test_block_amax_is_the_max_over_finite_elements(grid, specials, log2, seed, mode):
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal((8, 16)) * 2.0**log2).astype(np.float32)
    for s in specials:  # NaN / Inf anywhere: the other elements (and blocks) keep their amax
        v[rng.integers(0, 8), rng.integers(0, 16)] = s
    got = MODES[mode](lambda v: block_amax(v, grid))(jnp.asarray(v))
    np.testing.assert_array_equal(np.asarray(got), _masked_amax(v, grid))


@pytest.mark.parametrize("mode", MODES)
def test_an_inf_element_does_not_stop_the_others_settling(mode):
    # Data of amax 2^12 is outside the window: the settle moves 2^12 into the scale. With one Inf
    # element, the measured max is Inf; the masked max still settles the finite elements.
    v = np.full((16, 16), 4096.0, np.float32)
    v[3, 5] = np.inf
    x = jsa.ScaledArray(jnp.asarray(v), jnp.float32(1.0))
    out = MODES[mode](jsa.scalify(lambda x: x * 1.0))(x)
    data = np.asarray(out.data)
    assert np.max(np.abs(data[np.isfinite(data)])) <= 2.0**7
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), v)


def _reduced_operands(jaxpr, producers=None):
    """(primitive producing the operand) of every data-sized reduce_max outside a cond's branches."""
    found = []
    producers = {} if producers is None else producers
    for e in jaxpr.eqns:
        for v in e.outvars:
            producers[v] = e.primitive.name
        if e.primitive.name == "reduce_max" and np.prod(e.invars[0].aval.shape) >= 256 * 256:
            found.append(producers.get(e.invars[0], "input"))
        if e.primitive.name != "cond":
            for sub in sub_jaxprs(e):
                found += _reduced_operands(sub, {})
    return found


def test_the_settle_measures_abs_of_the_data_directly():
    x = jsa.ScaledArray(jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32), 1.0)
    jaxpr = jax.make_jaxpr(jsa.scalify(lambda x: x * 3.0 + 1.0))(x).jaxpr
    ops = _reduced_operands(jaxpr)
    # The output is settled: one measurement, of |v| (a select there costs XLA two more passes).
    assert ops == ["abs"], ops
