"""Contraction strategies (``ScalifyConfig(contraction=...)``) against float32 on the dequantized operands.

Reference: the same contraction in float64 (NumPy) on the dequantized operands. Every strategy
multiplies values that are exact in their compute dtype (products exact in float32) and accumulates
in float32, so it differs from the exact sum by at most ``(K + 2) u sum_k |a_k b_k|`` per output
(``u = 2^-24``: K - 1 roundings of the sum, one of a factor applied to the output, one of the
output's dtype); the tests allow twice that. The bound is for float32 arithmetic: the contractions
run under ``jax.default_matmul_precision("highest")``, since JAX's default float32 GEMM on GPUs is
TF32 (CPU runs float32 either way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jax import lax

import qformats as qf
import scalify as jsa

U = 2.0**-24
STRATEGIES = ("auto", "dequantize", "native")
FORMATS = qf.list_formats()
# Formats with a block-scaled (jax.nn.scaled_matmul) form.
SCALED_DOT_FORMATS = ("mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4")


def _data(shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, shape))).astype(np.float32)


def _scaled(x, fmt, contracted, free):
    return jsa.as_scaled_array(jnp.asarray(x), fmt=fmt.aim(contracted, free))


def _check(out, a, b, contract, k, rel=None):
    """``out`` against float64 ``contract`` of the dequantized operands, within 2 (K+2) u |a||b|
    (or ``rel * |a||b|``)."""
    da, db = (np.asarray(x.to_array(jnp.float32), np.float64) for x in (a, b))
    ref = contract(da, db)
    bound = (2 * (k + 2) * U if rel is None else rel) * contract(np.abs(da), np.abs(db))
    got = np.asarray(out.to_array(jnp.float32) if isinstance(out, jsa.ScaledArray) else out, np.float64)
    excess = np.abs(got - ref) - bound
    where = np.unravel_index(excess.argmax(), excess.shape)
    assert np.all(excess <= 0), f"max excess over the bound {excess.max():.3g} at {where}"


def _fp8_gemm_rel(fmt, strategy):
    """On a GPU, per-tensor float8 operands under ``native`` (``auto`` there) run an FP8 GEMM whose
    tensor cores accumulate with fewer bits than float32 (about 13 significant bits before each
    promotion to float32 on Hopper): allow 2^-10 |a||b| there; None (the float32 bound) elsewhere."""
    float8_data = fmt.name in ("fp8_e4m3", "fp8_e5m2")
    return 2.0**-10 if jax.default_backend() == "gpu" and float8_data and strategy != "dequantize" else None


def _run(fn, strategy, *args):
    with jsa.ScalifyConfig(contraction=strategy), jax.default_matmul_precision("highest"):
        return jax.jit(jsa.scalify(fn))(*args)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", FORMATS)
def test_matmul_every_format(name, strategy):
    fmt = qf.get_format(name)
    x, w = _data((128, 256), 0), _data((256, 128), 1)
    a, b = _scaled(x, fmt, 1, 0), _scaled(w, fmt, 0, 1)
    _check(_run(jnp.matmul, strategy, a, b), a, b, np.matmul, 256, _fp8_gemm_rel(fmt, strategy))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8_e4m3", "int8_per_channel", "mxint8"])
def test_batched_einsum(name, strategy):
    fmt = qf.get_format(name)
    x, w = _data((3, 32, 64), 2), _data((3, 64, 16), 3)
    a, b = _scaled(x, fmt, 2, 1), _scaled(w, fmt, 1, 2)
    fn = lambda p, q: jnp.einsum("bmk,bkn->bmn", p, q)
    _check(_run(fn, strategy, a, b), a, b, lambda p, q: np.einsum("bmk,bkn->bmn", p, q), 64)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8_e5m2", "int8_per_channel"])
def test_two_contracted_axes(name, strategy):
    """Blocks along one of two contracted axes; the other axis contracts across blocks."""
    fmt = qf.get_format(name)
    x, w = _data((8, 4, 64), 4), _data((4, 64, 24), 5)
    a, b = _scaled(x, fmt, 2, 0), _scaled(w, fmt, 1, 2)
    dims = (((1, 2), (0, 1)), ((), ()))
    fn = lambda p, q: lax.dot_general(p, q, dims)
    ref = lambda p, q: np.tensordot(p, q, axes=((1, 2), (0, 1)))
    _check(_run(fn, strategy, a, b), a, b, ref, 256)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_blocks_on_free_axis_and_plain_operand(strategy):
    """MX blocks along a free axis (not aimed) and a plain float32 operand still contract exactly."""
    x, w = _data((64, 128), 6), _data((128, 32), 7)
    a = jsa.as_scaled_array(jnp.asarray(x), fmt=qf.MXFP8)  # blocked along k (axis -1)
    b = jsa.as_scaled_array(jnp.asarray(w), fmt=qf.MXFP8)  # blocked along n: a free axis
    _check(_run(jnp.matmul, strategy, a, b), a, b, np.matmul, 128)
    out = _run(jnp.matmul, strategy, a, jnp.asarray(w))
    _check(out, a, jsa.as_scaled_array(jnp.asarray(w)), np.matmul, 128)


@pytest.mark.parametrize("name", SCALED_DOT_FORMATS)
def test_scaled_dot_matches_fallback_and_reference(name):
    """On CPU ``scaled_dot`` runs JAX's composed ``scaled_matmul``: same bound, batch axes too."""
    fmt = qf.get_format(name)
    x, w = _data((2, 32, 128), 8), _data((2, 128, 16), 9)
    a, b = _scaled(x, fmt, 2, 1), _scaled(w, fmt, 1, 2)
    fn = lambda p, q: jnp.einsum("bmk,bkn->bmn", p, q)
    out = _run(fn, "scaled_dot", a, b)
    _check(out, a, b, lambda p, q: np.einsum("bmk,bkn->bmn", p, q), 128)
    np.testing.assert_allclose(
        np.asarray(out.to_array()),
        np.asarray(_run(fn, "dequantize", a, b).to_array()),
        rtol=0,
        atol=1e-4 * float(jnp.max(jnp.abs(out.to_array()))),
    )


@pytest.mark.parametrize(
    ("fa", "fb", "message"),
    [
        (qf.MXFP6_E2M3, qf.MXFP6_E2M3.replace(axis=0), "block-scaled form"),
        (qf.MXFP8, qf.MXFP8, "not along the contracted"),  # rhs blocked along n
        (qf.FP8_E4M3, qf.FP8_E4M3, "block-scaled form"),
        (qf.MXFP8, qf.NVFP4.replace(axis=0), "block sizes"),
    ],
)
def test_scaled_dot_refuses_what_it_cannot_run(fa, fb, message):
    a = jsa.as_scaled_array(jnp.asarray(_data((16, 64), 10)), fmt=fa)
    b = jsa.as_scaled_array(jnp.asarray(_data((64, 32), 11)), fmt=fb)
    with pytest.raises(ValueError, match=message) as info:
        _run(jnp.matmul, "scaled_dot", a, b)
    assert "contraction='auto'" in str(info.value)


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="contraction"):
        jsa.ScalifyConfig(contraction="fast")


def test_auto_is_dequantize_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("'auto' picks by platform; this checks the CPU choice")
    a = _scaled(_data((32, 64), 12), qf.FP8_E4M3, 1, 0)
    b = _scaled(_data((64, 8), 13), qf.FP8_E4M3, 0, 1)
    auto, deq = _run(jnp.matmul, "auto", a, b), _run(jnp.matmul, "dequantize", a, b)
    np.testing.assert_array_equal(np.asarray(auto.data), np.asarray(deq.data))


def _hlo(fn, strategy, *args, **config):
    with jsa.ScalifyConfig(contraction=strategy, **config):
        return jax.jit(jsa.scalify(fn)).lower(*args).as_text()


def test_native_feeds_float8_dequantize_pattern_and_dequantize_exact_values():
    """``native`` gives per-tensor float8 operands as ``convert(data) * scale`` into a float32 dot at
    HIGHEST precision (the pattern XLA's GPU rewriter folds into an FP8 GEMM; fast accumulation
    only on request); ``dequantize`` feeds bfloat16 (float32 on CPU)."""
    a = _scaled(_data((32, 64), 14), qf.FP8_E4M3, 1, 0)
    b = _scaled(_data((64, 8), 15), qf.FP8_E5M2, 0, 1)
    native = _hlo(jnp.matmul, "native", a, b)
    assert "tensor<32x64xf8E4M3FN>) -> tensor<32x64xf32>" in native
    assert "tensor<64x8xf8E5M2>) -> tensor<64x8xf32>" in native
    assert "precision = [HIGHEST, HIGHEST]" in native
    assert "precision = [HIGHEST, HIGHEST]" not in _hlo(jnp.matmul, "native", a, b, fast_accumulation=True)
    deq = _hlo(jnp.matmul, "dequantize", a, b)
    # bfloat16 where the backend has bfloat16 x bfloat16 -> float32 GEMMs everywhere (not XLA's CPU)
    dt = "f32" if jax.default_backend() == "cpu" else "bf16"
    assert f"tensor<32x64x{dt}>, tensor<64x8x{dt}>) -> tensor<32x8xf32>" in deq


def test_no_per_block_partial_products_and_bounded_memory():
    """The compiled MXFP8 contraction needs at most 1.25x the temporaries and outputs of the plain
    float32 matmul of the dequantized operands (its inputs are smaller: 8-bit data)."""
    n = 512
    a = _scaled(_data((n, n), 16), qf.MXFP8, 1, 0)
    b = _scaled(_data((n, n), 17), qf.MXFP8, 0, 1)
    scaled = jax.jit(lambda p, q: jsa.scalify(jnp.matmul)(p, q).to_array()).lower(a, b).compile().memory_analysis()
    da, db = a.to_array(), b.to_array()
    plain = jax.jit(jnp.matmul).lower(da, db).compile().memory_analysis()

    def footprint(m):
        return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

    assert footprint(scaled) <= 1.25 * footprint(plain), (footprint(scaled), footprint(plain))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4", "fp8_e4m3", "int8_per_channel", "mxint8"])
def test_conv_blocked_along_input_features(name, strategy):
    """NHWC activations blocked along C, HWIO kernels blocked along I (and per-channel along O)."""
    fmt = qf.get_format(name)
    x, k = _data((2, 8, 8, 64), 18), _data((3, 3, 64, 16), 19)
    a, b = _scaled(x, fmt, 3, 2), _scaled(k, fmt, 2, 3)
    dn = ("NHWC", "HWIO", "NHWC")
    fn = lambda p, q: lax.conv_general_dilated(p, q, (1, 1), "SAME", dimension_numbers=dn)

    def ref(p, q):
        return np.asarray(
            lax.conv_general_dilated(
                jnp.asarray(p), jnp.asarray(q), (1, 1), "SAME", dimension_numbers=dn, precision=lax.Precision.HIGHEST
            ),
            np.float64,
        )

    # float32 reference: its own error adds at most the same bound again.
    _check(_run(fn, strategy, a, b), a, b, ref, 2 * 9 * 64, _fp8_gemm_rel(fmt, strategy))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(FORMATS),
    strategy=st.sampled_from(STRATEGIES),
    m=st.integers(1, 9),
    kb=st.integers(1, 4),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape(name, strategy, m, kb, n, seed):
    fmt = qf.get_format(name)
    k = 32 * kb
    try:
        fmt.aim(1, 0).block_shape((m, k)), fmt.aim(0, 1).block_shape((k, n))
    except ValueError:  # a registered format with larger blocks (a checkpoint's int4 groups of 128)
        assume(False)
    a, b = _scaled(_data((m, k), seed), fmt, 1, 0), _scaled(_data((k, n), seed + 1), fmt, 0, 1)
    _check(_run(jnp.matmul, strategy, a, b), a, b, np.matmul, k)
