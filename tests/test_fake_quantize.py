"""``fmt.fake_quantize`` and the stochastic-rounding bits.

``fake_quantize(x)`` is the round trip ``dequantize(*quantize(x))`` computed without the stored
data (MX and NVFP4 skip packing and decode codes where they are made): it must equal the round
trip bit for bit, for every registered format (unlisted ones too), layout, magnitude and NaN/Inf
placement, eagerly and under jit; with a key, the round trip of ``quantize_stochastic``.

The random bits of stochastic rounding (``qformats._random``) are tested statistically against
what independent uniform bits would give: bin counts, neighbour correlation, bit balance,
independence across keys.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qformats as qf
from qformats import _random

ALL_FORMATS = qf.list_formats(unlisted=True)
SHAPES = [(4, 64), (32, 64), (64, 32), (16, 128), (128, 128)]


def _variants(fmt):
    """The format as a recipe or a model would aim it: along each axis of a 2-D operand, and
    NVFP4 in 16x16 tiles."""
    out = [fmt]
    if "axis" in fmt.axis_fields:
        out.append(fmt.replace(axis=0))
    if "tile_axis" in fmt.axis_fields:
        out.append(fmt.replace(axis=-1, tile_axis=0))
    return out


def _shape_for(fmt):
    for shape in SHAPES:
        try:
            fmt.block_shape(shape)
            return shape
        except ValueError:
            continue
    pytest.skip(f"{fmt.name}: no 2-D test shape fits its layout")  # pragma: no cover


def _input(shape, seed, lo, hi, specials):
    """Signed log-uniform magnitudes in [2**lo, 2**hi], zeros, and optionally NaN / +-Inf / subnormals."""
    rng = np.random.default_rng(seed)
    x = (np.where(rng.random(shape) < 0.5, -1, 1) * 2.0 ** rng.uniform(lo, hi, shape)).astype(np.float32)
    x[rng.random(shape) < 0.05] = 0
    if specials:
        flat = x.reshape(-1)
        pos = rng.choice(flat.size, 4, replace=False)
        flat[pos] = [np.nan, np.inf, -np.inf, np.float32(1e-40)]
    return x


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32)[~np.isnan(a)], b.view(np.uint32)[~np.isnan(a)])
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


def _round_trip(fmt, x, key):
    data, scale = fmt.quantize(x) if key is None else fmt.quantize_stochastic(x, key)
    return fmt.dequantize(data, scale)


def _has_stochastic(fmt, x):
    try:
        jax.eval_shape(fmt.quantize_stochastic, x, jax.random.key(0))
        return True
    except NotImplementedError:
        with pytest.raises(NotImplementedError, match="stochastic"):
            fmt.fake_quantize(x, jax.random.key(0))
        return False


@pytest.mark.parametrize("name", ALL_FORMATS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    lo=st.integers(-140, 0),
    width=st.integers(0, 60),
    specials=st.booleans(),
    stochastic=st.booleans(),
)
def test_fake_quantize_is_the_round_trip_bit_for_bit(name, seed, lo, width, specials, stochastic):
    """Eagerly, over magnitudes from float32's subnormals to 2**120 and NaN / Inf anywhere."""
    for fmt in _variants(qf.get_format(name)):
        x = _input(_shape_for(fmt), seed, lo, min(lo + width, 120), specials)
        key = jax.random.key(seed) if stochastic and _has_stochastic(fmt, x) else None
        _same(fmt.fake_quantize(x, key), _round_trip(fmt, x, key))


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_fake_quantize_is_the_round_trip_under_jit(name):
    """Under jit (XLA rewrites what runs op by op eagerly): tiny, huge, NaN and Inf values."""
    for fmt in _variants(qf.get_format(name)):
        x = _input(_shape_for(fmt), 11, -130, 100, True)
        keys = [None, jax.random.key(4)] if _has_stochastic(fmt, x) else [None]
        for key in keys:
            _same(jax.jit(fmt.fake_quantize)(x, key), jax.jit(_round_trip, static_argnums=0)(fmt, x, key))


def test_fake_quantize_under_vmap_equals_per_item():
    x = _input((3, 8, 64), 5, -10, 10, False)
    for fmt in (qf.MXFP4, qf.NVFP4, qf.MXFP8):
        got = jax.jit(jax.vmap(fmt.fake_quantize))(x)
        ref = jax.jit(lambda v, fmt=fmt: fmt.dequantize(*fmt.quantize(v)))
        for i in range(3):
            _same(got[i], ref(x[i]))


# -------------------------------------------------------------------------------------------------
# The bits of stochastic rounding
# -------------------------------------------------------------------------------------------------

N = 1 << 18


def _chi2_256(values):
    counts = np.bincount(values.astype(np.int64), minlength=256)
    expected = len(values) / 256
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_random_bits_look_uniform_and_independent(seed):
    bits = np.asarray(_random.random_bits(jax.random.key(seed), (N // 512, 512))).reshape(-1)
    # chi-square over 256 bins (255 degrees of freedom: mean 255, sd 22.6) of the top, middle and
    # bottom byte: a biased stream lands far above, a structured one (the counter itself) far below
    for shift in (24, 12, 0):
        chi2 = _chi2_256((bits >> shift) & 0xFF)
        assert 255 - 6 * 22.6 < chi2 < 255 + 6 * 22.6, (shift, chi2)
    # each bit is set half of the time (binomial sd 0.5 / sqrt(N))
    ones = ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).mean(0)
    assert np.all(np.abs(ones - 0.5) < 6 * 0.5 / np.sqrt(N)), ones
    # neighbours along both axes, and the same position under another key, are uncorrelated
    u = (bits >> 8).astype(np.float64) * 2.0**-24
    other = np.asarray(_random.uniform(jax.random.key(seed + 1), (N // 512, 512))).reshape(-1)
    for a, b in ((u[:-1], u[1:]), (u[:-512], u[512:]), (u, other)):
        assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(len(a))
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 6 * np.sqrt(1 / 12 / N) and abs(u.var() - 1 / 12) < 0.002


def test_random_bits_depend_on_the_key_and_on_nothing_else():
    k = jax.random.key(7)
    a = np.asarray(_random.random_bits(k, (64, 64)))
    np.testing.assert_array_equal(a, np.asarray(jax.jit(_random.random_bits, static_argnums=1)(k, (64, 64))))
    assert (a != np.asarray(_random.random_bits(jax.random.key(8), (64, 64)))).mean() > 0.99
    # a shape's elements draw distinct words (a collision among 4096 32-bit words is unlikely: p ~ 0.002)
    assert len(np.unique(a)) >= a.size - 1


def test_random_bits_of_more_than_2_to_the_32_elements_trace():
    """Beyond 2**32 elements the linear index wraps and the leading index is hashed in (traced
    only: such an array does not fit this machine)."""
    out = jax.eval_shape(lambda k: _random.random_bits(k, (2**17 + 1, 2**15)), jax.random.key(0))
    assert out.shape == (2**17 + 1, 2**15) and out.dtype == jnp.uint32


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters (cond, jit, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("fmt", [qf.NVFP4, qf.MXFP4, qf.MXFP8], ids=lambda f: f.name)
def test_stochastic_rounding_runs_no_data_sized_prng(fmt):
    """The PRNG (threefry) draws two words per array; the per-element bits are the in-loop hash."""
    x = jnp.zeros((256, 512), jnp.float32)
    jaxpr = jax.make_jaxpr(fmt.fake_quantize)(x, jax.random.key(0)).jaxpr
    prng = [e for e in _eqns(jaxpr) if "threefry" in e.primitive.name or "random_bits" in e.primitive.name]
    assert prng, "expected the two key words to be drawn with jax.random"
    assert max(np.prod(v.aval.shape) for e in prng for v in e.outvars) <= 2
