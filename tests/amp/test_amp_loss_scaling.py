"""Dynamic loss scaling: DynamicScalerState, dynamic_scale_grad / value_and_grad / tx (jaxamp's timing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scalify.amp import (
    DynamicScalerState,
    all_finite,
    dynamic_scale_grad,
    dynamic_scale_tx,
    dynamic_scale_value_and_grad,
)
from scalify.amp._loss_scaling import update_state


# -- the state: jaxamp's NamedTuple ------------------------------------------------------------------
def test_state_is_jaxamps_namedtuple():
    s = DynamicScalerState()
    assert isinstance(s, tuple) and s._fields == ("patience", "adjust_factor", "scaler", "count", "total_resets")
    patience, adjust_factor, scaler, count, total_resets = s  # unpacks positionally
    assert (int(patience), float(adjust_factor), float(scaler), int(count), int(total_resets)) == (
        2000,
        2.0,
        2.0**15,
        0,
        0,
    )
    assert s.scaler.dtype == np.float32 and s.count.dtype == np.int32 and s.total_resets.dtype == np.int32
    s = DynamicScalerState(10, 4.0, 2**10)  # positional, as a NamedTuple
    assert (s.patience, s.adjust_factor, s.scaler, int(s.count)) == (10, 4.0, 2**10, 0)
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 5
    assert jax.tree.unflatten(treedef, leaves) == s
    through_jit = jax.jit(lambda state: state)(s)
    assert type(through_jit) is DynamicScalerState and float(through_jit.scaler) == 2**10
    assert s._replace(count=3).count == 3 and s.replace(total_resets=2).total_resets == 2
    assert s._asdict()["patience"] == 10
    with pytest.raises(AttributeError):
        s.scaler = 1.0


def test_state_errors_name_the_fix():
    with pytest.raises(TypeError, match=r"min_scaler.*dynamic_scale_grad\(fun, min_scaler=\.\.\.\)"):
        DynamicScalerState(min_scaler=4.0)
    with pytest.raises(TypeError, match="no field"):
        DynamicScalerState().replace(max_scaler=2.0)
    grad_fn = dynamic_scale_grad(lambda w: jnp.sum(w**2), filter=False)
    with pytest.raises(TypeError, match=r"DynamicScalerState\(\)"):
        grad_fn(jnp.ones(3), dynamic_scaler_state={"scaler": 1.0})
    with pytest.raises(ValueError, match="min_scaler <= max_scaler"):
        dynamic_scale_grad(lambda w: w, min_scaler=4.0, max_scaler=2.0)
    with pytest.raises(ValueError, match="redo_on_nan must be an int"):
        dynamic_scale_grad(lambda w: w, redo_on_nan=-1)


# -- timing ------------------------------------------------------------------------------------------
def _loss(w, x):
    return jnp.sum((x * w) ** 2)


GOOD, BAD = jnp.ones((4,)), jnp.array([1.0, jnp.inf, 1.0, 1.0])


@pytest.fixture(scope="module")
def step():
    grad_fn = dynamic_scale_grad(_loss, filter=False)
    return jax.jit(lambda w, x, state: grad_fn(w, x, dynamic_scaler_state=state))


def test_scaler_timing_matches_hand_computed_sequence(step):
    """patience=3: count runs 1, 2, 3 over finite steps and the 4th finite step in a row grows the scaler."""
    w = jnp.ones((4,))
    state = DynamicScalerState(patience=3, scaler=16.0)
    seen = []
    for good in "GGGGGBGBGGGG":
        state, g = step(w, GOOD if good == "G" else BAD, state)
        seen.append((float(state.scaler), int(state.count), int(state.total_resets)))
        if good == "G":
            np.testing.assert_allclose(g, 2 * w, rtol=1e-6)  # unscaled gradients
        else:
            assert not bool(all_finite(g))
    assert seen == [
        (16, 1, 0),
        (16, 2, 0),
        (16, 3, 0),
        (32, 0, 0),  # count (3) >= patience: grow, reset the count
        (32, 1, 0),
        (16, 0, 1),  # NaN/Inf: shrink, reset the count, one more reset
        (16, 1, 1),
        (8, 0, 2),
        (8, 1, 2),
        (8, 2, 2),
        (8, 3, 2),
        (16, 0, 2),
    ]


def _reference(patience, factor, scaler, flags, lo, hi):
    """The scaler rule written out in Python (jaxamp's timing, clamped to [lo, hi])."""
    count, resets, out = 0, 0, []
    for finite in flags:
        if not finite:
            scaler, count, resets = max(scaler / factor, min(scaler, lo)), 0, resets + 1
        elif count >= patience:
            scaler, count = min(scaler * factor, max(scaler, hi)), 0
        else:
            count += 1
        out.append((scaler, count, resets))
    return out


@settings(max_examples=40, deadline=None)
@given(
    patience=st.integers(0, 4),
    log2_scaler=st.integers(-2, 12),
    flags=st.lists(st.booleans(), min_size=1, max_size=24),
    log2_lo=st.integers(-4, 4),
    log2_span=st.integers(0, 10),
)
def test_update_state_matches_reference_model(patience, log2_scaler, flags, log2_lo, log2_span):
    lo, hi = 2.0**log2_lo, 2.0 ** (log2_lo + log2_span)
    update = jax.jit(lambda s, f: update_state(s, f, min_scaler=lo, max_scaler=hi))
    state = DynamicScalerState(
        patience=jnp.int32(patience),
        adjust_factor=jnp.float32(2.0),
        scaler=jnp.float32(2.0**log2_scaler),
        count=jnp.int32(0),
        total_resets=jnp.int32(0),
    )
    got = []
    for finite in flags:
        state = update(state, jnp.asarray(finite))
        got.append((float(state.scaler), int(state.count), int(state.total_resets)))
    assert got == _reference(patience, 2.0, 2.0**log2_scaler, flags, lo, hi)


def test_scaler_bounds(step):
    w = jnp.ones((4,))
    grad_fn = dynamic_scale_grad(_loss, filter=False, min_scaler=4.0, max_scaler=32.0)
    bounded = jax.jit(lambda w, x, state: grad_fn(w, x, dynamic_scaler_state=state))
    state = DynamicScalerState(scaler=16.0, patience=0)
    scalers = []
    for x in (BAD, BAD, BAD, GOOD, GOOD, GOOD, GOOD):
        state, _ = bounded(w, x, state)
        scalers.append(float(state.scaler))
    assert scalers == [8.0, 4.0, 4.0, 8.0, 16.0, 32.0, 32.0]  # clamped at both ends
    assert int(state.total_resets) == 3
    # the defaults are [1, 2**24]; min_scaler=0 removes the lower bound (jaxamp's behaviour)
    state = DynamicScalerState(scaler=1.0)
    state, _ = step(w, BAD, state)
    assert float(state.scaler) == 1.0
    unbounded = dynamic_scale_grad(_loss, filter=False, min_scaler=0.0, max_scaler=float("inf"))
    state, _ = unbounded(w, BAD, dynamic_scaler_state=state)
    assert float(state.scaler) == 0.5


@pytest.mark.parametrize("tx", ["grad", "value_and_grad"])
@pytest.mark.parametrize("use_filter", [True, False])
@pytest.mark.parametrize("aux", [True, False])
def test_float16_overflow_with_redo_counts_resets(tx, use_filter, aux):
    """x**3 at x=2 in float16 overflows for scalers above 2**12 (jaxamp's own scenario)."""
    transform = dynamic_scale_grad if tx == "grad" else dynamic_scale_value_and_grad

    def func(x):
        return (x**3, 1.0) if aux else x**3

    def grads(out):
        if tx == "value_and_grad":
            v, g = out
            if aux:
                v, a = v
                assert float(a) == 1.0
            assert float(v) == 8.0
            return g
        if aux:
            g, a = out
            assert float(a) == 1.0
            return g
        return out

    x = jnp.array(2.0, dtype=jnp.float16)
    grad_fn = jax.jit(transform(func, filter=use_filter, has_aux=aux, redo_on_nan=100))
    state, out = grad_fn(x, dynamic_scaler_state=DynamicScalerState(scaler=2**15, patience=2))
    assert float(grads(out)) == 12.0 and grads(out).dtype == jnp.float16
    # 2**15, 2**14, 2**13 overflow (three resets), 2**12 is finite (count 1)
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (2.0**12, 1, 3)
    state, _ = grad_fn(x, dynamic_scaler_state=state)
    assert (float(state.scaler), int(state.count)) == (2.0**12, 2)
    state, _ = grad_fn(x, dynamic_scaler_state=state)  # count 2 >= patience: grow
    assert (float(state.scaler), int(state.count)) == (2.0**13, 0)
    state, out = grad_fn(x, dynamic_scaler_state=state)  # 2**13 overflows, redo at 2**12
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (2.0**12, 1, 4)
    assert float(grads(out)) == 12.0

    grad_fn = jax.jit(transform(func, filter=use_filter, has_aux=aux, redo_on_nan=0))
    state = DynamicScalerState(scaler=2**15)
    for expected in (2.0**14, 2.0**13, 2.0**12):
        state, _ = grad_fn(x, dynamic_scaler_state=state)
        assert float(state.scaler) == expected and int(state.count) == 0
    state, out = grad_fn(x, dynamic_scaler_state=state)
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (2.0**12, 1, 3)
    assert float(grads(out)) == 12.0


def test_floating_scaler_keeps_its_dtype():
    grad_fn = dynamic_scale_grad(_loss, filter=False)
    state, g = grad_fn(jnp.ones(4), GOOD, dynamic_scaler_state=DynamicScalerState(scaler=jnp.bfloat16(64.0)))
    assert state.scaler.dtype == jnp.bfloat16 and state.adjust_factor.dtype == jnp.bfloat16
    assert state.count.dtype == jnp.int32 and g.dtype == jnp.float32


@settings(max_examples=25, deadline=None)
@given(log2_scaler=st.integers(-8, 20), seed=st.integers(0, 2**16))
def test_power_of_two_scaling_is_exact(log2_scaler, seed):
    """Scaling by 2**k and unscaling is exact in float32 away from overflow, so the grads are jax.grad's."""
    w = jax.random.normal(jax.random.key(seed), (5,))
    x = jax.random.normal(jax.random.key(seed + 1), (5,))
    state = DynamicScalerState(scaler=2.0**log2_scaler)
    _, (v, g) = dynamic_scale_value_and_grad(_loss, filter=False)(w, x, dynamic_scaler_state=state)
    v_ref, g_ref = jax.value_and_grad(_loss)(w, x)
    np.testing.assert_array_equal(g, g_ref)
    np.testing.assert_array_equal(v, v_ref)


# -- dynamic_scale_tx ----------------------------------------------------------------------------------
def test_dynamic_scale_tx_wraps_any_grad_transform():
    w, x = jnp.array([1.0, -2.0, 3.0]), jnp.array([0.5, 1.0, 2.0])
    vg = dynamic_scale_tx(jax.value_and_grad)(_loss)
    state, (v, g) = vg(w, x, dynamic_scaler_state=DynamicScalerState())
    v_ref, g_ref = jax.value_and_grad(_loss)(w, x)
    np.testing.assert_allclose(v, v_ref, rtol=1e-6)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)
    assert int(state.count) == 1
    # arguments after fun go to the transform; the default scale_fn scales the loss of a (loss, aux) pair
    g_fn = dynamic_scale_tx(jax.grad)(lambda w, x: (_loss(w, x), {"n": 3}), argnums=1, has_aux=True)
    state, (gx, aux) = g_fn(w, x, dynamic_scaler_state=state)
    np.testing.assert_allclose(gx, jax.grad(_loss, argnums=1)(w, x), rtol=1e-6)
    assert int(aux["n"]) == 3 and int(state.count) == 2


def test_dynamic_scale_tx_custom_scale_and_unscale_see_the_state():
    calls = []

    def scale_fn(loss, state):
        calls.append("scale")
        return loss * state.scaler

    def unscale_fn(grads, state):
        calls.append("unscale")
        return jax.tree.map(lambda g: g / state.scaler, grads)

    g_fn = dynamic_scale_tx(jax.grad, scale_fn=scale_fn, unscale_fn=unscale_fn)(_loss)
    _, g = g_fn(jnp.ones(3), jnp.ones(3), dynamic_scaler_state=DynamicScalerState(scaler=8.0))
    np.testing.assert_allclose(g, 2 * jnp.ones(3), rtol=1e-6)
    assert calls == ["scale", "unscale"]


def test_dynamic_scale_tx_checks_every_result_but_grad_variants_skip_aux():
    """jaxamp's tx checks all results (aux too); dynamic_scale_value_and_grad checks value and grads only."""

    def loss(w):
        return jnp.sum(w**2), jnp.nan

    state = DynamicScalerState(scaler=8.0)
    tx_state, _ = dynamic_scale_tx(jax.value_and_grad)(loss, has_aux=True)(jnp.ones(2), dynamic_scaler_state=state)
    assert (float(tx_state.scaler), int(tx_state.total_resets)) == (4.0, 1)
    vg = dynamic_scale_value_and_grad(loss, has_aux=True, filter=False, redo_on_nan=0)
    vg_state, _ = vg(jnp.ones(2), dynamic_scaler_state=state)
    assert (float(vg_state.scaler), int(vg_state.count), int(vg_state.total_resets)) == (8.0, 1, 0)


def test_dynamic_scale_tx_drives_an_optax_training_loop():
    """Least squares with optax.sgd: the scaled loop follows the unscaled one step for step."""
    key_w, key_x = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (32, 4))
    y = x @ jnp.array([1.0, -2.0, 0.5, 3.0])
    w0 = jax.random.normal(key_w, (4,))

    def mse(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    opt = optax.sgd(0.1)
    scaled_vg = dynamic_scale_tx(jax.value_and_grad, redo_on_nan=2)(mse)

    @jax.jit
    def scaled_step(w, opt_state, scaler_state):
        scaler_state, (loss, g) = scaled_vg(w, x, y, dynamic_scaler_state=scaler_state)
        updates, opt_state = opt.update(g, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, scaler_state, loss

    @jax.jit
    def plain_step(w, opt_state):
        loss, g = jax.value_and_grad(mse)(w, x, y)
        updates, opt_state = opt.update(g, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, loss

    w, opt_state, scaler_state = w0, opt.init(w0), DynamicScalerState(patience=5, scaler=2.0**10)
    w_ref, ref_state = w0, opt.init(w0)
    losses = []
    for _ in range(20):
        w, opt_state, scaler_state, loss = scaled_step(w, opt_state, scaler_state)
        w_ref, ref_state, _ = plain_step(w_ref, ref_state)
        losses.append(float(loss))
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    assert losses[-1] < 1e-2 * losses[0]
    # 20 finite steps with patience 5: the scaler grew on steps 6, 12 and 18
    assert (float(scaler_state.scaler), int(scaler_state.count), int(scaler_state.total_resets)) == (2.0**13, 2, 0)


# -- plumbing --------------------------------------------------------------------------------------------
def test_kwargs_forwarded_and_pytree_params():
    def loss(params, x, *, offset):
        return jnp.sum((params["w"] * x + params["b"] - offset) ** 2)

    params = {"w": jnp.ones((3,)), "b": jnp.zeros((3,))}
    fn = dynamic_scale_value_and_grad(loss, filter=False, argnums=1)
    state, (v, g) = fn(params, jnp.ones((3,)), offset=0.5, dynamic_scaler_state=DynamicScalerState())
    np.testing.assert_allclose(g, 2 * (1.0 - 0.5) * jnp.ones(3), rtol=1e-6)
    np.testing.assert_allclose(v, 0.75, rtol=1e-6)
    state, (v, g) = dynamic_scale_value_and_grad(loss)(
        params, jnp.ones((3,)), offset=0.5, dynamic_scaler_state=DynamicScalerState()
    )
    assert int(state.count) == 1
    np.testing.assert_allclose(g["w"], jnp.ones(3), rtol=1e-6)


def test_with_optax_apply_if_finite_skips_bad_steps():
    opt = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5)
    w = jnp.ones((4,))
    opt_state = opt.init(w)
    grad_fn = dynamic_scale_grad(_loss, redo_on_nan=0)

    @jax.jit
    def train_step(w, x, opt_state, scaler_state):
        scaler_state, g = grad_fn(w, x, dynamic_scaler_state=scaler_state)
        updates, opt_state = opt.update(g, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, scaler_state

    scaler_state = DynamicScalerState()
    w1, opt_state, scaler_state = train_step(w, jnp.array([1.0, jnp.nan, 1.0, 1.0]), opt_state, scaler_state)
    np.testing.assert_array_equal(w1, w)  # the non-finite step is skipped
    assert float(scaler_state.scaler) == 2.0**14 and int(scaler_state.total_resets) == 1
    w2, opt_state, scaler_state = train_step(w1, jnp.ones((4,)), opt_state, scaler_state)
    assert np.all(w2 < w1)
