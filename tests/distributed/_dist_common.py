"""Shared pieces of the distributed tests: the 2x4 mesh and a small MLP training step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import scalify as jsa
import scalify._rules_collectives

D_IN, D_HID, D_OUT, BATCH = 64, 128, 64, 16


def mesh_2x4():
    return jax.make_mesh((2, 4), ("d", "m"), axis_types=(AxisType.Auto, AxisType.Auto))


def mlp_data(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": (rng.normal(size=(D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32),
        "w2": (rng.normal(size=(D_HID, D_OUT)) / np.sqrt(D_HID)).astype(np.float32),
    }
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
    return params, x, y


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"])
    out = h @ params["w2"]
    return jnp.mean((out - y) ** 2)


def train_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    new = jax.tree.map(lambda w, g: w - 0.5 * g, params, grads)
    return new, loss


def scaled_params(params, fmt):
    if fmt is None:
        return {k: jsa.as_scaled_array(jnp.asarray(v), scale=np.float32(0.25)) for k, v in params.items()}
    return {k: jsa.as_scaled_array(jnp.asarray(v), fmt=fmt) for k, v in params.items()}


def values(tree):
    return jax.tree.map(
        lambda v: np.asarray(v.to_array(jnp.float32)) if isinstance(v, jsa.ScaledArray) else np.asarray(v),
        tree,
        is_leaf=jsa.is_scaled_leaf,
    )


def named(mesh, spec):
    return NamedSharding(mesh, spec)


DP_SPECS = {"params": P(), "x": P(("d", "m")), "y": P(("d", "m"))}
TP_SPECS = {"params": {"w1": P(None, "m"), "w2": P("m", None)}, "x": P("d"), "y": P("d")}
