"""The blockwise float8 recipes (DeepSeek-V3's: torchao's blockwise float8 training, Transformer
Engine's ``Float8BlockScaling``) and their format, ``qformats.BlockwiseFloat8``.

References: a NumPy/ml_dtypes quantizer written from the two libraries' descriptions (``r = max /
max(amax, 1e-12)`` in float64 rounded to float32, optionally with its mantissa bits zeroed as TE's
default power-of-two scales do; ``data = fp8(clip(x * r))``; scale ``1 / r``), and torchao's own
training path for the non-power-of-two recipe (``test_torchao_vectors.py``). Transformer Engine runs
only on a GPU: its recipe is checked against the formula its documentation gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qformats as qf
from scalify import recipes
from scalify.recipes._gemm import dot_aims, quantize_operand

F32 = np.float32
_DN = (((1,), (1,)), ((), ()))  # y = x @ w.T, x [M, K], w [N, K]
AIMS = dot_aims({"dimension_numbers": _DN}, 2, 2)
ELEMENTS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def np_blockwise(x, block, element="e4m3", pow2=False, eps=1e-12, te=False):
    """``(data, scale, values)`` of a 2-D ``x`` in blocks of shape ``block`` (NumPy reference).

    ``te``: Transformer Engine's ``compute_scale_from_amax``: ``r = 1`` where the clamped amax is 0,
    Inf or NaN, ``FLT_MAX`` where ``max / amax`` overflows float32."""
    dtype, top = ELEMENTS[element]
    (m, n), (b0, b1) = x.shape, block
    xb = x.reshape(m // b0, b0, n // b1, b1)
    amax = np.max(np.abs(xb), axis=(1, 3)).astype(F32)
    amax = np.where(amax < F32(eps), F32(eps), amax)  # NaN compares false: stays NaN
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = (np.float64(top) / amax.astype(np.float64)).astype(F32)
    if te:
        r = np.where(np.isinf(r), np.finfo(F32).max, r)
        r = np.where((amax == 0) | ~np.isfinite(amax), F32(1), r).astype(F32)
    if pow2:
        r = (r.view(np.uint32) & np.uint32(0xFF800000)).view(F32)
    rb = r[:, None, :, None]
    with np.errstate(invalid="ignore", over="ignore"):
        data = np.clip(xb * rb, -top, top).astype(dtype)  # ml_dtypes rounds to nearest even
        scale = F32(1) / r
        values = data.astype(F32) * scale[:, None, :, None]
    return data.reshape(x.shape), scale, values.reshape(x.shape)


def _fmt(element, pow2, tiles, te=False):
    base = qf.BlockwiseFloat8(f"block128_{element}", element=qf.get_format(f"fp8_{element}").element, pow2=pow2)
    base = base.replace(eps=0.0, degenerate_unit_scale=True) if te else base
    return base.replace(axis=1, tile_axis=0) if tiles else base.replace(axis=1)


def _sample(seed, shape=(256, 256)):
    """Values over 60 binades, with an all-zero block, a block below the 1e-12 clamp, a block whose
    ``max / amax`` is near float32's top, a block one float32 ulp above 448 at its top, NaN-free."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, (shape[0], 1)))).astype(F32)
    x[0, :128] = 0
    x[1, :128] = np.linspace(-4e-13, 4e-13, 128, dtype=F32)
    x[3, :128] = np.linspace(-3e-33, 3e-33, 128, dtype=F32)  # r near 2**124 (E5M2), 2**117 (E4M3)
    x[2, -128:] = np.linspace(-1, 1, 128, dtype=F32)
    x[2, -128] = np.nextafter(F32(448), F32(449))
    return x


@pytest.mark.parametrize("element", sorted(ELEMENTS))
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2"])
@pytest.mark.parametrize("tiles", [False, True], ids=["blocks", "tiles"])
@pytest.mark.parametrize("te", [False, True], ids=["torchao_rule", "te_rule"])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_quantize_matches_numpy(seed, element, pow2, tiles, te):
    """Element bits, scales and dequantized values equal the NumPy reference bit for bit, in blocks
    of 128 along the last axis and in 128 x 128 tiles, with torchao's and TE's degenerate rules."""
    fmt = _fmt(element, pow2, tiles, te)
    x = _sample(seed)
    data, scale = jax.jit(fmt.quantize)(x)
    eps = 0.0 if te else 1e-12
    want_data, want_scale, want_values = np_blockwise(x, (128, 128) if tiles else (1, 128), element, pow2, eps, te)
    np.testing.assert_array_equal(np.asarray(data).view(np.uint8), want_data.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), want_scale.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(jax.jit(fmt.dequantize)(data, scale)), want_values)


def test_power_of_two_scales_are_the_largest_that_do_not_saturate():
    """TE's rule: ``r`` is the power of two at or below ``448 / amax``, so every element fits and the
    block's largest lands in ``[224, 448]`` (rounded); ``1 / r`` is exact."""
    fmt = qf.get_format("fp8_e4m3_block128_pow2")
    x = _sample(5)[2:]
    data, scale = fmt.quantize(x)
    s = np.asarray(scale)
    mant = s.view(np.uint32) & 0x7FFFFF
    assert np.all(mant == 0)
    top = np.max(np.abs(np.asarray(data).astype(F32)).reshape(254, 2, 128), axis=2)
    assert np.all((top >= 224) & (top <= 448)), top.min()


@pytest.mark.parametrize(
    ("name", "te"),
    [("fp8_e4m3_block128", False), ("fp8_e4m3_block128_pow2", True), ("torchao_rule_pow2", False)],
)
def test_nonfinite_block(name, te):
    """An Inf or NaN: torchao's rule makes its block NaN (``r`` is 0 or NaN; with power-of-two
    scales too, whose mantissa mask would turn a NaN ``r`` into Inf); TE's gives the block ``r = 1``,
    so the NaN stays NaN, an Inf saturates, and the block's other elements are themselves quantized
    with scale 1 (the NumPy reference's values). Other blocks are untouched either way."""
    pow2_torchao = qf.get_format("fp8_e4m3_block128").replace(name=name, pow2=True)
    fmt = pow2_torchao if name == "torchao_rule_pow2" else qf.get_format(name)
    fmt = fmt.replace(axis=1)
    x = _sample(3, (4, 256))
    clean = np.asarray(fmt.dequantize(*fmt.quantize(x)))
    for bad in (np.inf, -np.inf, np.nan):
        y = x.copy()
        y[3, 5] = bad
        got = np.asarray(fmt.dequantize(*fmt.quantize(y)))
        if te:
            want = np_blockwise(np.where(np.isinf(y), np.sign(y) * F32(448), y), (1, 128), pow2=True, eps=0.0, te=True)
            np.testing.assert_array_equal(got[3, :128], want[2][3, :128])
            assert np.isnan(got[3, 5]) == np.isnan(bad) and np.sum(np.isnan(got)) == np.isnan(bad)
        else:
            assert np.all(np.isnan(got[3, :128]))
        np.testing.assert_array_equal(got[:3], clean[:3])
        np.testing.assert_array_equal(got[3, 128:], clean[3, 128:])


def test_weight_tiles_quantize_alike_in_both_gemms_and_once():
    """128 x 128 tiles: the weight the forward GEMM reads (contracted along K) is, bit for bit, the one
    the input-gradient GEMM reads (contracted along N), so the backward reuses the forward's."""
    from scalify.recipes import _gemm

    w = _sample(4, (256, 384))
    for recipe in (recipes.FLOAT8_BLOCKWISE, recipes.FLOAT8_BLOCKWISE_POW2):
        fwd = quantize_operand(recipe, "fwd_rhs", w, AIMS["fwd_rhs"])
        dgrad = quantize_operand(recipe, "dgrad_rhs", w, AIMS["dgrad_rhs"])
        np.testing.assert_array_equal(fwd, dgrad)
        assert _gemm._quantizes_alike(recipe, ("fwd_rhs", "dgrad_rhs"), AIMS, w.shape)


@pytest.mark.parametrize("name", ["float8_blockwise", "float8_blockwise_pow2"])
def test_recipe_gemms_read_the_reference_operands(name):
    """y, dx, dw of a linear layer under the recipe equal float32 products of the NumPy reference's
    operands (x and dy in blocks of 128 along each GEMM's summed axis, w in 128 x 128 tiles), within
    float32 summation order: ``K * 2**-24 * (|A| @ |B|)`` elementwise."""
    recipe = recipes.BUILTINS[name]
    pow2 = name.endswith("pow2")
    x, w, dy = _sample(6, (256, 384)), _sample(7, (128, 384)) * F32(0.05), _sample(8, (256, 128)) * F32(1e-3)
    y, vjp = jax.vjp(jax.jit(recipes.apply(lambda a, b: jax.lax.dot_general(a, b, _DN), recipe)), x, w)
    dx, dw = vjp(dy)

    def ref(a, block):  # the POW2 recipe is TE's: epsilon 0 and its degenerate-block rule
        return np_blockwise(a, block, pow2=pow2, eps=0.0 if pow2 else 1e-12, te=pow2)[2]

    cases = {  # result, lhs, rhs (both [rows, summed] -> lhs @ rhs.T)
        "y": (y, ref(x, (1, 128)), ref(w, (128, 128))),
        "dx": (dx, ref(dy, (1, 128)), ref(w.T.copy(), (128, 128))),
        "dw": (dw, ref(dy.T.copy(), (1, 128)), ref(x.T.copy(), (1, 128))),
    }
    for label, (got, a, b) in cases.items():
        want = a.astype(np.float64) @ b.T.astype(np.float64)
        bound = a.shape[1] * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(b.T.astype(np.float64)))
        err = np.abs(np.asarray(got, np.float64) - want)
        assert np.all(err <= bound + 1e-30), f"{label}: max excess {np.max(err - bound)}"


def test_short_axis_error_names_the_block_and_the_fixes():
    """A layer whose sizes are not multiples of 128 gets the recipe's error, naming the GEMM, the
    operand and the fixes (keep it in high precision by scope or by role)."""
    x, w = jnp.ones((32, 64)), jnp.ones((64, 96))
    with pytest.raises(ValueError, match=r"float8_blockwise.*multiple of 128.*high_precision_scopes"):
        recipes.apply(lambda a, b: a @ b, recipes.FLOAT8_BLOCKWISE)(x, w)


def test_rows_quantize_alone_exactly_where_the_format_says():
    """``separable`` (what a grouped GEMM relies on to quantize all its groups at once): with blocks
    along the last axis each row quantizes on its own, bit for bit; a 128 x 128 tile's scale sees
    128 rows, so tiles are not separable by rows (and a grouped GEMM quantizes each group itself)."""
    fmt = _fmt("e4m3", False, False)
    x = _sample(9, (128, 256)) * np.exp2(np.arange(-64, 64, dtype=F32))[:, None]
    assert fmt.separable(x.shape, 0)
    rows = [np.asarray(fmt.fake_quantize(r[None]))[0] for r in x]
    np.testing.assert_array_equal(np.asarray(fmt.fake_quantize(x)), np.stack(rows))
    assert not _fmt("e4m3", False, True).separable(x.shape, 0)


def test_a_subnormal_scale_is_stored_and_applied():
    """TE's rule with a block so small that ``1 / r`` is a float32 subnormal (``r = FLT_MAX``, as
    ``57344 / amax`` overflows): the stored scale is TE's subnormal, bit for bit, and the values are
    the reference's, eagerly and under jit, although XLA on the CPU reads a subnormal operand as 0
    (one product by the stored scale gave 0 for the whole block)."""
    fmt = _fmt("e5m2", False, False, te=True)
    x = np.zeros((2, 128), F32)
    x[0] = np.linspace(-3e-35, 3e-35, 128, dtype=F32)
    x[1] = np.linspace(-1, 1, 128, dtype=F32)
    want_data, want_scale, want_values = np_blockwise(x, (1, 128), "e5m2", eps=0.0, te=True)
    assert 0 < want_scale[0, 0] < np.finfo(F32).tiny
    for quantize, dequantize in ((fmt.quantize, fmt.dequantize), (jax.jit(fmt.quantize), jax.jit(fmt.dequantize))):
        data, scale = quantize(x)
        np.testing.assert_array_equal(np.asarray(data).view(np.uint8), want_data.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(scale).view(np.uint32), want_scale.view(np.uint32))
        np.testing.assert_array_equal(np.asarray(dequantize(data, scale)), want_values)
    np.testing.assert_array_equal(np.asarray(fmt.fake_quantize(x)), want_values)
