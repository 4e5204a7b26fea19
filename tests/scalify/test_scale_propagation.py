"""Scale propagation that keeps data in range without hand-placed rescaling.

The jax-scalify behaviours an unchanged program relies on (static factors fold into the scale, a
select with a static branch adopts the other branch's scale) and the measured policy's window.
Every check compares values with the float32 program on the dequantized inputs, and the data
(what the low-precision carrier holds) with the window it must stay in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scalify as jsa

MODES = {"eager": lambda f: f, "jit": jax.jit}
RNG = np.random.default_rng(3)


def _carrier(data, scale, dtype=jnp.float32):
    return jsa.ScaledArray(jnp.asarray(data, dtype), jnp.asarray(scale, jnp.float32))


def _amax(x):
    return float(np.max(np.abs(np.asarray(x.data, np.float32))))


@pytest.mark.parametrize("mode", MODES)
def test_mean_gradient_puts_one_over_n_in_the_scale(mode):
    """grad of mean(x * x): the 1/N of the cotangent is a static factor, so it joins the scale."""
    x = _carrier(RNG.uniform(1, 2, (16, 16)), 1.0)
    g = MODES[mode](jsa.scalify(jax.grad(lambda a: jnp.mean(a * a))))(x)
    np.testing.assert_allclose(g.to_array(), 2 * np.asarray(x.data) / 256, rtol=1e-6)
    assert _amax(g) >= 1.0, "the 1/256 landed in the data"


@pytest.mark.parametrize("mode", MODES)
def test_select_with_zeros_keeps_a_tiny_float16_gradient(mode):
    """relu's backward ``select(x > 0, g, 0)`` on a float16 gradient with scale 2^-26: the zero fill
    adopts the scale (jax-scalify), where a common scale of max(1, 2^-26) flushes the data."""
    g = _carrier(RNG.uniform(-2, 2, (8, 8)), 2.0**-26, jnp.float16)
    x = jnp.asarray(RNG.normal(size=(8, 8)), jnp.float32)
    f = MODES[mode](jsa.scalify(lambda g, x: jnp.where(x > 0, g, jnp.zeros_like(g))))
    out = f(g, x)
    ref = np.where(np.asarray(x) > 0, np.asarray(g.data, np.float32) * 2.0**-26, 0)
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), ref)


@pytest.mark.parametrize("fill", [-2.3819763e38, float(np.finfo(np.float32).min), -1e30, -np.inf, 1e38, np.inf])
@pytest.mark.parametrize("scale", [2.0**-30, 0.25, 2.0**30])
def test_static_fill_in_where_takes_the_scale_of_the_other_branch(fill, scale):
    """An attention mask written as a large literal: softmax of the masked logits (and of a fully
    masked row) equals float32's, under jit too (the fill used to set the common scale to 2^127)."""
    x = _carrier(RNG.normal(size=(4, 6)), scale)
    mask = jnp.asarray(np.tril(np.ones((4, 6), bool)))
    mask = mask.at[3].set(False)  # a fully masked row

    def f(v):
        return jax.nn.softmax(jnp.where(mask, v, fill), axis=-1)

    ref = np.asarray(f(x.to_array()))
    for wrap in MODES.values():
        got = np.asarray(wrap(jsa.scalify(f))(x).to_array())
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fill", [-2.3819763e38, float(np.finfo(np.float32).min), -1e30, -np.inf, 1e38])
@pytest.mark.parametrize("scale", [2.0**-30, 0.25, 2.0**30])
@pytest.mark.parametrize("wrap", ["argument", "checkpoint"])
def test_runtime_fill_in_where_takes_the_scale_of_the_other_branch(fill, scale, wrap):
    """The mask value as a traced scalar: a model's own array (penzai's attention mask holds
    -2.38e38 as a leaf), an argument of the jitted function, or traced again by ``jax.checkpoint``
    (penzai's ``Checkpointed``). Its power of two set the common scale (2^127): the logits' data
    was flushed to zero, the softmax came out uniform or, after ``jax.nn.softmax``'s own ``max(-inf,
    .)`` took 1 / 2^127 (subnormal, flushed), NaN."""
    x = _carrier(RNG.normal(size=(4, 6)), scale)
    mask = jnp.asarray(np.tril(np.ones((4, 6), bool)))
    mask = mask.at[3].set(False)  # a fully masked row

    def f(v, fill):
        return jax.nn.softmax(jnp.where(mask, v, fill), axis=-1)

    g = jax.checkpoint(f) if wrap == "checkpoint" else f
    ref = np.asarray(f(x.to_array(), fill))
    for wrap_fn in MODES.values():
        got = np.asarray(wrap_fn(jsa.scalify(g))(x, jnp.float32(fill)).to_array())
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_float16_finfo_min_fill():
    x = _carrier(RNG.normal(size=(4, 4)), 2.0**-8, jnp.float16)
    mask = jnp.asarray(np.tril(np.ones((4, 4), bool)))

    def f(v):
        return jax.nn.softmax(jnp.where(mask, v, jnp.finfo(v.dtype).min), axis=-1)

    got = jax.jit(jsa.scalify(f))(x).to_array(jnp.float32)
    ref = f(x.to_array(jnp.float32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2.0**-9, atol=2.0**-11)


@pytest.mark.parametrize("mode", MODES)
def test_runtime_scalar_folds_into_the_scale(mode):
    """``p - lr * g`` with a runtime learning rate: lr's power of two joins the scale (as
    jax-scalify's broadcast scalars), so the update's data is not lr-small."""
    g = _carrier(RNG.uniform(1, 2, (8, 8)), 1.0)
    out = MODES[mode](jsa.scalify(lambda g, lr: lr * g))(g, jnp.float32(1e-3))
    np.testing.assert_allclose(np.asarray(out.to_array()), 1e-3 * np.asarray(g.data), rtol=1e-6)
    assert _amax(out) >= 2.0**-7


@settings(max_examples=40, deadline=None)
@given(
    e=st.integers(-60, 60),
    k=st.sampled_from([8, 64, 512]),
    dtype=st.sampled_from([jnp.float16, jnp.float32]),
)
def test_contraction_output_data_in_window(e, k, dtype):
    """A contraction's output data stays in [2^-7, 2^7] whatever its operands' data magnitude (the
    static sqrt(K) estimate alone lets it drift), and the value is the float32 product's."""
    rng = np.random.default_rng(1000 * k + e + 100)
    big = int(np.clip(e, -6, 6)) if dtype == jnp.float16 else e  # float16 data itself must be finite
    a = _carrier(rng.normal(size=(4, k)) * 2.0**big, 2.0**-big, dtype)
    b = _carrier(rng.normal(size=(k, 3)) * 2.0**-big, 2.0**big, dtype)
    out = jax.jit(jsa.scalify(jnp.matmul))(a, b)
    ref = np.asarray(a.to_array(jnp.float32)) @ np.asarray(b.to_array(jnp.float32))
    assert 2.0**-7 <= _amax(out) <= 2.0**7
    tol = 2.0**-10 if dtype == jnp.float16 else 1e-5
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_static_policy_keeps_jax_scalify_scales():
    """``renormalize="static"``: the seed's sqrt(K) estimate, no measurement (out of the window)."""
    a = _carrier(np.full((2, 64), 100.0), 1.0)
    b = _carrier(np.full((64, 2), 100.0), 1.0)
    with jsa.ScalifyConfig(renormalize="static"):
        out = jsa.scalify(jnp.matmul)(a, b)
    assert float(out.scale) == 8.0 and _amax(out) == 64 * 1e4 / 8
    out = jsa.scalify(jnp.matmul)(a, b)
    assert 1.0 <= _amax(out) < 2.0
    np.testing.assert_allclose(np.asarray(out.to_array()), 64 * 1e4)


def test_in_window_outputs_keep_their_explicit_scale():
    x = _carrier([1.0, 3.0], 2.0)
    out = jsa.scalify(lambda v: v * 1.0)(x)
    assert float(out.scale) == 2.0 and np.array_equal(np.asarray(out.data), [1.0, 3.0])


def test_loop_carry_is_settled():
    """A scan whose carry is multiplied by 1.5 each step: the data would grow 1.5^100 (inf in
    float16); settled carries keep it in the window and the value right."""
    x = _carrier(np.ones(4), 1.0, jnp.float16)

    def f(v):
        return jax.lax.scan(lambda c, _: (c * 1.5, None), v, None, length=100)[0]

    out = jax.jit(jsa.scalify(f))(x)
    assert 2.0**-7 <= _amax(out) <= 2.0**7
    # Each of the 100 float16 products rounds once (at most 2^-11 relative): the plain float16
    # program overflows to inf after 28 steps.
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), np.full(4, 1.5**100), rtol=100 * 2.0**-11)


def test_invalid_policy_is_rejected():
    with pytest.raises(ValueError, match="renormalize"):
        jsa.ScalifyConfig(renormalize="sometimes")


@settings(max_examples=200, deadline=None)
@given(
    x=st.floats(width=32, allow_nan=False) | st.sampled_from([0.0, -0.0, np.inf, -np.inf]),
    e=st.integers(-130, 130),
)
def test_exponent_field_power_of_two_matches_ldexp(x, e):
    """The bf16 carrier's 2^-127 is applied on the exponent bits: exact where the result is a
    normal float32, a signed zero below (XLA's flush), a signed inf above; inputs that read as zero
    (zeros, subnormals) stay zero."""
    from scalify._pow2 import mul_pow2_bits

    got = np.float32(jax.jit(mul_pow2_bits, static_argnums=1)(jnp.float32(x), e))
    x32 = np.float32(x)
    tiny = np.finfo(np.float32).tiny
    if abs(x32) < tiny:
        want = np.copysign(np.float32(0), x32)
    else:
        want = np.float32(np.ldexp(np.float64(x32), e))
        if abs(want) < tiny:
            want = np.copysign(np.float32(0), x32)
    assert (got == want and np.signbit(got) == np.signbit(want)) or (np.isnan(got) and np.isnan(want)), (got, want)


@pytest.mark.parametrize("op", ["mul2", "sum", "matmul", "scale_chain"])
def test_bf16_format_under_jit(op):
    """qf.BF16 data sit near 2^127 (rceil maps the amax to bf16's max), the carrier shift is 2^127:
    under jit its constants must not be folded with a rule's (2^-127 flushed: zeros; 2^128: inf)."""
    import qformats as qf

    x = jnp.asarray(RNG.standard_normal((4, 32)), jnp.float32)
    s = jsa.as_scaled_array(x, fmt=qf.BF16)
    f = {
        "mul2": lambda a: a * 2.0,
        "sum": lambda a: jnp.sum(a, axis=-1),
        "matmul": lambda a: a @ a.T,
        "scale_chain": lambda a: a * 2.0**60 * 2.0**60 * 2.0**-126,
    }[op]
    ref = np.asarray(f(s.to_array(jnp.float32)))
    got = np.asarray(jax.jit(jsa.scalify(f))(s).to_array(jnp.float32))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("fmt_name", ["bf16", "fp16", "fp8_e4m3"])
def test_zero_per_tensor_operand_does_not_set_the_common_scale(fmt_name):
    """A zero bias in a per-tensor format (stored scale 1) used to carry scale k = 2^(element emax)
    (2^127 for bf16): the sum's common scale then shifted the other operand's data to ~2^-125 and
    the next product was NaN (flax NNX attention in bf16)."""
    import qformats as qf

    fmt = qf.get_format(fmt_name)
    x = jnp.asarray(RNG.standard_normal((4, 32)), jnp.float32)
    zero = jsa.as_scaled_array(jnp.zeros((1, 32), jnp.float32), fmt=fmt)

    def f(a, b):
        h = a * 0.125 + b
        return jnp.sum(h * h)

    ref = float(f(x, 0.0))
    for wrap in MODES.values():
        got = float(jsa.asarray(wrap(jsa.scalify(f))(jsa.as_scaled_array(x, scale=np.float32(4.0)), zero)))
        np.testing.assert_allclose(got, ref, rtol=1e-6)
