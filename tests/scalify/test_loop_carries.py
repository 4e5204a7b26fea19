"""Loop carries and static data bounds: what a scalified loop costs and what it computes.

A wide (float32) accumulator is carried on one scale for the whole loop, carries the body multiplies
are settled with their bound known inside the body, the bounds of scanned values (a forward scan's
residuals read by its transpose) reach the body, and a contraction whose operands' bounds are known
is the plain contraction of the data. Each check compares with the float32 program on the same
values, and the cost with the jaxpr: the number of amax reductions (``reduce_max``) the scalified
program runs inside the loop, which is what made the haiku LSTM's step 7.5x the float32 step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qformats as qf
import scalify as jsa

RNG = np.random.default_rng(11)


def _loop_bodies(closed):
    """The bodies of every scan / while in ``closed`` (nested jits included), except the exit
    settle's own zero-or-one-iteration rescale loop."""
    out = []
    for e in closed.jaxpr.eqns:
        if e.params.get("name") == "_settle_stored":
            continue
        if e.primitive.name in ("scan", "while"):
            out.append(e.params["jaxpr" if e.primitive.name == "scan" else "body_jaxpr"])
        for v in e.params.values():
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                out += _loop_bodies(v)
    return out


def _count(closed, name, min_size=0):
    """Equations named ``name`` (nested jits included) with an operand of at least ``min_size``."""
    n = 0
    for e in closed.jaxpr.eqns:
        if e.primitive.name == name and any(getattr(v.aval, "size", 0) >= min_size for v in e.invars):
            n += 1
        for v in e.params.values():
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                n += _count(v, name, min_size)
    return n


def _lstm_like():
    """A scan over T steps whose transpose accumulates a (K, N) weight gradient from rank-B
    outer products, the structure of an RNN's backward pass."""
    t, b, k, n = 16, 4, 64, 96
    xs = jnp.asarray(RNG.normal(size=(t, b, k)), jnp.float32)
    w = jnp.asarray(RNG.normal(size=(k, n)) / np.sqrt(k), jnp.float32)

    def loss(w, xs):
        def step(h, x):
            h = jnp.tanh(x @ w + h)
            return h, h

        _, hs = jax.lax.scan(step, jnp.zeros((b, n), jnp.float32), xs)
        return jnp.sum(hs * hs)

    return loss, w, xs


@pytest.mark.parametrize("fmt_name", ["fp16", "mxfp8"])
def test_rnn_gradient_equals_float32_without_amax_over_the_accumulator(fmt_name):
    loss, w, xs = _lstm_like()
    fmt = qf.get_format(fmt_name)
    qw = jsa.as_scaled_array(w, fmt=fmt)
    dw = np.asarray(qw.to_array(jnp.float32))
    expected = jax.jit(jax.grad(loss))(jnp.asarray(dw), xs)
    fn = jsa.scalify(jax.grad(loss))
    got = jax.jit(fn)(qw, xs)
    # The same float32 operations on the same values, up to summation order and power-of-two
    # scales (exact): float32 rounding of a 64-step accumulation.
    np.testing.assert_allclose(np.asarray(got.to_array(jnp.float32)), np.asarray(expected), rtol=2e-5, atol=1e-5)
    closed = jax.make_jaxpr(fn)(qw, xs)
    backward = [b for b in _loop_bodies(closed) if _count(b, "dot_general")]
    size = w.size
    for body in backward:
        # No measuring pass over anything the size of the weight gradient inside the loop.
        assert _count(body, "reduce_max", min_size=size) == 0, body


def test_wide_accumulator_keeps_one_scale_and_tracks_float32():
    """A float32 accumulator of terms spanning 2^-40..2^40: the carry keeps the entry scale for
    every iteration (no amax inside the loop) and the sum equals float32's."""
    terms = jnp.asarray(2.0 ** RNG.integers(-40, 40, size=(64, 8)) * RNG.normal(size=(64, 8)), jnp.float32)
    init = jsa.ScaledArray(jnp.ones((8,), jnp.float32), jnp.asarray(2.0**-10, jnp.float32))

    def f(c, ts):
        return jax.lax.scan(lambda c, t: (c + t, None), c, ts)[0]

    fn = jsa.scalify(f)
    got = jax.jit(fn)(init, terms)
    expected = jax.jit(f)(init.to_array(), terms)
    np.testing.assert_allclose(np.asarray(got.to_array()), np.asarray(expected), rtol=1e-6)
    (body,) = _loop_bodies(jax.make_jaxpr(fn)(init, terms))
    assert _count(body, "reduce_max") == 0
    # The carry's scale is a loop constant: the body returns it unchanged.
    assert body.jaxpr.outvars[1] in body.jaxpr.invars


def test_wide_accumulator_out_of_scale_window_is_recentred():
    """An entry scale of 2^100 is re-centred for the loop (its power of two moves into the data,
    the loop's scale lies in [2^-32, 2^32]): terms near 2^-30, which float32 holds, add as in
    float32 instead of flushing against a 2^100 scale (data 2^-130)."""
    init = jsa.ScaledArray(jnp.zeros((4,), jnp.float32), jnp.asarray(2.0**100, jnp.float32))
    terms = jnp.asarray(2.0**-30 * RNG.normal(size=(32, 4)), jnp.float32)

    def f(c, ts):
        return jax.lax.scan(lambda c, t: (c + t, None), c, ts)[0]

    got = jax.jit(jsa.scalify(f))(init, terms)
    np.testing.assert_allclose(np.asarray(got.to_array()), np.asarray(jnp.sum(terms, axis=0)), rtol=1e-5)


def test_carry_the_body_multiplies_is_settled_and_bounded():
    """A carry multiplied by a scanned value each step (a decay): settled each iteration, so the
    product inside the body needs no renormalising reduction of either operand."""
    xs = jsa.ScaledArray(jnp.asarray(RNG.uniform(0.5, 0.99, (50, 16)), jnp.float32), jnp.asarray(1.0, jnp.float32))
    init = jsa.ScaledArray(jnp.ones((16,), jnp.float32), jnp.asarray(1.0, jnp.float32))

    def f(c, xs):
        return jax.lax.scan(lambda c, x: (c * jnp.tanh(x) + 0.5, None), c, xs)[0]

    fn = jsa.scalify(f)
    got = jax.jit(fn)(init, xs)
    expected = f(init.to_array(), xs.to_array())
    np.testing.assert_allclose(np.asarray(got.to_array()), np.asarray(expected), rtol=1e-5)
    assert 2.0**-7 <= float(np.max(np.abs(np.asarray(got.data)))) <= 2.0**7
    (body,) = _loop_bodies(jax.make_jaxpr(fn)(init, xs))
    # One amax: the settle of the carry; the tanh of the slice is bounded, the carry's bound known.
    assert _count(body, "reduce_max") == 1


def test_scanned_residuals_keep_their_bounds():
    """The transpose of a scan reads the forward's stacked residuals (tanh outputs, bound 1): their
    products with the cotangent carry in the backward body need no renormalising pass over them."""
    loss, w, xs = _lstm_like()
    fn = jsa.scalify(jax.grad(loss))
    qw = jsa.as_scaled_array(w, fmt=qf.FP16)
    bodies = _loop_bodies(jax.make_jaxpr(fn)(qw, xs))
    backward = [b for b in bodies if _count(b, "transpose") or _count(b, "dot_general")]
    n_reductions = sum(_count(b, "reduce_max") for b in backward)
    # The settles of the two non-accumulator carries (h's cotangent and the tanh residual's
    # product), at most one per carried or multiplied value of unknown magnitude: the xs cotangent
    # slices of the loss (sum(hs * hs)'s gradient) are read in once each.
    assert n_reductions <= 4, n_reductions


@pytest.mark.parametrize("shape", [(8, 32, 16), (4, 64, 48)])
def test_contraction_with_known_bounds_is_the_plain_contraction(shape):
    """Two settled carriers (bound 2^7): their product is the float32 dot of the data, scales
    multiplied, with no growth allowance and no measured settle."""
    m, k, n = shape
    a = jsa.ScaledArray(jnp.asarray(RNG.normal(size=(m, k)), jnp.float32), jnp.asarray(2.0**-3, jnp.float32))
    b = jsa.ScaledArray(jnp.asarray(RNG.normal(size=(k, n)), jnp.float32), jnp.asarray(2.0**5, jnp.float32))

    def f(a, b):
        a, b = jnp.tanh(a), jnp.tanh(b)  # bounded functions: data bound known
        return a @ b

    fn = jsa.scalify(f)
    out = jax.jit(fn)(a, b)
    expected = f(a.to_array(), b.to_array())
    np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(expected), rtol=1e-5, atol=1e-6)
    closed = jax.make_jaxpr(fn)(a, b)
    # One reduction: the settle of the program's output (every carried value leaves settled); the
    # contraction itself neither measures nor divides by a growth allowance.
    assert _count(closed, "reduce_max", min_size=m * n) == 1
    (dot,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
    consumers = [e.primitive.name for e in closed.jaxpr.eqns if dot.outvars[0] in e.invars]
    assert consumers == ["pjit"] or consumers == ["jit"], consumers


def _halve_and_count(x):
    """Halve ``x`` until its max magnitude is at most 1, counting steps and summing what was removed:
    a trip count that depends on the data, a multiplied carry, an accumulator and an integer carry."""

    def body(c):
        v, removed, n = c
        return v * 0.5, removed + v * 0.5, n + 1

    return jax.lax.while_loop(lambda c: jnp.max(jnp.abs(c[0])) > 1.0, body, (x, jnp.zeros_like(x), 0))


@pytest.mark.parametrize("fmt_name", ["carrier", "fp8_e4m3", "mxfp8", "nvfp4"])
def test_vmapped_while_runs_each_example_its_own_trip_count(fmt_name):
    """``scalify(jax.vmap(f))`` of a while loop whose trip count depends on the example: the loop's
    predicate is batched (while_p runs while any example's holds and keeps each carry where its own
    is false). Before, re-emitting it through lax.while_loop raised TypeError (non-scalar predicate).
    Halving is exact and the accumulated sums are of powers of two times the data, so the values are
    the float32 program's up to float32 rounding of the sums."""
    x = (RNG.standard_normal((6, 32)) * np.exp2(np.arange(6))[:, None]).astype(np.float32)
    sx = (
        jsa.as_scaled_array(jnp.asarray(x), scale=np.float32(2.0))
        if fmt_name == "carrier"
        else jsa.as_scaled_array(jnp.asarray(x), fmt=qf.get_format(fmt_name))
    )
    expected = jax.vmap(_halve_and_count)(jnp.asarray(np.asarray(sx)))
    assert len(set(np.asarray(expected[2]).tolist())) > 3  # the examples stop after different counts
    got = jax.jit(jsa.scalify(jax.vmap(_halve_and_count)))(sx)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(expected[2]))
    for g, e in zip(got[:2], expected[:2], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-6 * float(jnp.abs(e).max()))
