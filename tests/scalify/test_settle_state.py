"""scalify.tree.settle_state: the initial state in the layout the scalified step returns, so that the
jitted step compiles once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scalify

LR, MOMENTUM = 0.05, 0.9  # Python floats: weakly typed, so they keep the float16 dtype


def _loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


TRACES = [0]  # Python runs the step's body once per trace: a count that no cache policy hides


def _train_step(p, m, x, y):
    """SGD with momentum: the momentum is state the step returns beside the parameters."""
    TRACES[0] += 1
    loss, g = jax.value_and_grad(_loss)(p, x, y)
    m = jax.tree.map(lambda mi, gi: MOMENTUM * mi + gi, m, g)
    p = jax.tree.map(lambda pi, mi: pi - LR * mi, p, m)
    return p, m, loss


def _problem(dtype=jnp.float16):
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 32)) / 4, dtype),
        "b1": jnp.zeros((32,), dtype),
        "w2": jnp.asarray(rng.normal(size=(32, 4)) / 6, dtype),
    }
    x = scalify.as_scaled_array(jnp.asarray(rng.normal(size=(8, 16)), dtype))
    y = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    return scalify.as_scaled_array(params), x, y


def _run(step, state, x, y, n=4):
    losses = []
    for _ in range(n):
        *state, loss = step(*state, x, y)
        losses.append(float(scalify.asarray(loss)))
    return state, losses


@pytest.mark.parametrize("settle", [False, True], ids=["as-built", "settled"])
@pytest.mark.parametrize("zeros", ["scalified", "plain"])
def test_settled_state_compiles_the_step_once(settle, zeros):
    params, x, y = _problem()
    if zeros == "scalified":  # the state as a scalified optimizer init builds it
        momentum = scalify.scalify(lambda p: jax.tree.map(jnp.zeros_like, p))(params)
    else:  # plain zeros: the step returns ScaledArrays in their place
        momentum = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params, is_leaf=scalify.is_scaled_leaf)
    step = jax.jit(scalify.scalify(_train_step))
    state = (params, momentum)
    ref = _run(jax.jit(scalify.scalify(_train_step)), state, x, y)[1]
    if settle:
        state = scalify.tree.settle_state(step, state, x, y)
    # Traces during the training loop (a trace settle_state made for the settled layout may be
    # reused: then the loop traces nothing). ``_cache_size()`` is not used: it counts only the
    # C++ fast path's entries, which another test's leftover state can leave empty.
    TRACES[0] = 0
    _, losses = _run(step, state, x, y)
    if settle:
        assert TRACES[0] <= 1
        np.testing.assert_allclose(losses, ref, rtol=1e-6)  # same values: the same training
    else:
        assert TRACES[0] > 1  # what settle_state is for


def test_settled_zero_state_leaves_the_first_gradient_its_scale():
    params, x, y = _problem()
    momentum = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params, is_leaf=scalify.is_scaled_leaf)
    step = jax.jit(scalify.scalify(_train_step))
    _, m = scalify.tree.settle_state(step, (params, momentum), x, y)
    for leaf in scalify.tree.leaves(m):
        assert isinstance(leaf, scalify.ScaledArray)
        assert float(leaf.scale) == 2.0**-100 and not np.any(np.asarray(leaf.data))


def test_settle_state_rejects_a_step_that_returns_another_structure():
    params, x, y = _problem()
    with pytest.raises(ValueError, match="another pytree structure"):
        scalify.tree.settle_state(lambda p, x, y: ([p],), (params,), x, y)
