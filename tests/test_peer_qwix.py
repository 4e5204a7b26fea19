"""Bit-exact agreement with google's qwix, computed live: the same tensor quantized by both.

qwix (``qwix.quantize`` / ``qwix.dequantize`` under ``jax.jit``, as a training step runs them) is
the reference here, run in the same process on the same arrays; nothing of it is copied. What qwix
computes, read from its code and confirmed by the tests below: the scale is ``amax / max``, which
XLA evaluates as ``amax * fl(1 / max)`` (a division by a constant becomes a multiplication by its
rounded reciprocal, eagerly and under jit); MX formats round it up to ``2**ceil(log2(.))``, NVFP4
rounds it to E4M3; the elements are ``x / scale`` clipped to the element range and cast.

Its blocked schemes coincide with ours, checked code by code, scale by scale and value by value:

* qwix ``"mxfp8"`` / ``"mxfp4"`` (blocks of 32 along the last axis, every other axis channelwise):
  ours ``MXFP8`` / ``MXFP4`` with ``scale_mode="rceil"``;
* qwix ``"nvfp4"`` (blocks of 16, no tensor scale): ours ``NVFP4`` with ``tensor_scale=False``;
* qwix's quantized-training forward (``QtProvider``, MXFP8 or MXFP4 weights and activations) is
  ``scalify.recipes.apply`` of the unchanged model with the same formats.

Where they differ, by design or by rounding (each tested as a difference, so that a change on
either side shows):

* MX, a block whose amax is within about 2^-16 (relative) of ``max * 2**k``: qwix's float32
  ``log2`` is not exact there (its error grows with ``|k|``), so its exponent may be one above ours
  just below the power of two, or one below just above it (the block then saturates by a few
  ulps). Ours is the exact ceiling, as NVIDIA's rceil defines it. Random blocks all but never land
  there (none in 200,000 amax drawn at random, log-uniformly);
* qwix replaces a scale below ``sqrt(FLT_MIN)`` by 1, so a block whose amax is below
  ``max * sqrt(FLT_MIN)`` (4.9e-17 for E4M3) flushes to zero; ours scales it like any other block;
* NVFP4, a block with ``amax / 6`` below E4M3's smallest normal (2^-6): qwix's E4M3 cast rounds
  the scale to a subnormal or to 0 (a zero scale zeroes the block); ours clamps it to 2^-6, as
  torchao does (``tests/test_conformance.py`` holds torchao's vectors);
* an MX block holding NaN or Inf: ours is all NaN (a NaN scale, the OCP rule); qwix's scale is Inf
  or NaN and its elements 0 or NaN (NVFP4 saturates an Inf in both). Zero blocks are zero in both
  (their scales differ: 1 in qwix);
* per-tensor FP8: qwix's scale ``amax * fl(1 / max)`` differs from ours, torchao's ``amax / max``
  (a true division), in the last bit for about half of all amax values;
* int8 per channel: qwix's bound is 127.5 (a channel's negative extreme becomes -128) and it
  multiplies by the scale's rounded reciprocal; ours is 127 with symmetric codes.

Inputs are float32 normals or zeros: XLA on CPU flushes float32 subnormals to zero inside
arithmetic, on both sides alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import qformats as qf

qwix = pytest.importorskip("qwix", reason="qwix is not installed (pip install -e '.[test]')")

ROWS, COLS = 4, 64
TINY = np.finfo(np.float32).tiny
E4M3_MIN_NORMAL = 2.0**-6

# name: (our format, qwix qtype, qwix layout keywords for a [rows, COLS] array)
SCHEMES = {
    "mxfp8": (qf.MXFP8.replace(scale_mode="rceil"), "mxfp8", {"tiled_axes": {1: 32}, "channelwise_axes": (0,)}),
    "mxfp4": (qf.MXFP4.replace(scale_mode="rceil"), "mxfp4", {"tiled_axes": {1: 32}, "channelwise_axes": (0,)}),
    "nvfp4": (qf.NVFP4.replace(tensor_scale=False), "nvfp4", {"tiled_axes": {1: 16}, "channelwise_axes": (0,)}),
}


def _guard(fmt) -> float:
    """qwix's smallest kept amax: a scale ``amax / max`` below ``sqrt(FLT_MIN)`` becomes 1."""
    return fmt.max_value * np.sqrt(TINY)


def _low(name) -> float:
    """The smallest block amax for which the two conventions coincide (see the module note)."""
    fmt = SCHEMES[name][0]
    return fmt.max_value * E4M3_MIN_NORMAL if name == "nvfp4" else _guard(fmt)


def _block(name) -> int:
    return SCHEMES[name][2]["tiled_axes"][1]


# Relative distance to max * 2**k within which qwix's log2 may round either way: the farthest
# disagreement found, scanning every k of the normal range 3000 float32 steps either side, was
# 7.0e-6 (2^-17.1); the window is twice that.
EDGE_WINDOW = 2.0**-16


def _near_edge(name, amax) -> np.ndarray:
    """MX blocks whose ``amax / max`` lies within :data:`EDGE_WINDOW` of a power of two."""
    if name == "nvfp4":
        return np.zeros(amax.shape, bool)
    ratio = amax.astype(np.float64) / SCHEMES[name][0].max_value
    edge = np.exp2(np.round(np.log2(np.where(ratio > 0, ratio, 1.0))))
    return np.abs(ratio / edge - 1) < EDGE_WINDOW


def _lift(name, x):
    """``x`` with every block below :func:`_low` or near an edge (:func:`_near_edge`) set to ones."""
    b = _block(name)
    blocks = x.reshape(len(x), COLS // b, b)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    odd = (amax < _low(name)) | _near_edge(name, amax)
    return np.where(odd, np.float32(1), blocks).reshape(x.shape)


@functools.cache
def _ours(name):
    fmt = SCHEMES[name][0]

    def run(x):
        data, scale = fmt.quantize(x)
        return fmt.decode(data), fmt.scale_values(scale), fmt.dequantize(data, scale)

    return jax.jit(run)


@functools.cache
def _theirs(name):
    _, qtype, layout = SCHEMES[name]

    def run(x):
        q = qwix.quantize(x, qtype, **layout)
        return q.qvalue.astype(jnp.float32), q.scale, qwix.dequantize(q)

    return jax.jit(run)


def _same(a, b) -> np.ndarray:
    a, b = np.asarray(a), np.asarray(b)
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _run_both(name, x):
    ours = [np.asarray(v) for v in _ours(name)(jnp.asarray(x))]
    theirs = [np.asarray(v) for v in _theirs(name)(jnp.asarray(x))]
    return ours, theirs


def _assert_agree(name, x):
    """Codes, scales (of nonzero blocks: a zero block's scale is 1 in qwix) and values are equal."""
    (codes, scales, values), (q_codes, q_scales, q_values) = _run_both(name, x)
    b = _block(name)
    nonzero = np.abs(x).reshape(len(x), COLS // b, b).max(axis=-1) > 0
    np.testing.assert_array_equal(scales[nonzero], q_scales[nonzero])
    assert _same(codes, q_codes).all(), f"{name}: element codes differ"
    assert _same(values, q_values).all(), f"{name}: dequantized values differ"


def _wide_rows(seed, rows=ROWS):
    """Rows whose magnitudes span 2^-40..2^40, so blocks sit at every scale exponent in range."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-40, 40, (rows, 1)) + rng.uniform(-6, 0, (rows, COLS)))
    return (mag * rng.choice([-1.0, 1.0], (rows, COLS))).astype(np.float32)


@pytest.mark.parametrize("name", SCHEMES)
def test_random_tensors_agree_bit_for_bit(name):
    _assert_agree(name, _lift(name, _wide_rows(0, rows=256)))


def _edge_rows(name, steps):
    """One row per ``k``: blocks whose amax is ``max * 2**k`` moved by ``steps`` float32 steps."""
    max_value = SCHEMES[name][0].max_value
    rows = []
    for k in range(-62, 126):
        amax = np.float32(max_value * 2.0**k)
        if not np.isfinite(amax):
            break
        for _ in range(abs(steps)):
            amax = np.nextafter(amax, np.float32(np.inf if steps > 0 else 0))
        if np.isfinite(amax) and amax >= _low(name):
            row = np.full(COLS, amax * np.float32(0.3), np.float32)
            row[::7] = -amax * np.float32(0.77)
            row[1 :: _block(name)] = amax
            rows.append(row)
    return np.stack(rows)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_blocks_near_a_power_of_two_differ_by_one_exponent_at_most_and_only_inside_the_window(name):
    """Outside :data:`EDGE_WINDOW` every block agrees; inside, qwix's exponent is ours or one off."""
    inside = 0
    for steps in (-600, -100, -3, -1, 0, 1, 3, 100, 600):
        x = _edge_rows(name, steps)
        (_, scales, _), (_, q_scales, _) = _run_both(name, x)
        near = _near_edge(name, np.abs(x).max(axis=1))
        assert near.any() == near.all() == (abs(steps) < 600), "the window should hold the near rows only"
        if near.all():
            inside += np.sum(scales != q_scales)
            assert np.isin(q_scales / scales, [0.5, 1.0, 2.0]).all()
        else:
            _assert_agree(name, x)
    assert inside > 0, "qwix's exponent now always matches the exact ceiling: narrow EDGE_WINDOW"


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_a_block_holding_nan_or_inf_is_nan_here_and_leaves_the_other_blocks_alike(name, special):
    """NVFP4's Inf saturates (scale clamped to 448, elements to 6) here and in qwix alike."""
    x = _lift(name, _wide_rows(7))
    x[1, 3] = special
    x[2] = 0.0  # an all-zero row: zero blocks, zero in both
    (codes, _, values), (q_codes, _, q_values) = _run_both(name, x)
    b = _block(name)
    rest = np.ones(x.shape, bool)
    if name != "nvfp4" or np.isnan(special):
        assert np.isnan(values[1, :b]).all(), "OCP: a block holding NaN or Inf dequantizes to NaN"
        rest[1, :b] = False
    assert _same(values[rest], q_values[rest]).all() and _same(codes[rest], q_codes[rest]).all()
    assert (values[2] == 0).all() and (q_values[2] == 0).all()


_normal_f32 = st.floats(
    min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32
).map(lambda v: v if abs(v) >= TINY else 0.0)


@pytest.mark.parametrize("name", SCHEMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(x=hnp.arrays(np.float32, (ROWS, COLS), elements=_normal_f32))
def test_property_any_normal_tensor_agrees(name, x):
    _assert_agree(name, _lift(name, x))


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_a_block_below_qwix_guard_is_kept_here_and_flushed_by_qwix(name):
    x = _lift(name, _wide_rows(3))
    x[0, :32] = np.float32(_guard(SCHEMES[name][0]) / 8) * np.linspace(-1, 1, 32, dtype=np.float32)
    (_, _, values), (_, _, q_values) = _run_both(name, x)
    assert (q_values[0, :32] == 0).all(), "qwix no longer flushes a block below its guard: update the note"
    kept = x[0, :32] != 0
    rel = np.abs(values[0, :32][kept] - x[0, :32][kept]) / np.abs(x[0, :32][kept])
    assert np.median(rel) < 0.25, "a tiny block is scaled like any other block, not flushed"
    assert _same(values[:, 32:], q_values[:, 32:]).all() and _same(values[1:], q_values[1:]).all()


def test_nvfp4_block_scale_below_e4m3_normal_is_clamped_here_and_rounded_to_e4m3_by_qwix():
    x = _lift("nvfp4", _wide_rows(3))
    x[0, :16] = np.linspace(-0.05, 0.05, 16, dtype=np.float32)  # amax / 6 < 2^-6
    (_, scales, _), (_, q_scales, _) = _run_both("nvfp4", x)
    assert scales[0, 0] == E4M3_MIN_NORMAL
    assert q_scales[0, 0] == np.float32(0.05 * np.float32(1 / 6)).astype(jnp.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(scales[:, 1:], q_scales[:, 1:])
    np.testing.assert_array_equal(scales[1:], q_scales[1:])


def test_per_tensor_fp8_scales_differ_in_the_last_bit_by_the_reciprocal():
    """qwix's scale is ``amax * fl(1/448)``; ours, torchao's, ``amax / 448`` (a true division)."""
    rng = np.random.default_rng(2)
    amax = (rng.uniform(1, 2, 64) * np.exp2(rng.integers(-20, 20, 64))).astype(np.float32)
    fmt = qf.FP8_E4M3.replace(scale_mode="exact")
    tensors = jnp.asarray(np.stack([amax, -amax / 3], axis=1)[:, None, :])  # 64 tensors [1, 2]
    ours = np.asarray(jax.jit(jax.vmap(lambda v: fmt.quantize(v)[1]))(tensors))
    theirs = np.asarray(jax.jit(jax.vmap(lambda v: qwix.quantize(v, jnp.float8_e4m3fn).scale))(tensors))
    theirs = theirs.reshape(ours.shape)
    np.testing.assert_array_equal(ours, amax / np.float32(448))
    np.testing.assert_array_equal(theirs, amax * (np.float32(1) / np.float32(448)))
    assert 0 < np.mean(ours != theirs) < 1


def test_int8_per_channel_differs_from_qwix_by_its_127_5_bound():
    """qwix's codes are ``round(x * fl(1 / s))``, ``s = amax * fl(1/127.5)``, clipped to int8 (XLA
    turns the division by the scale into a product with its reciprocal); ours use 127, symmetric."""
    x = _wide_rows(5)
    amax = np.abs(x).max(axis=1, keepdims=True)
    q = jax.jit(lambda v: qwix.quantize(v, jnp.int8, channelwise_axes=(0,)).qvalue)(jnp.asarray(x))
    s = amax * (np.float32(1) / np.float32(127.5))
    expect = np.clip(np.round(x * (np.float32(1) / s)), -128, 127)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), expect)
    assert np.asarray(q).min() == -128
    fmt = qf.INT8_PER_CHANNEL.replace(axis=0)  # one scale per row, as qwix's channelwise axis 0
    data, _ = fmt.quantize(jnp.asarray(x))
    codes = np.asarray(fmt.decode(data))
    assert np.abs(codes).max() == 127
    np.testing.assert_array_equal(np.abs(codes).max(axis=1), 127)


@pytest.mark.filterwarnings("ignore:'VariableState' was removed:DeprecationWarning")  # qwix's, on flax 0.12
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_qwix_quantized_training_forward_equals_the_recipe_forward(name):
    """qwix's QAT forward (``QtProvider``, weights and activations in ``name``, blocks of 32 along
    the contraction) is ``recipes.apply`` with the rceil format on every GEMM role, bit for bit."""
    nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install -e '.[test]')")
    import scalify

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64)(nn.gelu(nn.Dense(128)(x)))

    model = MLP()
    x = jax.random.normal(jax.random.key(0), (32, 64))
    params = model.init(jax.random.key(1), x)
    rule = qwix.QtRule(module_path=".*", weight_qtype=name, act_qtype=name, tile_size=32)
    theirs = jax.jit(qwix.quantize_model(model, qwix.QtProvider([rule])).apply)(params, x)
    recipe = scalify.recipes.Recipe.uniform(name, SCHEMES[name][0])
    ours = jax.jit(scalify.recipes.apply(model.apply, recipe))(params, x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    plain = np.asarray(jax.jit(model.apply)(params, x))
    assert not np.array_equal(np.asarray(ours), plain), "the forward should be quantized"
