"""Regressions of rules that let values leave their range (found training the transformer of examples/train).

Each test compares ``scalify(f)(scaled)`` with ``f`` on the dequantized float32 inputs, eagerly and
under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qformats as qf
import scalify as jsa
from scalify import ops

RNG = np.random.default_rng(0)

# float16 has a 10-bit mantissa: one rounding of the output data costs at most 2**-11 relative;
# float32 carriers are compared at a few ulps.
RTOL_F16 = 2.0**-10
RTOL_F32 = 1e-6

MODES = {"eager": lambda f: f, "jit": jax.jit}


def _carrier(data, scale, dtype=jnp.float32):
    """A carrier ScaledArray with exactly this data and scale (``as_scaled_array`` divides the value)."""
    return jsa.ScaledArray(jnp.asarray(data, dtype), jnp.asarray(scale, jnp.float32))


def _deq(x):
    return np.asarray(x.to_array(jnp.float32) if isinstance(x, jsa.ScaledArray) else x, np.float32)


def _check(f, args, ref, rtol):
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(ref).all()
    for name, wrap in MODES.items():
        out = wrap(jsa.scalify(f))(*args)
        assert isinstance(out, jsa.ScaledArray), name
        assert np.isfinite(np.asarray(out.scale)).all(), (name, out.scale)
        got = _deq(out)
        assert np.isfinite(got).all(), name
        # Per-element relative error, floored at the output's largest magnitude times rtol (the
        # resolution of a per-tensor / per-block carrier below its max).
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max(), err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_add_huge_scales_l2_combine_does_not_overflow(dtype):
    """combine_l2 squared the raw scales: 2**70 ** 2 is inf in float32, the sum then had scale inf."""
    a = RNG.standard_normal((4, 16)).astype(np.float32)
    b = RNG.standard_normal((4, 16)).astype(np.float32)
    sa = _carrier(a, dtype=dtype, scale=np.float32(2.0**70))
    sb = _carrier(b, dtype=dtype, scale=np.float32(2.0**69))
    rtol = RTOL_F16 if dtype == jnp.float16 else RTOL_F32
    _check(jnp.add, (sa, sb), _deq(sa) + _deq(sb), 2 * rtol)


def test_add_eps_to_huge_variance_scale():
    """LayerNorm's ``var + eps`` with a variance scale ~9e21 (scale ** 2 overflows float32)."""
    var = np.abs(RNG.standard_normal((8, 1))).astype(np.float32) + 0.5
    sv = _carrier(var, scale=np.float32(2.0**73))
    _check(lambda v: v + 1e-5, (sv,), _deq(sv) + np.float32(1e-5), RTOL_F32)


def test_add_tiny_scales_l2_combine_does_not_underflow():
    """The mirror case: 2**-80 ** 2 flushes to zero in float32 (the common scale became 0)."""
    a = RNG.standard_normal((4, 16)).astype(np.float32)
    sa = _carrier(a, scale=np.float32(2.0**-80))
    sb = _carrier(a[::-1].copy(), scale=np.float32(2.0**-81))
    _check(jnp.subtract, (sa, sb), _deq(sa) - _deq(sb), 2 * RTOL_F32)


def test_chained_scale_products_under_jit():
    """Two per-tensor fp8_e5m2 operands, a product, then ``z + c * z**3`` (the GELU polynomial).

    The scale chain is ``((sx*K) * (sy*K))**3 * c`` with ``K`` the static shift ``to_carrier`` moves
    into the scale. Under jit XLA re-associates the static factors of ``scale**2`` (in combine_l2) into
    one constant (K**12 * c**2: inf in float32) times the runtime part (underflows to 0): NaN scale.
    Eagerly every product is rounded in order and stays finite.
    """
    fmt = qf.FP8_E5M2
    x = (RNG.standard_normal((32, 64)) * 1e-2).astype(np.float32)
    y = (RNG.standard_normal((32, 64)) * 1e-3).astype(np.float32)
    sx, sy = jsa.as_scaled_array(jnp.asarray(x), fmt=fmt), jsa.as_scaled_array(jnp.asarray(y), fmt=fmt)

    def f(a, b):
        z = a * b * 1e4
        return z + 0.044715 * z**3

    za = _deq(sx).astype(np.float64) * _deq(sy) * np.float32(1e4)
    ref = za + 0.044715 * za**3
    _check(f, (sx, sy), ref, 4 * RTOL_F32)


def test_quantized_matmul_then_gelu_polynomial_under_jit():
    """The transformer's MLP: ops.quantize to fp8_e5m2, matmul, GELU polynomial (was NaN under jit)."""
    a = RNG.standard_normal((32, 64)).astype(np.float32)
    b = (RNG.standard_normal((64, 128)) * 0.02).astype(np.float32)

    def f(p, q):
        z = ops.quantize(p, qf.FP8_E5M2) @ ops.quantize(q, qf.FP8_E5M2)
        return z + 0.044715 * z**3

    # Outside scalify ops.quantize is fake quantization: the same values in plain float32.
    ref = jax.jit(f)(jnp.asarray(a), jnp.asarray(b))
    _check(f, (jsa.as_scaled_array(jnp.asarray(a)), jsa.as_scaled_array(jnp.asarray(b))), ref, 1e-5)


@pytest.mark.parametrize("grid", [(), (4, 1)], ids=["per_tensor", "per_row"])
def test_div_float16_data_renormalised(grid):
    """float16 data 117 / 3.4e-4 = 3.4e5 overflowed float16 (max 65504); the quotient must get a new scale."""
    num = RNG.uniform(64.0, 128.0, (4, 8)).astype(np.float32)
    den = RNG.uniform(2.0**-12, 2.0**-11, (4, 8)).astype(np.float32)
    num[0, 0], den[0, 0] = 117.0, 3.4e-4
    scale = np.float32(1.0) if not grid else np.full(grid, 1.0, np.float32)
    sn = _carrier(num, dtype=jnp.float16, scale=scale)
    sd = _carrier(den, dtype=jnp.float16, scale=np.float32(1.0))
    _check(jnp.divide, (sn, sd), _deq(sn) / _deq(sd), RTOL_F16)


def test_div_blocked_operands_renormalised_per_block():
    """Blocks of very different magnitude keep their own resolution after the renormalisation."""
    num = RNG.uniform(1.0, 2.0, (4, 8)).astype(np.float32)
    den = RNG.uniform(1.0, 2.0, (4, 8)).astype(np.float32)
    den[2:] *= 2.0**-16  # float16 quotient data would reach 2 / 2**-16 = 131072 > 65504 in these rows
    sn = _carrier(num, dtype=jnp.float16, scale=np.asarray([[1.0], [2.0**-20], [1.0], [2.0**20]], np.float32))
    sd = _carrier(den, dtype=jnp.float16, scale=np.asarray([[1.0], [1.0], [2.0**-10], [1.0]], np.float32))
    ref = _deq(sn) / _deq(sd)
    for name, wrap in MODES.items():
        got = _deq(wrap(jsa.scalify(jnp.divide))(sn, sd))
        np.testing.assert_allclose(got, ref, rtol=RTOL_F16, err_msg=name)


def test_add_plain_runtime_operand_does_not_swamp_small_scale():
    """Adam's ``b2 * zeros + (1 - b2) * g * g``: the plain zeros (a runtime array, scale 1 by convention)
    set the common scale to 1 and the float16 data of the scaled term (scale 2**-30) flushed to 0."""
    g = RNG.uniform(0.5, 2.0, (16, 8)).astype(np.float32)
    sg = _carrier(g, dtype=jnp.float16, scale=np.float32(2.0**-30))
    zeros = jnp.zeros((16, 8), jnp.float16)

    def f(z, x):
        return z + x

    _check(f, (zeros, sg), _deq(sg), RTOL_F16)
    # A large plain operand next to a small-scale one: float32 sum, re-quantized (no overflow).
    big = jnp.full((16, 8), 6e4, jnp.float16)
    sh = _carrier(g, dtype=jnp.float16, scale=np.float32(4.0))
    _check(f, (big, sh), np.float32(6e4) + _deq(sh), RTOL_F16)


def _largest_intermediate(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return max(int(np.prod(v.aval.shape)) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars)


def test_per_channel_scales_meeting_on_the_contracted_axis_do_not_blow_up():
    # Found in the int8 per-channel MLP benchmark (118x slower than plain JAX): two operands with one
    # scale per element of the contracted axis were contracted as K per-block products, a (K, M, N)
    # intermediate. The rule must dequantize instead; the result is the float32 dot.
    a = jnp.asarray(RNG.standard_normal((64, 128)), jnp.float32)
    b = jnp.asarray(RNG.standard_normal((96, 128)), jnp.float32)
    sa, sb = jsa.as_scaled_array(a, fmt=qf.INT8_PER_CHANNEL), jsa.as_scaled_array(b, fmt=qf.INT8_PER_CHANNEL)
    f = lambda x, y: x @ y.T
    out = jsa.scalify(f)(sa, sb)
    ref = f(_deq(sa), _deq(sb))
    # float32 accumulation in another order, then a float32 carrier: a few ulps of the largest term.
    np.testing.assert_allclose(_deq(out), ref, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(ref))))
    assert _largest_intermediate(jsa.scalify(f), sa, sb) <= 4 * 96 * 128


@pytest.mark.parametrize("fmt", [qf.MXFP8, qf.MXFP4, qf.NVFP4], ids=lambda f: f.name)
def test_blocked_contraction_is_one_float32_dot_without_per_block_outputs(fmt):
    """MX / NVFP4 operands blocked along K: the rule used to sum K/32 per-block partial outputs
    ((K/32, M, N) in memory: 34-41x the plain matmul at n = 2048). It is one float32 dot of the
    dequantized operands now, equal to the float32 product of the dequantized values up to order."""
    a = jnp.asarray(RNG.standard_normal((64, 256)), jnp.float32)
    b = jnp.asarray(RNG.standard_normal((256, 96)), jnp.float32)
    sa, sb = jsa.as_scaled_array(a, fmt=fmt), jsa.as_scaled_array(b, fmt=fmt.replace(axis=0))
    f = jsa.scalify(lambda x, y: x @ y)
    jaxpr = jax.make_jaxpr(f)(sa, sb)
    assert sum(e.primitive.name == "dot_general" for e in jaxpr.jaxpr.eqns) == 1
    assert _largest_intermediate(f, sa, sb) <= 256 * 96
    ref = _deq(sa) @ _deq(sb)
    out = jax.jit(f)(sa, sb)
    np.testing.assert_allclose(_deq(out), ref, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(ref))))


def test_product_of_drifted_operands_renormalises_instead_of_nan():
    # Found training fp8_e5m2 (Adam's g * g): per-tensor dots pass scales on, so a gradient's data
    # drifted to ~1e-25 with a scale of ~1e20. Squaring gave data 0 and scale inf: NaN.
    t = _carrier([1.77e-25, -1e-26], 2.0**67)
    _check(lambda v: v * v, (t,), _deq(t) ** 2, RTOL_F32)
    t = _carrier([3e-20, 1e-21], 2.0**57)
    _check(lambda v: v * v, (t,), _deq(t) ** 2, RTOL_F32)


def test_dynamic_rescale_l2_of_tiny_data_is_not_a_no_op():
    # The l2 norm squared the raw data: below ~1e-19 it was 0 and the rescale did nothing.
    t = _carrier([3e-20, 1e-21], 2.0**57)
    for wrap in MODES.values():
        out = wrap(jsa.scalify(ops.dynamic_rescale_l2))(t)
        rms = np.sqrt(np.mean(np.asarray(t.data, np.float64) ** 2))
        assert 0.5 <= float(np.max(np.abs(np.asarray(out.data)))) / (3e-20 / rms) <= 2.0
        np.testing.assert_allclose(_deq(out), _deq(t), rtol=RTOL_F32)


def test_where_zero_branch_adopts_the_scale():
    """``where(x > 0, x, 0)`` (relu's cotangent pattern): the broadcast zero adopts ``x``'s scale.

    Promoted as a plain array it had scale 1, the common scale became 1, and ``x``'s float16 data
    (scale 2**-20) was rescaled into float16 subnormals: about 6% relative error at 1e-6.
    """
    x = RNG.uniform(-2.0, 2.0, (8, 32)).astype(np.float32)
    sx = _carrier(x, dtype=jnp.float16, scale=np.float32(2.0**-20))
    ref = np.where(_deq(sx) > 0, _deq(sx), 0.0)
    for name, wrap in MODES.items():
        out = wrap(jsa.scalify(lambda v: jnp.where(v > 0, v, 0.0)))(sx)
        assert float(out.scale) == 2.0**-20, name
        np.testing.assert_array_equal(_deq(out), ref, err_msg=name)


def test_float16_sum_is_rounded_once():
    """``a + b`` of float16 carriers is the float32 sum of the values rounded once to float16.

    ``b``'s data rescaled by 2**-20 lands in float16 subnormals; rounding it there before the sum
    (the carrier-dtype rescale) double-rounds, which the one float32 sum avoids.
    """
    a = (RNG.uniform(1.0, 2.0, (16, 64)) * 2.0**-14).astype(np.float16).astype(np.float32)
    b = RNG.uniform(1.0, 2.0, (16, 64)).astype(np.float16).astype(np.float32)
    sa = _carrier(a, dtype=jnp.float16, scale=np.float32(1.0))
    sb = _carrier(b, dtype=jnp.float16, scale=np.float32(2.0**-20))
    for name, wrap in MODES.items():
        out = wrap(jsa.scalify(jnp.add))(sa, sb)
        scale = np.float32(out.scale)
        ref = ((a + b * np.float32(2.0**-20)) / scale).astype(np.float16)  # one rounding
        np.testing.assert_array_equal(np.asarray(out.data), ref, err_msg=name)


def test_float16_contraction_allowance_applies_before_rounding():
    """A float16 dot of 1024 products of 8 * 8 sums to 65536, past float16's max (65504).

    The sqrt(K) allowance (2**-5) used to divide the float16 result, which was already inf; the
    contraction now accumulates in float32 and rounds once, after the division.
    """
    a = _carrier(np.full((4, 1024), 8.0, np.float32), dtype=jnp.float16, scale=np.float32(0.5))
    b = _carrier(np.full((1024, 4), 8.0, np.float32), dtype=jnp.float16, scale=np.float32(0.25))
    _check(jnp.matmul, (a, b), np.full((4, 4), 65536.0 * 0.125, np.float32), RTOL_F16)


@pytest.mark.parametrize("factor", [4.0, -0.5, 0.01, 3.0])
def test_static_multiplier_moves_its_power_of_two_into_the_scale(factor):
    """``x * c`` for a static ``c = m * 2^e``: data * m, scale * 2^e (a power of two: data untouched)."""
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    sx = _carrier(x, dtype=jnp.float16, scale=np.float32(2.0**-3))
    _, e = np.frexp(abs(factor))
    for name, wrap in MODES.items():
        out = wrap(jsa.scalify(lambda v: v * factor))(sx)
        assert float(out.scale) == 2.0**-3 * 2.0 ** (int(e) - 1), name
        if abs(factor) == 2.0 ** (int(e) - 1):
            np.testing.assert_array_equal(np.asarray(out.data), np.sign(factor) * np.asarray(sx.data), err_msg=name)
        np.testing.assert_allclose(_deq(out), _deq(sx) * factor, rtol=RTOL_F16, err_msg=name)
        div = wrap(jsa.scalify(lambda v: v / factor))(sx)
        np.testing.assert_allclose(_deq(div), _deq(sx) / factor, rtol=RTOL_F16, err_msg=name)


def test_integer_carriers_sum_and_contract_without_allowance():
    """The sqrt(n) growth allowance divided integer data in its own dtype: 1 / 16 truncated to 0,
    so ``sum``, ``cumsum`` and ``matmul`` of integer carriers returned zeros. Integers sum exactly."""
    v = np.arange(16, dtype=np.int32)
    sv = jsa.ScaledArray(jnp.asarray(v), jnp.float32(2.0))
    a = jsa.ScaledArray(jnp.ones((2, 64), jnp.int32), jnp.float32(2.0))
    b = jsa.ScaledArray(jnp.ones((64, 2), jnp.int32), jnp.float32(0.5))
    for name, wrap in MODES.items():
        np.testing.assert_array_equal(_deq(wrap(jsa.scalify(jnp.sum))(sv)), 2.0 * v.sum(), err_msg=name)
        np.testing.assert_array_equal(_deq(wrap(jsa.scalify(jnp.cumsum))(sv)), 2.0 * np.cumsum(v), err_msg=name)
        np.testing.assert_array_equal(_deq(wrap(jsa.scalify(jnp.matmul))(a, b)), np.full((2, 2), 64.0), err_msg=name)


@pytest.mark.parametrize("fmt", [qf.FP8_E5M2, qf.FP16, qf.NVFP4, qf.INT8_PER_CHANNEL], ids=lambda f: f.name)
def test_gradient_through_a_chain_of_formatted_matmuls_keeps_its_data_near_one(fmt):
    # Found training the transformer of examples/train in fp8_e5m2. Moved here from tests/train: the
    # demo's models used to rescale every matmul-output gradient by hand (dynamic_rescale_l2_grad),
    # which hid the drift; now the models are plain and the chain, with no rescaling in it, must keep
    # the data O(1) and the value exact to float32 rounding. The factor each format keeps out of its
    # GEMM values (2^-16 for fp8_e5m2 here, NVFP4's tensor scale, per-channel scales) multiplied
    # along the chain: the eighth output scale flushed to 0 and its data overflowed (fixed by
    # re-centring the output scale of every contraction, scalify/_contraction.py).
    def chain(x, ws):
        for w in ws:
            x = x @ w
        return jnp.sum(x)

    ws = [jax.random.normal(jax.random.key(i), (32, 32)) / 6 for i in range(12)]
    x = jax.random.normal(jax.random.key(99), (8, 32))
    sws = jax.jit(lambda ws: [jsa.as_scaled_array(w, fmt=fmt) for w in ws])(ws)
    ref = jax.jit(jax.grad(chain))(x, [_deq(w) for w in sws])  # the same fp8 values, plain float32
    for name, wrap in MODES.items():
        g = wrap(jsa.scalify(jax.grad(chain)))(jsa.as_scaled_array(x), sws)
        data = np.abs(np.asarray(g.data))
        assert 1e-2 < data.max() < 1e2, name
        np.testing.assert_allclose(_deq(g), np.asarray(ref), rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_regression_cast_ml_dtype_survives_a_reduction_under_jit(dtype):
    """``ops.cast_ml_dtype(x, bfloat16)`` fed to a reduction under jit: XLA dropped the float32 ->
    bfloat16 -> float32 round trip there (excess precision), so the block maxima were those of the
    unrounded ``x``. Reference: NumPy's ml_dtypes rounding of the same values."""
    import ml_dtypes

    dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    got = jax.jit(lambda v: jnp.max(ops.cast_ml_dtype(v, dt).reshape(1024, 8, 128), -1))(x)
    want = x.astype(dt).astype(np.float32).reshape(1024, 8, 128).max(-1)
    np.testing.assert_array_equal(np.asarray(got), want)


def _zero_chain(op, x, factors):
    def f(y, factors):
        for w in factors:
            y = op(y, w)
        return y, y + 1.0

    return f, (x, factors)


@pytest.mark.parametrize(
    "case",
    [
        # Contractions with weights on scale 2^8: the output's static scale grows 2^8 per layer
        # (settled on a measured amax that a zero tensor does not have).
        lambda: _zero_chain(
            jnp.matmul,
            _carrier(np.zeros((4, 8)), 1.0),
            [_carrier(RNG.standard_normal((8, 8)) / 3, 256.0) for _ in range(20)],
        ),
        # float16 quotients by divisors on scale 2^-8: renormalised per block, which a zero block
        # cannot move either.
        lambda: _zero_chain(
            jnp.divide,
            _carrier(np.zeros((4, 8)), 1.0, jnp.float16),
            [_carrier(RNG.uniform(1, 2, (4, 8)), 2.0**-8, jnp.float16) for _ in range(20)],
        ),
    ],
    ids=["matmul", "float16-divide"],
)
def test_zeros_along_a_chain_keep_a_finite_scale(case):
    """A tensor of zeros carried through a chain of scaled operations stays zero (found on Haiku's
    ResNet example: the exactly-zero BatchNorm gradients of 16 blocks reached scale 2^121, then Inf,
    and a zero times an Inf scale is NaN). Before the fix both chains returned NaN."""
    f, args = case()
    for wrap in MODES.values():
        y, z = wrap(jsa.scalify(f))(*args)
        np.testing.assert_array_equal(_deq(y), np.zeros((4, 8), np.float32))
        np.testing.assert_array_equal(_deq(z), np.ones((4, 8), np.float32))
        assert 2.0**-32 <= float(jnp.max(y.scale)) <= 2.0**32
