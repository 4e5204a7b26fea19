"""The settle of a carrier (its data's amax measured, a power of two moved into the scale) reads
the data directly for the measurement.

Masking non-finite elements before the reduction (``max(where(isfinite(v), |v|, 0))``) kept
XLA on CPU from fusing the reduction with ``|v|``: three passes over every settled parameter and
Adam moment at the exit of a training step. Above ``STRAIGHT_LINE`` elements the mask now applies
only when the plain max or the NaN check ``sum(v) * 0`` beside it is not finite; the result is the
masked max either way (checked here against NumPy).
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
from scalify._rules_common import STRAIGHT_LINE, block_amax
from scalify._walk import sub_jaxprs

MODES = {"eager": lambda f: f, "jit": jax.jit}


def _masked_amax(v, grid):
    a = np.where(np.isfinite(v), np.abs(v), 0).astype(np.float32)
    if not grid:
        return a.max()
    inter = [d for g, n in zip(grid, v.shape, strict=True) for d in (g, n // g)]
    return a.reshape(inter).max(axis=tuple(range(1, 2 * v.ndim, 2)))


# Both sides of STRAIGHT_LINE: the masked max directly, and the plain max with the masked one as
# a conditional fallback.
SHAPES = [(8, 16), (256, 128)]
assert SHAPES[0][0] * SHAPES[0][1] <= STRAIGHT_LINE < SHAPES[1][0] * SHAPES[1][1]


@settings(max_examples=40, deadline=None)
@given(
    grid=st.sampled_from([(), (1, 1), (4, 1), (1, 8), (2, 4), (8, 16)]),
    shape=st.sampled_from(SHAPES),
    specials=st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=3),
    log2=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(list(MODES)),
)
def test_block_amax_is_the_max_over_finite_elements(grid, shape, specials, log2, seed, mode):
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(shape) * 2.0**log2).astype(np.float32)
    for s in specials:  # NaN / Inf anywhere: the other elements (and blocks) keep their amax
        v[rng.integers(0, shape[0]), rng.integers(0, shape[1])] = s
    got = np.asarray(MODES[mode](lambda v: block_amax(v, grid))(jnp.asarray(v)))
    np.testing.assert_array_equal(got, _masked_amax(v, grid))


def test_a_nan_cannot_hide_the_finite_max():
    # XLA's vectorised float max on CPU lets a NaN reset the running max of its lane: for this
    # tensor (seed 18, two NaNs) jnp.max gives 4.08 where the finite elements' max is 4.23. The
    # fast path must notice the NaN and take the masked max. (Should XLA's max propagate the NaN
    # one day, the test still holds: the fast path then sees a NaN max.)
    rng = np.random.default_rng(18)
    v = rng.standard_normal((256, 128)).astype(np.float32)
    for _ in range(2):
        v[rng.integers(0, 256), rng.integers(0, 128)] = np.nan
    want = np.max(np.abs(v[np.isfinite(v)]))
    for mode, run in MODES.items():
        assert np.asarray(run(lambda v: block_amax(v, ()))(jnp.asarray(v))) == want, mode


def test_a_sum_that_overflows_leaves_the_result_exact():
    # Finite elements near 3e36 above STRAIGHT_LINE: their float32 sum overflows and the NaN check
    # sum(v) * 0 is NaN. That may only route the tensor to the masked max (here the same value as
    # the plain max), never leak into the result. Per block too.
    v = np.full((256, 128), 3e36, np.float32)
    v[7, 9] = 5e36
    for grid in [(), (4, 1)]:
        for mode, run in MODES.items():
            got = np.asarray(run(lambda v, grid=grid: block_amax(v, grid))(jnp.asarray(v)))
            np.testing.assert_array_equal(got, _masked_amax(v, grid), err_msg=f"{mode} {grid}")


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


def _two_operands(magnitude):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((256, 256)) * magnitude).astype(np.float32)
    w = (rng.standard_normal((256, 256)) * magnitude).astype(np.float32)
    return x, w


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", [qf.MXFP8, qf.MXFP4, qf.NVFP4], ids=lambda f: f.name)
def test_a_constant_scale_output_leaves_without_a_settle(fmt, mode):
    """A contraction of operands blocked along K applies the block scales in its GEMM: the output
    is a float32 carrier of constant scale, its data the value itself. Nothing can compound across
    steps, so it leaves unsettled (no pass over the output), even with an amax far outside the
    window; the value is the float32 contraction of the dequantized operands (summation order)."""
    x, w = _two_operands(64.0)  # output amax ~ 2^19: a settle would have moved 2^12 into the scale
    a, b = jsa.as_scaled_array(x, fmt=fmt), jsa.as_scaled_array(w, fmt=fmt.replace(axis=0))
    f = jsa.scalify(jnp.matmul)
    ops = _reduced_operands(jax.make_jaxpr(f)(a, b).jaxpr)
    out = MODES[mode](f)(a, b)
    ref = np.asarray(a.to_array(jnp.float32), np.float64) @ np.asarray(b.to_array(jnp.float32), np.float64)
    if fmt is qf.NVFP4:
        # NVFP4's float32 tensor scales stay out of the GEMM: a traced output scale, settled.
        assert ops == ["abs"], ops
    else:
        assert ops == [], ops
        assert isinstance(out.scale, jax.Array) and float(out.scale) == 1.0
        assert np.max(np.abs(np.asarray(out.data))) > 2.0**7
    # float32 summation of 256 exact products: |err| <= 256 * 2^-24 * sum|a||b| per output.
    bound = 256 * 2.0**-24 * (np.abs(np.asarray(a.to_array(jnp.float32))) @ np.abs(np.asarray(b.to_array(jnp.float32))))
    assert np.all(np.abs(np.asarray(out.to_array(jnp.float32), np.float64) - ref) <= bound)


def test_a_traced_scale_output_is_still_settled():
    # Carriers of runtime scale: the output's scale is a product of traced scales, which a step
    # would compound; the exit settle still measures it. The operands are smaller than the output,
    # so the rule renormalises them and returns the plain dot of their data (64 * 1.5 * 1.5 = 144,
    # outside the window) without settling it: only the exit brings the data back into the window.
    x, w = np.full((512, 64), 3.0, np.float32), np.full((64, 512), 3.0, np.float32)
    a, b = jsa.ScaledArray(jnp.asarray(x), jnp.float32(1.0)), jsa.ScaledArray(jnp.asarray(w), jnp.float32(1.0))
    out = jax.jit(jsa.scalify(jnp.matmul))(a, b)
    assert np.max(np.abs(np.asarray(out.data))) <= 2.0**7
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), x @ w)


def _data_sized(eqn, size):
    return any(np.prod(v.aval.shape) >= size for v in eqn.outvars)


def _muls(jaxpr, size, in_loop=False):
    """(data-sized mul inside a while body, outside one) counts, nested jaxprs included."""
    inside = outside = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "mul" and _data_sized(e, size):
            inside, outside = inside + in_loop, outside + (not in_loop)
        for sub in sub_jaxprs(e):
            i, o = _muls(sub, size, in_loop or e.primitive.name == "while")
            inside, outside = inside + i, outside + o
    return inside, outside


def test_an_exit_value_inside_the_window_is_not_rewritten():
    """The exit settle's rescale (a read and a write of the whole output) runs in a loop of zero or
    one iterations: skipped when the amax is already in the window, as a trained model's
    parameters and moments are from step to step. A ``cond`` would have cost the same pass: XLA
    copies the untaken branch's operand into the conditional's own output buffer."""
    x = np.random.default_rng(2).standard_normal((512, 512)).astype(np.float32)
    a = jsa.ScaledArray(jnp.asarray(x), jnp.float32(0.5))
    f = jsa.scalify(lambda a: a - a * a)  # a traced-scale output: settled at the exit
    inside, outside = _muls(jax.make_jaxpr(f)(a).jaxpr, x.size)
    assert inside == 1, (inside, outside)  # the rescale, in the loop; the program's own a * a outside
    hlo = jax.jit(f).lower(a).compile().as_text()
    assert not [line for line in hlo.splitlines() if " copy(" in line and "f32[512,512]" in line.split("=")[1]]
    out = jax.jit(f)(a)
    v = np.asarray(a.to_array(jnp.float32))
    assert 2.0**-7 <= np.max(np.abs(np.asarray(out.data))) <= 2.0**7
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), v - v * v, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("member", [(64, 64), (256, 128)], ids=["straight-line", "loop"])
@pytest.mark.parametrize("magnitude", [1.0, 2.0**20, 2.0**-20], ids=["inside", "above", "below"])
def test_the_exit_rescale_differentiates_and_vectorises(magnitude, member):
    """Reverse mode through the exit (a while loop alone has no transpose: the rescale carries its
    own JVP, the division by the settled power of two) and ``vmap`` over batch members of which
    some are inside the window and some not: both equal the float32 program. A member of at most
    ``STRAIGHT_LINE`` elements is rescaled without the loop, a larger one in it."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, *member)) * np.array([1.0, magnitude, 1.0, 2.0**-3])[:, None, None]).astype(np.float32)

    def value(x):
        y = jsa.scalify(lambda a: a * a + a)(jsa.ScaledArray(x, jnp.float32(1.0)))
        return jnp.sum(y.to_array(jnp.float32) * jnp.cos(x))

    ref = jax.grad(lambda x: jnp.sum((x * x + x) * jnp.cos(x)))(x)
    # (2x + 1) cos x - (x^2 + x) sin x, in two float32 programs of about eight roundings each
    # (the scales are powers of two, exact): 32 units of 2^-24 of the terms, which may cancel.
    terms = np.abs(2 * x + 1) * np.abs(np.cos(x)) + np.abs(x * x + x) * np.abs(np.sin(x))
    err = np.abs(np.asarray(jax.jit(jax.grad(value))(x), np.float64) - np.asarray(ref, np.float64))
    assert np.all(err <= 32 * 2.0**-24 * terms), np.max(err / terms)
    members = jsa.ScaledArray(x, jnp.ones((4,), jnp.float32))
    f = jax.vmap(jsa.scalify(lambda a: a * a + a))
    assert ("while[" in str(jax.make_jaxpr(f)(members))) == (np.prod(member) > STRAIGHT_LINE)
    batched = jax.jit(f)(members)
    np.testing.assert_allclose(np.asarray(batched.to_array(jnp.float32)), x * x + x, rtol=1e-6)
    for i in range(4):
        assert 2.0**-7 <= np.max(np.abs(np.asarray(batched.data[i]))) <= 2.0**7


def test_an_output_the_program_also_reads_is_settled_where_it_is_produced():
    """An Adam-like update returns the new moment and reads it for the parameter: the moment is
    settled once, where it is produced, and the parameter update reads the settled value. Settled
    at the exit, its buffer was still read by the update, so the in-place rescale copied it."""
    rng = np.random.default_rng(4)
    p, m, g = (rng.standard_normal((512, 512)).astype(np.float32) for _ in range(3))

    def update(p, m, g):
        m = 0.9 * m + 0.1 * g
        return p - 1e-3 * m, m, 2.0  # a literal output too: settled (left) at the exit

    args = [jsa.ScaledArray(jnp.asarray(a), jnp.float32(1.0)) for a in (p, m, g)]
    f = jsa.scalify(update)
    settles = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.params.get("name") == "_settle_stored"]
    assert len(settles) == 2, len(settles)
    hlo = jax.jit(f).lower(*args).compile().as_text()
    assert not [line for line in hlo.splitlines() if " copy(" in line and "f32[512,512]" in line.split("=")[1]]
    new_p, new_m, two = jax.jit(f)(*args)
    ref_m = np.float32(0.9) * m + np.float32(0.1) * g
    np.testing.assert_allclose(np.asarray(new_m.to_array(jnp.float32)), ref_m, rtol=1e-6, atol=1e-7)
    # a few float32 roundings of the terms, which cancel where p ~ 1e-3 m
    err = np.abs(np.asarray(new_p.to_array(jnp.float32), np.float64) - (p - np.float32(1e-3) * ref_m))
    assert np.all(err <= 8 * 2.0**-24 * (np.abs(p) + 1e-3 * np.abs(ref_m)))
    assert float(two) == 2.0
