"""Dynamic loss scaling: DynamicScalerState, dynamic_scale_grad, dynamic_scale_value_and_grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scalify.amp import DynamicScalerState, all_finite, dynamic_scale_grad, dynamic_scale_value_and_grad


def test_state_defaults_dtypes_and_pytree_roundtrip():
    s = DynamicScalerState()
    assert int(s.patience) == 2000 and float(s.adjust_factor) == 2.0
    assert float(s.scaler) == 2.0**15 and s.scaler.dtype == jnp.float32 and int(s.count) == 0
    assert float(s.min_scaler) == 1.0 and float(s.max_scaler) == 2.0**24
    s = DynamicScalerState(scaler=2**10, patience=5, min_scaler=4.0, max_scaler=2.0**12)
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 6
    back = jax.tree.unflatten(treedef, leaves)
    assert float(back.min_scaler) == 4.0 and float(back.max_scaler) == 2.0**12
    through_jit = jax.jit(lambda st: st)(s)
    assert isinstance(through_jit, DynamicScalerState)
    assert float(through_jit.min_scaler) == 4.0 and float(through_jit.max_scaler) == 2.0**12
    mapped = jax.tree.map(lambda x: x, s)
    assert float(mapped.min_scaler) == 4.0
    assert float(s.replace(scaler=8.0).scaler) == 8.0 and float(s._replace(count=3).count) == 3
    with pytest.raises(AttributeError):
        s.scaler = 1.0


def _loss(w, x):
    return jnp.sum((x * w) ** 2)


@pytest.fixture(scope="module")
def step():
    grad_fn = dynamic_scale_grad(_loss, filter=False)
    return jax.jit(lambda w, x, state: grad_fn(w, x, dynamic_scaler_state=state))


def test_scaler_halves_on_inf_and_never_below_min_under_jit(step):
    w = jnp.ones((4,), jnp.float32)
    good, bad = jnp.ones((4,)), jnp.array([1.0, jnp.inf, 1.0, 1.0])
    state = DynamicScalerState(scaler=2.0**4, patience=3, min_scaler=2.0**2)
    state, g = step(w, good, state)
    assert int(state.count) == 1 and float(state.scaler) == 2.0**4
    np.testing.assert_allclose(g, 2 * w, rtol=1e-6)  # unscaled gradients
    state, g = step(w, bad, state)
    assert not bool(all_finite(g))
    assert float(state.scaler) == 2.0**3 and int(state.count) == 0  # halved, count reset
    for expected in (2.0**2, 2.0**2, 2.0**2):
        state, _ = step(w, bad, state)
        assert float(state.scaler) == expected  # clamped at min_scaler


def test_scaler_doubles_after_patience_good_steps_and_respects_max(step):
    w, x = jnp.ones((4,)), jnp.ones((4,))
    state = DynamicScalerState(scaler=2.0**4, patience=3, max_scaler=2.0**5)
    scalers, counts = [], []
    for _ in range(7):
        state, _ = step(w, x, state)
        scalers.append(float(state.scaler))
        counts.append(int(state.count))
    assert scalers == [16.0, 16.0, 32.0, 32.0, 32.0, 32.0, 32.0]  # doubled on the 3rd good step, then capped
    assert counts == [1, 2, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("tx", ["grad", "value_and_grad"])
@pytest.mark.parametrize("use_filter", [True, False])
@pytest.mark.parametrize("aux", [True, False])
def test_jaxamp_float16_overflow_with_redo(tx, use_filter, aux):
    """jaxamp's own test: x**3 at x=2 in float16 overflows for scalers above 2**12."""
    transform = dynamic_scale_grad if tx == "grad" else dynamic_scale_value_and_grad

    def func(x):
        return (x**3, 1.0) if aux else x**3

    def unpack(out):
        if tx == "value_and_grad":
            (v, g) = out
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
    state, out = grad_fn(x, dynamic_scaler_state=DynamicScalerState(scaler=2**15, patience=10))
    assert float(unpack(out)) == 12.0 and unpack(out).dtype == jnp.float16
    assert float(state.scaler) == 2.0**12 and int(state.count) == 1  # 2**15 -> 2**12, then one good step

    grad_fn = jax.jit(transform(func, filter=use_filter, has_aux=aux, redo_on_nan=0))
    state = DynamicScalerState(scaler=2**15)
    for expected in (2.0**14, 2.0**13, 2.0**12):
        state, _ = grad_fn(x, dynamic_scaler_state=state)
        assert float(state.scaler) == expected and int(state.count) == 0
    state, out = grad_fn(x, dynamic_scaler_state=state)
    assert float(state.scaler) == 2.0**12 and int(state.count) == 1 and float(unpack(out)) == 12.0


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
    assert float(scaler_state.scaler) == 2.0**14
    w2, opt_state, scaler_state = train_step(w1, jnp.ones((4,)), opt_state, scaler_state)
    assert np.all(w2 < w1)
