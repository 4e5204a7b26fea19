"""The scalified ``reduce_sum`` sums its operand with the size-1 axes squeezed out.

On XLA's CPU runtime (YNNPACK reductions) a sum whose operand has a size-1 axis ran ten times
slower or worse: softmax's backward in flax NNX attention sums a (1, 8, 16, 256, 256) product
over its last axis, and that one reduction took 111 ms of a 540 ms MXFP8 training step
(docs/performance.md). The squeeze is a free reshape; these tests check that the rule emits it
and that the sum is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import scalify as jsa
from scalify._walk import sub_jaxprs


def _reduce_sum_operand_shapes(jaxpr):
    shapes = []
    for e in jaxpr.eqns:
        if e.primitive is jax.lax.reduce_sum_p:
            shapes.append(tuple(e.invars[0].aval.shape))
        for sub in sub_jaxprs(e):
            shapes += _reduce_sum_operand_shapes(sub)
    return shapes


def test_the_sum_over_a_unit_axis_operand_is_bound_without_it():
    a = jsa.as_scaled_array(jnp.ones((1, 8, 4, 16), jnp.float32))
    jaxpr = jax.make_jaxpr(jsa.scalify(lambda a: jnp.sum(a * a, axis=-1)))(a).jaxpr
    shapes = _reduce_sum_operand_shapes(jaxpr)
    assert (8, 4, 16) in shapes, shapes
    assert all(1 not in s for s in shapes), shapes


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 1, 2, 3, 8]), min_size=1, max_size=5),
    data=st.data(),
    seed=st.integers(0, 2**16),
    jit=st.booleans(),
)
def test_sum_with_unit_axes_equals_the_float64_sum(shape, data, seed, jit):
    shape = tuple(shape)
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1)))))
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    f = jsa.scalify(lambda a, b: jnp.sum(a * b, axis=axes))
    f = jax.jit(f) if jit else f
    got = f(jsa.as_scaled_array(jnp.asarray(a)), jsa.as_scaled_array(jnp.asarray(b)))
    got = np.asarray(got.to_array(jnp.float32) if isinstance(got, jsa.ScaledArray) else got, np.float64)
    terms = a.astype(np.float64) * b.astype(np.float64)
    expected = terms.sum(axis=axes)
    assert got.shape == expected.shape
    # float32 products and accumulation: at most (n + 1) roundings of 2^-24 relative to sum |terms|
    n = int(np.prod([shape[i] for i in axes])) if axes else 1
    bound = (n + 1) * 2.0**-24 * np.abs(terms).sum(axis=axes) + 1e-30
    np.testing.assert_array_less(np.abs(got - expected), bound + 1e-12 * np.abs(expected))


def test_integer_sum_over_a_unit_axis_operand_keeps_the_programs_dtype():
    # The squeezed sum is the program's own reduce_sum (no jnp promotion of int8 to int32).
    v = np.arange(20, dtype=np.int8).reshape(1, 4, 5)
    fn = lambda a: jnp.sum(a, axis=-1, dtype=jnp.int8)
    out = jax.jit(jsa.scalify(fn))(jsa.ScaledArray(jnp.asarray(v), jnp.float32(1.0)))
    data = out.data if isinstance(out, jsa.ScaledArray) else out
    assert data.dtype == jax.eval_shape(fn, v).dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), v.sum(axis=-1).astype(np.float32))
