"""Properties every registered format must satisfy (built-ins and the custom-format guide's).

References are independent of the code under test: errors are bounded with numpy from the format's
published element parameters (``max_value``, mantissa width / integer step), and element values
of minifloat formats are checked against ml_dtypes' decoding.
"""

import attrs
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qformats as qf

FORMATS = qf.list_formats()
CANDIDATE_SHAPES = [(4, 64), (128, 32), (256, 64), (128, 128)]
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fits(fmt, shape) -> bool:
    try:
        fmt.block_shape(shape)
        return True
    except ValueError:
        return False


def valid_shape(fmt):
    """The first small 2-D shape the format's layout accepts."""
    for shape in CANDIDATE_SHAPES:
        if _fits(fmt, shape):
            return shape
    raise AssertionError(f"no candidate shape fits {fmt!r}")


def make_input(shape, seed, lo, hi, zero_frac):
    """Signed values with log-uniform magnitudes in [2**lo, 2**hi], some exact zeros."""
    rng = np.random.default_rng(seed)
    mag = 2.0 ** rng.uniform(lo, hi, size=shape)
    x = (np.where(rng.random(shape) < 0.5, -1, 1) * mag).astype(np.float32)
    x[rng.random(shape) < zero_frac] = 0
    return x


def half_step(element, v):
    """Largest round-to-nearest error of element value ``v`` (numpy, from the element's spec)."""
    if isinstance(element, qf.IntElement):
        return np.full(v.shape, element.step / 2)
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-300)))
    return 2.0 ** (np.maximum(e, element.emin) - element.mbits - 1)


def expanded_scale(fmt, scale, shape):
    s = np.asarray(fmt.scale_values(scale), np.float64)
    block = fmt.block_shape(shape)
    for axis, b in enumerate(block):
        s = np.repeat(s.reshape(s.shape if s.ndim else (1,) * len(shape)), b, axis=axis) if s.ndim else s
    return np.broadcast_to(s, shape)


inputs = st.tuples(
    st.integers(0, 2**31 - 1),
    st.integers(-20, 0),
    st.integers(0, 20),
    st.sampled_from([0.0, 0.1]),
)


@pytest.mark.parametrize("name", FORMATS)
@SETTINGS
@given(params=inputs)
def test_round_trip_error_bound(name, params):
    """|dequant - x| <= half an element step * block scale for in-range values; beyond: saturate."""
    fmt = qf.get_format(name)
    shape = valid_shape(fmt)
    x = make_input(shape, *params)
    data, scale = fmt.quantize(jnp.asarray(x))
    deq = np.asarray(fmt.dequantize(data, scale), np.float64)
    s = expanded_scale(fmt, scale, shape)
    v = x / s
    in_range = np.abs(v) <= fmt.max_value
    bound = half_step(fmt.element, v) * s + 2.0**-22 * np.abs(x)  # slack: x / s rounds in float32
    err = np.abs(deq - x)
    assert np.all(err[in_range] <= bound[in_range]), f"max excess {np.max(err - bound)}"
    np.testing.assert_allclose(np.abs(deq[~in_range]), (fmt.max_value * s)[~in_range], rtol=1e-6)
    assert np.all(np.sign(deq) * np.sign(x) >= 0)


@pytest.mark.parametrize("name", FORMATS)
@SETTINGS
@given(params=inputs)
def test_requantize_is_fixed_point(name, params):
    """quantize(dequantize(q)) represents the same values as q.

    Exactly when the scales are powers of two (the requantized amax gives the same exponent).
    A scale of amax / max_value is recomputed from amax' = code * scale, rounded in float32, so
    there the values may move by a few float32 ulps, never by an element step.
    """
    fmt = qf.get_format(name)
    x = make_input(valid_shape(fmt), *params)
    q = fmt.quantize(jnp.asarray(x))
    y = np.asarray(fmt.dequantize(*q))
    y2 = np.asarray(fmt.dequantize(*fmt.quantize(jnp.asarray(y))))
    s = np.asarray(fmt.scale_values(q[1]), np.float64)
    pow2 = np.all(np.frexp(s[np.isfinite(s) & (s > 0)])[0] == 0.5)
    if pow2:
        np.testing.assert_array_equal(y2, y)
    else:
        np.testing.assert_allclose(y2, y, rtol=4 * 2.0**-23, atol=0)


@pytest.mark.parametrize("name", FORMATS)
def test_zero_blocks_stay_zero(name):
    fmt = qf.get_format(name)
    shape = valid_shape(fmt)
    x = make_input(shape, 0, -3, 3, 0.0)
    block = fmt.block_shape(shape)
    x[: block[0], : block[1]] = 0  # one whole block of zeros
    deq = np.asarray(fmt.dequantize(*fmt.quantize(jnp.asarray(x))))
    assert np.all(deq[: block[0], : block[1]] == 0)
    assert np.all(np.isfinite(deq))
    zeros = np.zeros(shape, np.float32)
    assert np.all(np.asarray(fmt.dequantize(*fmt.quantize(jnp.asarray(zeros)))) == 0)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_inf_policy(name, bad):
    """A NaN makes its block NaN; Inf makes it NaN (E8M0/float32 scales) or saturates (E4M3 scales).

    Blocks that share no scale with the bad element are those of the same tensor with the bad element
    replaced by 0, unless the format has a tensor-wide scale level computed from the amax (per-tensor
    formats; two-level NVFP4 for a NaN): then the whole tensor is NaN. (Every position of a block,
    every scale mode: tests/test_boundaries.py.)
    """
    fmt = qf.get_format(name)
    shape = valid_shape(fmt)
    x = make_input(shape, 1, -3, 3, 0.0)
    x[0, 0] = bad
    deq = np.asarray(fmt.dequantize(*fmt.quantize(jnp.asarray(x))))
    block = fmt.block_shape(shape)
    in_block = np.zeros(shape, bool)
    in_block[: block[0], : block[1]] = True
    if np.isnan(bad):
        assert np.isnan(deq[0, 0])
    else:
        assert np.isnan(deq[0, 0]) or deq[0, 0] == np.sign(bad) * np.max(np.abs(deq[in_block]))
    tensor_wide = np.all(np.isnan(deq))
    if not tensor_wide:
        clean = np.where(np.isfinite(x), x, 0)
        np.testing.assert_array_equal(
            deq[~in_block], np.asarray(fmt.dequantize(*fmt.quantize(jnp.asarray(clean))))[~in_block]
        )
    assert not np.any(np.isinf(deq))


@pytest.mark.parametrize("name", FORMATS)
def test_shapes_dtypes_jit_vmap(name):
    fmt = qf.get_format(name)
    shape = valid_shape(fmt)
    x = jnp.asarray(make_input(shape, 2, -5, 5, 0.05))
    data, scale = fmt.quantize(x)
    assert data.shape == fmt.data_shape(shape)
    assert fmt.value_shape(data.shape) == shape
    assert jax.tree.leaves(scale)[0].shape == fmt.scale_shape(shape)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        assert fmt.dequantize(data, scale, dtype=dtype).dtype == dtype
    jd, js = jax.jit(fmt.quantize)(x)
    np.testing.assert_array_equal(np.asarray(jd), np.asarray(data))
    for a, b in zip(jax.tree.leaves(js), jax.tree.leaves(scale), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(fmt.dequantize)(data, scale)), np.asarray(fmt.dequantize(data, scale))
    )
    # vmap over a new leading axis equals quantizing each slice on its own.
    xs = jnp.stack([x, 2 * x, -x])
    vd, vs = jax.vmap(fmt.quantize)(xs)
    vdeq = jax.vmap(fmt.dequantize)(vd, vs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(vdeq[i]), np.asarray(fmt.dequantize(*fmt.quantize(xs[i]))))
    # bf16 / f16 inputs are accepted and quantized from their float32 value.
    np.testing.assert_array_equal(
        np.asarray(fmt.dequantize(*fmt.quantize(x.astype(jnp.bfloat16)))),
        np.asarray(fmt.dequantize(*fmt.quantize(x.astype(jnp.bfloat16).astype(jnp.float32)))),
    )


RANK_SHAPES = [(), (128,), (4, 256), (2, 16, 256), (2, 2, 16, 128), (256, 256)]


@pytest.mark.parametrize("name", qf.list_formats(unlisted=True))
def test_scale_shape_agrees_with_quantize(name):
    """The block-scale leaf of ``quantize(x)`` has shape ``scale_shape(x.shape)`` for every registered
    format (unlisted ones too) and every rank its layout accepts, traced, eagerly and under vmap
    (which adds the mapped axis in front). The tensorwise float8 formats returned ``(1,) * rank``
    where ``scale_shape`` says ``()``."""
    fmt = qf.get_format(name)
    tried = 0
    for shape in RANK_SHAPES:
        try:
            want = fmt.scale_shape(shape)
            _, scale = jax.eval_shape(fmt.quantize, jax.ShapeDtypeStruct(shape, jnp.float32))
        except ValueError:  # the layout refuses this shape (test_boundaries checks the message)
            continue
        tried += 1
        assert jax.tree.leaves(scale)[0].shape == want, (shape, jax.tree.leaves(scale)[0].shape, want)
        _, vscale = jax.eval_shape(jax.vmap(fmt.quantize), jax.ShapeDtypeStruct((3, *shape), jnp.float32))
        assert jax.tree.leaves(vscale)[0].shape == (3, *want), shape
    assert tried >= 2, f"{name}: fewer than two shapes fit"
    shape = valid_shape(fmt)
    _, scale = fmt.quantize(jnp.asarray(make_input(shape, 4, -3, 3, 0.0)))
    assert np.shape(jax.tree.leaves(scale)[0]) == fmt.scale_shape(shape)


@pytest.mark.parametrize("name", FORMATS)
def test_equal_formats_do_not_recompile(name):
    fmt = qf.get_format(name)
    traces = []

    @jax.jit
    def roundtrip(x, fmt):
        traces.append(1)
        return fmt.dequantize(*fmt.quantize(x))

    roundtrip = jax.jit(roundtrip.__wrapped__, static_argnums=1)
    x = jnp.asarray(make_input(valid_shape(fmt), 3, -2, 2, 0.0))
    roundtrip(x, fmt)
    roundtrip(x + 1, fmt.replace())  # an equal copy is the same cache key
    assert len(traces) == 1
    assert hash(fmt) == hash(fmt.replace()) and fmt == fmt.replace()


def _lowered(fn):
    """How many programs ``fn()`` lowers to XLA (JAX's lowering events): one per program it has not
    run before in this process, none for a program it reuses (a compiled program taken from the
    persistent cache is lowered too, to compute its key)."""
    events = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(events)


@pytest.mark.parametrize("name", qf.list_formats(unlisted=True))
def test_eager_calls_compile_once(name):
    """Called on concrete arrays, every entry point runs as one program per format and shape and
    reuses it: the first call lowers exactly one program, a second call with other values none,
    and a quantize gives the bits of the same quantize under ``jit``. Before, an eager call ran
    operation by operation, and each MX or NVFP4 quantize compiled its ``lax.cond`` branches again
    (closures, new at every call): 0.3-0.7 s a call on a 64x128 array, on a 2-core VM running other
    tests. Traced, the methods add no call of their own to the caller's program."""
    fmt = qf.get_format(name)
    rows, cols = valid_shape(fmt)
    # A shape no other test uses, so that operation-by-operation dispatch would lower many programs.
    shape = next(s for s in ((rows * k, cols) for k in (7, 11, 13)) if _fits(fmt, s))
    x1, x2 = (jnp.asarray(make_input(shape, seed, -4, 4, 0.05)) for seed in (5, 6))
    key = jax.random.key(0)
    try:  # the formats without a stochastic mode raise before tracing anything
        jax.eval_shape(fmt.quantize_stochastic, x1, key)
        stochastic = True
    except NotImplementedError:
        stochastic = False
    q1, q2 = [], []
    assert _lowered(lambda: q1.extend(fmt.quantize(x1)) or q1) == 1, "quantize"
    assert _lowered(lambda: q2.extend(fmt.quantize(x2)) or q2) == 0, "quantize"
    calls = {
        "dequantize": lambda x, q: fmt.dequantize(*q),
        "dequantize to bfloat16": lambda x, q: fmt.dequantize(*q, jnp.bfloat16),
        "dequantize dtype=float16": lambda x, q: fmt.dequantize(*q, dtype=jnp.float16),
        "fake_quantize": lambda x, q: fmt.fake_quantize(x),
    }
    if stochastic:
        calls["quantize_stochastic"] = lambda x, q: fmt.quantize_stochastic(x, key)
        calls["fake_quantize with a key"] = lambda x, q: fmt.fake_quantize(x, key=key)
    for what, call in calls.items():
        assert _lowered(lambda call=call: call(x1, q1)) == 1, what
        assert _lowered(lambda call=call: call(x2, q2)) == 0, what
    for got, want in zip(jax.tree.leaves(q2), jax.tree.leaves(jax.jit(fmt.quantize)(x2)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jaxpr = jax.make_jaxpr(lambda x: fmt.dequantize(*fmt.quantize(x)))(x1)
    entry_points = {"quantize", "dequantize", "fake_quantize", "quantize_stochastic"}
    assert not [e for e in jaxpr.eqns if e.params.get("name") in entry_points], jaxpr


@pytest.mark.parametrize(
    "fmt,mltype",
    [
        (qf.MXFP8, ml_dtypes.float8_e4m3fn),
        (qf.MXFP8_E5M2, ml_dtypes.float8_e5m2),
        (qf.MXFP6_E2M3, ml_dtypes.float6_e2m3fn),
        (qf.MXFP6_E3M2, ml_dtypes.float6_e3m2fn),
        (qf.MXFP4, ml_dtypes.float4_e2m1fn),
        (qf.FP8_E4M3, ml_dtypes.float8_e4m3fn),
    ],
)
def test_elements_match_ml_dtypes_rounding(fmt, mltype):
    """Element values equal ml_dtypes' round-to-nearest-even of x / scale (clamped to max)."""
    shape = valid_shape(fmt)
    x = make_input(shape, 4, -12, 12, 0.05)
    data, scale = fmt.quantize(jnp.asarray(x))
    s = expanded_scale(fmt, scale, shape).astype(np.float32)
    v = np.clip(x / s, -fmt.max_value, fmt.max_value)
    expected = v.astype(mltype).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(fmt.decode(data)), expected)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "nvfp4"])
def test_packed_storage_is_real(name):
    """Sub-byte formats pack by default; unpacked variants hold one code per byte, same values."""
    fmt = qf.get_format(name)
    limit = {"mxfp4": 0.54, "mxfp6_e2m3": 0.79, "mxfp6_e3m2": 0.79, "nvfp4": 0.57}[name]
    assert fmt.nbytes((1024, 1024)) / 1024**2 <= limit
    x = jnp.asarray(make_input((8, 64), 5, -4, 4, 0.0))
    loose = fmt.replace(packed=False)
    assert loose.quantize(x)[0].shape == (8, 64)
    np.testing.assert_array_equal(
        np.asarray(fmt.dequantize(*fmt.quantize(x))), np.asarray(loose.dequantize(*loose.quantize(x)))
    )


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_mx_axis_equals_transposed(axis):
    x = jnp.asarray(make_input((64, 96), 6, -6, 6, 0.0))
    fmt = qf.MXFP4.replace(axis=axis)
    got = fmt.dequantize(*fmt.quantize(x))
    if axis % 2 == 0:
        ref = qf.MXFP4.dequantize(*qf.MXFP4.quantize(x.T)).T
    else:
        ref = qf.MXFP4.dequantize(*qf.MXFP4.quantize(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_scale_modes_order():
    """For a block whose amax is not a power of two: floor <= even <= ceil exponents; rceil never saturates."""
    x = jnp.asarray(make_input((16, 256), 7, -8, 8, 0.0))
    exps = {}
    for mode in ("floor", "ceil", "even", "rceil"):
        fmt = qf.MXFP8.replace(scale_mode=mode)
        data, scale = fmt.quantize(x)
        exps[mode] = np.asarray(jax.lax.bitcast_convert_type(scale, jnp.uint8)).astype(int)
        if mode == "rceil":
            assert np.all(np.abs(np.asarray(fmt.decode(data))) <= fmt.max_value)
            amax = np.abs(np.asarray(x)).reshape(16, 8, 32).max(-1)
            assert np.all(amax / 2.0 ** (exps[mode] - 127) <= fmt.max_value)
    assert np.all(exps["floor"] <= exps["even"]) and np.all(exps["even"] <= exps["ceil"])
    assert np.all(exps["ceil"] - exps["floor"] <= 1)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_custom_format_example_zero_and_tiny_groups(jit):
    """The guide's ``int4_g128`` on an all-zero group, a group of amax 1e-40 (subnormal: XLA reads
    it as 0) and a group of normal values whose ``amax / 7`` is subnormal, against numpy: the scale
    is ``max(amax / 7, 2**-126)`` (1 for a zero group), codes ``round_even(x / scale)``. Without
    the floor the third scale was flushed to 0 and every value came back 0 (x / 0 saturated)."""
    fmt = qf.get_format("int4_g128")
    tiny = np.float32(np.finfo(np.float32).tiny)
    x = np.zeros((384, 2), np.float32)
    x[128:256, 0] = np.float32(1e-40) * np.linspace(-1, 1, 128, dtype=np.float32)  # amax 1e-40
    x[256:, 0] = tiny * np.resize(np.float32([0, 1, -1.5, 2.25, -3, 6.5, -6]), 128)  # amax 6.5 * 2**-126
    x[:, 1] = np.linspace(-2, 2, 384, dtype=np.float32)
    quantize = jax.jit(fmt.quantize) if jit else fmt.quantize
    data, scale = quantize(jnp.asarray(x))
    deq = np.asarray(fmt.dequantize(data, scale))
    # numpy: a float32 subnormal input reads as 0 on XLA's CPU; every scale here is a power of two
    # or a ratio checked as float32 division
    xr = np.where(np.abs(x) < tiny, np.float32(0), x)
    amax = np.abs(xr).reshape(3, 128, 2).max(1)
    s_ref = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(7), tiny)).astype(np.float32)
    s_full = np.repeat(s_ref, 128, axis=0)
    ref = (np.clip(np.rint(xr / s_full), -7, 7) * s_full).astype(np.float32)
    assert np.all(np.asarray(scale) >= tiny)
    assert np.isfinite(deq).all()
    np.testing.assert_array_equal(deq[:, 0], ref[:, 0])
    np.testing.assert_array_equal(deq[256:, 0], tiny * np.resize(np.float32([0, 1, -2, 2, -3, 6, -6]), 128))
    np.testing.assert_allclose(deq[:, 1], ref[:, 1], rtol=0, atol=float(s_ref.max()) / 2 * 1.001)


def _slice_by_slice(fmt, x, axis):
    """Each slice of ``x`` along ``axis`` quantized on its own (a length-1 axis kept), restacked."""
    one = lambda s: fmt.fake_quantize(jnp.expand_dims(s, axis)).squeeze(axis)
    return np.asarray(jax.vmap(one, in_axes=axis, out_axes=axis)(jnp.asarray(x)))


def _variants(fmt, shape):
    """The format and its copies aimed at each axis of ``shape`` that it can block."""
    out = {fmt}
    for a in range(len(shape)):
        try:
            aimed = fmt.aim(a, 1 - a)
            aimed.block_shape(shape)
        except ValueError:
            continue
        out.add(aimed)
    if "tensor_scale" in attrs.fields_dict(type(fmt)):  # NVFP4's levels: two and one
        out |= {f.replace(tensor_scale=not f.tensor_scale) for f in out}
    return sorted(out, key=repr)


@pytest.mark.parametrize("name", qf.list_formats(unlisted=True))
@SETTINGS
@given(params=inputs)
def test_separable_formats_quantize_slice_by_slice(name, params):
    """Where a format says the slices along an axis quantize alone, quantizing the array equals
    quantizing each slice on its own, bit for bit (rows of very different magnitudes, some zero)."""
    base = qf.get_format(name)
    shape = valid_shape(base)
    x = make_input(shape, *params)
    x *= (2.0 ** np.random.default_rng(params[0]).integers(-8, 8, size=(shape[0], 1))).astype(np.float32)
    for fmt in _variants(base, shape):
        for axis in range(len(shape)):
            if fmt.separable(shape, axis):
                whole = np.asarray(fmt.fake_quantize(jnp.asarray(x)))
                np.testing.assert_array_equal(whole, _slice_by_slice(fmt, x, axis), err_msg=f"{fmt!r} axis {axis}")


@pytest.mark.parametrize(
    ("fmt", "axis", "separable"),
    [
        (qf.MXFP8, 0, True),  # blocks along the last axis: rows quantize alone
        (qf.INT8_PER_CHANNEL, 1, True),
        (qf.INT8_PER_CHANNEL, 0, False),  # a channel's scale sees all its rows
        (qf.get_format("fp8_e4m3_rowwise"), 0, True),
        (qf.NVFP4.replace(tensor_scale=False), 0, True),
        (qf.NVFP4, 0, False),  # the tensor scale sees every row
        (qf.FP8_E4M3, 0, False),
        (qf.get_format("fp8_e4m3_tensorwise"), 0, False),
    ],
)
def test_separable_is_what_slice_by_slice_shows(fmt, axis, separable):
    """The claim against the evidence: a separable format's whole array and slices agree, and each
    format that is not separable here gives different values slice by slice on rows of different
    magnitudes (the claim is needed, not vacuous)."""
    shape = (64, 64)
    x = make_input(shape, 3, -4, 4, 0.1) * np.float32(2.0) ** np.arange(-8, 8, 0.25, dtype=np.float32)[:, None]
    x = x if axis == 0 else x.T.copy()
    assert fmt.separable(shape, axis) is separable
    agree = np.array_equal(np.asarray(fmt.fake_quantize(jnp.asarray(x))), _slice_by_slice(fmt, x, axis))
    assert agree is separable
