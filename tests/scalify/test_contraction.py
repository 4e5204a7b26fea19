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


def test_linear_layer_weight_transpose_keeps_float8_codes():
    """``x @ w.T`` with a per-tensor float8 weight stored (N, K), as a linear layer holds it: the
    transpose moves the float8 codes (no decode to a float32 carrier), so ``native`` still feeds
    float8 data to the dot (on an H100 an FP8 GEMM in the layout cuBLASLt takes)."""
    a = _scaled(_data((32, 64), 20), qf.FP8_E4M3, 1, 0)
    w = jsa.as_scaled_array(jnp.asarray(_data((8, 64), 21)), fmt=qf.FP8_E4M3)
    fn = lambda p, q: p @ q.T
    native = _hlo(fn, "native", a, w)
    assert "(tensor<8x64xf8E4M3FN>) -> tensor<64x8xf8E4M3FN>" in native  # the codes transposed
    assert "tensor<64x8xf8E4M3FN>) -> tensor<64x8xf32>" in native  # then converted for the dot
    _check(_run(fn, "native", a, w), a, w, lambda p, q: p @ q.T, 64, _fp8_gemm_rel(qf.FP8_E4M3, "native"))


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "fp8_e4m3"])
def test_unit_factor_gives_a_static_output_scale(name):
    """MX values carry their whole scale (factor 1), and ``native`` folds per-tensor float8 scales
    into the operands: the output's scale is then known when tracing, so under
    ``renormalize="static"`` nothing follows the dot but a multiply by the literal 1 (which XLA
    removes); a traced scale of 1 would be sealed behind an optimization barrier and cost a pass
    over the output (measured on an H100, per-tensor FP8 8192^3 with fast accumulation under
    ``renormalize="static"``: 0.71 -> 0.61 of the bfloat16 GEMM's time)."""
    fmt = qf.get_format(name)
    a = _scaled(_data((32, 64), 22), fmt, 1, 0)
    b = _scaled(_data((64, 16), 23), fmt, 0, 1)
    with jsa.ScalifyConfig(contraction="native", renormalize="static"):
        jaxpr = jax.make_jaxpr(lambda p, q: jsa.scalify(jnp.matmul)(p, q).to_array())(a, b).jaxpr
        out = jax.jit(jsa.scalify(jnp.matmul))(a, b)
    names = [e.primitive.name for e in jaxpr.eqns]
    after = jaxpr.eqns[names.index("dot_general") + 1 :]
    assert [e.primitive.name for e in after] in ([], ["mul"]), names
    if after:
        assert any(hasattr(v, "val") and float(v.val) == 1.0 for v in after[0].invars), after[0]  # a literal
    _check(out, a, b, np.matmul, 64)


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


MOVES = {
    "transpose": lambda x: x.T,
    "reshape": lambda x: x.reshape(64, 128),
    "slice": lambda x: x[1:3, ::2],
    "rev": lambda x: x[::-1],
    "broadcast": lambda x: jnp.broadcast_to(x, (3, 128, 64)),
    "squeeze": lambda x: jnp.squeeze(x[None], 0),
}


@pytest.mark.parametrize(
    ("name", "move"),
    [(n, m) for n in FORMATS for m in ("transpose", "slice")]
    + [(n, m) for n in ("fp8_e4m3", "bf16") for m in MOVES if m not in ("transpose", "slice")],
)
def test_data_movement_of_formatted_arrays(name, move):
    """Moving a formatted array gives the moved values; a per-tensor format (one scale, one code per
    element) keeps its format and moves its stored codes as they are, bit for bit (others are
    decoded to a carrier first)."""
    fmt = qf.get_format(name)
    x = jsa.as_scaled_array(jnp.asarray(_data((128, 64), 24)), fmt=fmt)  # int4_g128 blocks axis 0 by 128
    out = jax.jit(jsa.scalify(MOVES[move]))(x)
    ref = MOVES[move](np.asarray(x.to_array(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), ref)
    if fmt.scale_shape(x.shape) == ():
        assert out.fmt == fmt
        moved = np.ascontiguousarray(MOVES[move](np.asarray(x.data)))
        assert np.asarray(out.data).tobytes() == moved.tobytes()


def _ragged_reference(x, w, sizes):
    """float64 ragged_dot: rows of group ``g`` (consecutive, ``sizes[g]`` of them) times ``w[g]``."""
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n] @ w[g]
        start += n
    return out


@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3", "int8_per_channel", "mxfp8", "mxfp4", "mxint8", "nvfp4"])
def test_ragged_dot(name):
    """``lax.ragged_dot`` (a mixture of experts' grouped expert GEMM) of formatted tokens and
    expert weights, both blocked along the contracted axis, against float64 per group; and its
    gradient (JAX's transpose: a ragged_dot for the tokens, a grouped contraction for the weights)
    against float32's on the dequantized operands. It had no rule."""
    fmt = qf.get_format(name)
    sizes = (64, 32, 0, 32)  # an expert with no tokens
    x, w = _data((128, 64), 4), _data((4, 64, 32), 5)
    a, b = _scaled(x, fmt, 1, 0), _scaled(w, fmt, 1, 2)
    gs = jnp.asarray(sizes, jnp.int32)
    f = lambda a, b: lax.ragged_dot(a, b, gs)
    _check(_run(f, "auto", a, b), a, b, lambda p, q: _ragged_reference(p, q, sizes), 64)
    loss = lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2)
    got = jax.jit(jsa.scalify(jax.grad(loss, argnums=(0, 1))))(a, b)
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(a.to_array(jnp.float32), b.to_array(jnp.float32))
    for g, r in zip(got, want, strict=True):
        g = np.asarray(g.to_array(jnp.float32) if isinstance(g, jsa.ScaledArray) else g)
        np.testing.assert_allclose(g, np.asarray(r), rtol=0, atol=1e-5 * float(np.max(np.abs(r))))
