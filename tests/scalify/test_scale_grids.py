"""Scale grids stay coarser than the data they scale.

A rule that gives every element its own scale (a gathered per-channel table at full resolution,
the outer product of two per-channel grids) turns each later operation into two passes over data-
sized arrays: found in the step ratios of third-party models (int8 per channel and MXFP8 embeddings,
2.2x the float32 step). Values are checked against the same program on the dequantized float32
operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qformats as qf
import scalify as jsa
from scalify._walk import sub_jaxprs

RNG = np.random.default_rng(0)
MODES = {"eager": lambda f: f, "jit": jax.jit}


def _deq(x):
    return np.asarray(x.to_array(jnp.float32) if isinstance(x, jsa.ScaledArray) else x, np.float32)


TABLE = jnp.asarray(RNG.standard_normal((64, 512)) * 3, jnp.float32)
IDS = jnp.asarray(RNG.integers(0, 64, (4, 16)), jnp.int32)

# (format, scale grid of table[IDS]): the grid of the gathered rows, never (4, 16, 512).
GATHERED = [
    (qf.INT8_PER_CHANNEL, (1, 1, 512)),
    (qf.MXFP8, (4, 16, 16)),
    (qf.NVFP4, (4, 16, 32)),
    (qf.FP8_E4M3, ()),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("fmt", "grid"), GATHERED, ids=[f.name for f, _ in GATHERED])
def test_gathered_rows_keep_the_tables_grid(fmt, grid, mode):
    table = jsa.as_scaled_array(TABLE, fmt=fmt)
    out = MODES[mode](jsa.scalify(lambda t, i: t[i]))(table, IDS)
    assert np.shape(out.scale) == grid
    # Data movement: the gathered values are the dequantized table's rows, bit for bit.
    np.testing.assert_array_equal(_deq(out), _deq(table)[np.asarray(IDS)])


@pytest.mark.parametrize("fill", [0.5, -np.inf, 0.0, np.nan])
@pytest.mark.parametrize("fmt", [qf.FP8_E4M3, qf.INT8_PER_CHANNEL, qf.MXFP8], ids=lambda f: f.name)
def test_filling_gather_fills_the_value_not_the_data(fmt, fill):
    # The data is filled with the fill value, so a fill of 0.5 came back as 0.5 * scale (and -inf
    # as +inf next to a -inf scale fill); out-of-bounds entries now get scale 1.
    table = jsa.as_scaled_array(TABLE, fmt=fmt)
    f = lambda t, i: jnp.take(t, i + 40, axis=0, mode="fill", fill_value=fill)
    for wrap in MODES.values():
        out = wrap(jsa.scalify(f))(table, IDS)
        np.testing.assert_array_equal(_deq(out), np.asarray(f(jnp.asarray(_deq(table)), IDS)))


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_slice_of_a_per_channel_array_keeps_its_grid(mode):
    table = jsa.as_scaled_array(TABLE, fmt=qf.INT8_PER_CHANNEL)
    f = lambda t, i: jax.lax.dynamic_slice(t, (i, 64), (3, 64))
    out = MODES[mode](jsa.scalify(f))(table, IDS[0, 0])
    assert np.shape(out.scale) == (1, 64)
    np.testing.assert_array_equal(_deq(out), np.asarray(f(jnp.asarray(_deq(table)), IDS[0, 0])))


_FORMATS = [qf.INT8_PER_CHANNEL, qf.MXFP8, qf.MXFP8.replace(axis=0), qf.NVFP4, qf.FP8_E4M3, qf.MXFP4]


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(_FORMATS),
    rows=st.sampled_from([32, 64]),
    index_shape=st.lists(st.integers(1, 5), min_size=0, max_size=2).map(tuple),
    axis=st.integers(0, 1),
    mode=st.sampled_from(["clip", "fill", "wrap"]),
    seed=st.integers(0, 2**16),
)
def test_gather_equals_the_gather_of_the_dequantized_values(fmt, rows, index_shape, axis, mode, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, 64)) * 2.0 ** rng.integers(-20, 20), jnp.float32)
    hi = x.shape[axis] + 8
    ids = jnp.asarray(rng.integers(0, hi, index_shape), jnp.int32)
    sx = jsa.as_scaled_array(x, fmt=fmt)
    f = lambda t, i: jnp.take(t, i, axis=axis, mode=mode)
    out = jax.jit(jsa.scalify(f))(sx, ids)
    np.testing.assert_array_equal(_deq(out), np.asarray(f(jnp.asarray(_deq(sx)), ids)))
    # Never finer than the data, and no finer than the table's grid times the index count.
    table_scales = sum(np.size(leaf) for leaf in jax.tree.leaves(sx.scale))
    assert np.size(out.scale) <= table_scales * max(1, int(np.prod(index_shape)))


def _carrier(shape, grid, dtype=jnp.float32):
    data = jnp.asarray(RNG.standard_normal(shape), dtype)
    scale = jnp.asarray(2.0 ** RNG.integers(-6, 6, grid), jnp.float32)
    return jsa.ScaledArray(data, scale)


def _f32_close(out, ref):
    # float32 accumulation in another order on values rescaled by powers of two (exact): a few ulps
    # of the largest term.
    np.testing.assert_allclose(_deq(out), ref, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(ref))))


@pytest.mark.parametrize("mode", MODES)
def test_contraction_of_two_per_channel_carriers_keeps_one_grid(mode):
    a, b = _carrier((64, 128), (64, 1)), _carrier((128, 96), (1, 96))
    out = MODES[mode](jsa.scalify(lambda x, y: x @ y))(a, b)
    # The outer product of the grids was (64, 96): one scale per output element.
    assert np.shape(out.scale) == (1, 96)
    _f32_close(out, _deq(a) @ _deq(b))


def _largest_reduction(fn, *args) -> int:
    sizes = [0]

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "reduce_max":
                sizes.append(int(np.prod(e.invars[0].aval.shape)))
            for sub in sub_jaxprs(e):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return max(sizes)


@pytest.mark.parametrize("mode", MODES)
def test_contraction_over_a_blocked_axis_is_not_measured_afterwards(mode):
    # A carrier with blocks along the contracted axis (activations that kept an MX embedding's
    # grid) was dequantized, contracted and then settled on the measured amax of the (256, 256)
    # output: two more passes over it, and XLA could not fold a transpose of it into the GEMM.
    # Folded instead, the operands are measured (2 x 256 x 64 elements) and the output is not.
    # Only the first row leaves the program, so the settle of scalify's outputs measures 256.
    a, b = _carrier((256, 64), (256, 2)), _carrier((64, 256), ())
    f = jsa.scalify(lambda x, y: (x @ y)[:1])
    assert _largest_reduction(f, a, b) < 256 * 256
    _f32_close(MODES[mode](f)(a, b), (_deq(a) @ _deq(b))[:1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [jnp.add, jnp.subtract, jnp.maximum], ids=lambda f: f.__name__)
def test_per_row_and_per_column_operands_keep_one_grid(op, mode):
    # Aligning a (64, 1) grid with a (1, 96) one gave their outer product, one scale per element,
    # which every later rule then aligned and carried like data (eqx_cnn's int8 step: 1.7x the
    # float32 step). The smaller grid is folded to per-tensor instead; values are exact in float32.
    a, b = _carrier((64, 96), (64, 1)), _carrier((64, 96), (1, 96))
    out = MODES[mode](jsa.scalify(op))(a, b)
    assert np.shape(out.scale) == (1, 96)
    _f32_close(out, np.asarray(op(_deq(a), _deq(b))))


def _f16_close(out, ref):
    # One rounding to float16 data: half an ulp (2^-11 relative), or half the subnormal spacing
    # (2^-25) times the block's scale where the sum's data is subnormal.
    np.testing.assert_allclose(_deq(out), ref, rtol=2**-10, atol=2**-24 * float(np.max(out.scale)))


@pytest.mark.parametrize("mode", MODES)
def test_narrow_carriers_keep_the_outer_grid(mode):
    # float16 data cannot take a fold's s / max s without flushing its small blocks: the exact
    # outer grid stays.
    a, b = _carrier((64, 96), (64, 1), jnp.float16), _carrier((64, 96), (1, 96), jnp.float16)
    out = MODES[mode](jsa.scalify(jnp.add))(a, b)
    assert np.shape(out.scale) == (64, 96)
    _f16_close(out, _deq(a) + _deq(b))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grid", [(4, 64, 32), (1, 1, 512), (4, 64, 1)], ids=["mx-blocks", "per-column", "per-row"])
def test_a_grid_meeting_a_per_tensor_operand_is_folded(grid, mode):
    # MX rows from an embedding plus a per-tensor position embedding kept the block grid, which
    # then went down the residual stream into every alignment and reduction (keras MXFP8 step
    # 1.36x -> 1.24x with the fold). float32 holds the blocks' range: values are exact.
    a, b = _carrier((4, 64, 512), grid), _carrier((4, 64, 512), ())
    out = MODES[mode](jsa.scalify(jnp.add))(a, b)
    assert np.size(out.scale) == 1
    _f32_close(out, _deq(a) + _deq(b))


@pytest.mark.parametrize("mode", MODES)
def test_narrow_carriers_keep_their_grid_next_to_a_per_tensor_operand(mode):
    a, b = _carrier((4, 64, 512), (4, 64, 32), jnp.float16), _carrier((4, 64, 512), (), jnp.float16)
    out = MODES[mode](jsa.scalify(jnp.add))(a, b)
    assert np.shape(out.scale) == (4, 64, 32)
    _f16_close(out, _deq(a) + _deq(b))
