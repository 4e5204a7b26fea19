"""End-to-end: jaxamp's README training loop, and loss scaling rescuing float16 underflow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scalify.amp as jaxamp  # the only change a jaxamp user makes


def _data(key, n=256, d=16, classes=4):
    kx, kt = jax.random.split(key)
    x = jax.random.normal(kx, (n, d))
    teacher = jax.random.normal(kt, (d, classes))
    return x, jnp.argmax(x @ teacher, axis=-1)


def _init(key, d=16, hidden=32, classes=4):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d, hidden)) / jnp.sqrt(d),
        "w2": jax.random.normal(k2, (hidden, classes)) / jnp.sqrt(hidden),
    }


def _logits(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


# -- jaxamp's README loop, verbatim except for the import (and the README's own typos fixed) --------
def loss_fn(model_state, minibatch):
    x, y = minibatch
    logits = _logits(model_state, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    return loss, accuracy


def train_step(model_state, opt_state, minibatch, dynamic_scaler_state, optimizer):
    amp_loss_fn = jaxamp.amp(loss_fn)
    value_and_grad_fn = jaxamp.dynamic_scale_value_and_grad(amp_loss_fn, has_aux=True)
    dynamic_scaler_state, ((loss, accuracy), grads) = value_and_grad_fn(
        model_state, minibatch, dynamic_scaler_state=dynamic_scaler_state
    )
    updates, opt_state = optimizer.update(grads, opt_state, model_state)
    model_state = optax.apply_updates(model_state, updates)
    return model_state, opt_state, dynamic_scaler_state, loss, accuracy


def train_loop(model_state, opt_state, optimizer, dataloader):
    train_step_jit = jax.jit(train_step, static_argnums=4)
    dynamic_scaler_state = jaxamp.DynamicScalerState()
    losses = []
    for minibatch in dataloader:
        model_state, opt_state, dynamic_scaler_state, loss, accuracy = train_step_jit(
            model_state, opt_state, minibatch, dynamic_scaler_state, optimizer
        )
        losses.append(float(loss))
        assert 0.0 <= float(accuracy) <= 1.0  # the README logs it
    return model_state, opt_state, losses, dynamic_scaler_state


def test_jaxamp_readme_training_loop_loss_decreases():
    x, y = _data(jax.random.key(0))
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)] * 10
    params = _init(jax.random.key(1))
    optimizer = optax.adam(1e-2)
    # optax.adam's bias correction (float ** int32 count) needs standard promotion; the suite runs strict
    with jax.numpy_dtype_promotion("standard"):
        params, _, losses, scaler_state = train_loop(params, optimizer.init(params), optimizer, batches)
    assert all(np.isfinite(losses))
    assert np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4])
    assert params["w1"].dtype == jnp.float32
    assert float(scaler_state.scaler) == 2.0**15 and int(scaler_state.count) == len(batches)


# -- float16 underflow: plain amp stalls, amp + dynamic loss scaling tracks float32 ------------------
TINY = 2.0**-20  # scales the loss so that its float16 cotangents underflow (~4e-9 < 6e-8)
LR = 0.5 / TINY  # SGD on TINY * loss with LR is SGD on loss with lr 0.5 (exact in float32)


def _train(mode, steps=60):
    x, y = _data(jax.random.key(2))
    params = _init(jax.random.key(3))
    opt = optax.sgd(LR)
    opt_state = opt.init(params)

    def tiny_loss(p, x, y):
        return TINY * optax.softmax_cross_entropy_with_integer_labels(_logits(p, x), y).mean()

    if mode == "float32":
        grad_fn = lambda p, s: (s, jax.grad(tiny_loss)(p, x, y))
    elif mode == "float16":
        grad_fn = lambda p, s: (s, jax.grad(jaxamp.amp(tiny_loss))(p, x, y))
    else:
        scaled = jaxamp.dynamic_scale_grad(jaxamp.amp(tiny_loss))
        grad_fn = lambda p, s: scaled(p, x, y, dynamic_scaler_state=s)

    @jax.jit
    def step(params, opt_state, scaler_state):
        scaler_state, grads = grad_fn(params, scaler_state)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scaler_state, grads

    scaler_state = jaxamp.DynamicScalerState()
    for _ in range(steps):
        params, opt_state, scaler_state, grads = step(params, opt_state, scaler_state)
    loss = optax.softmax_cross_entropy_with_integer_labels(_logits(params, x), y).mean()
    acc = jnp.mean(jnp.argmax(_logits(params, x), -1) == y)
    return float(loss), float(acc), grads


def test_float16_underflow_stalls_without_loss_scaling_and_dynamic_scaling_tracks_float32():
    x, y = _data(jax.random.key(2))
    init_loss = float(optax.softmax_cross_entropy_with_integer_labels(_logits(_init(jax.random.key(3)), x), y).mean())
    loss32, acc32, _ = _train("float32")
    loss16, acc16, grads16 = _train("float16")
    loss_amp, acc_amp, grads_amp = _train("amp+scaling")
    # float32 learns
    assert loss32 < 0.5 * init_loss and acc32 > 0.85
    # plain float16 (amp, no loss scaling): every gradient underflows to zero, training stalls
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads16))
    assert abs(loss16 - init_loss) < 1e-6 and acc16 < acc32 - 0.3
    # amp with dynamic loss scaling tracks float32
    assert all(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(grads_amp))
    assert abs(loss_amp - loss32) < 0.02 * loss32
    assert abs(acc_amp - acc32) <= 0.02
