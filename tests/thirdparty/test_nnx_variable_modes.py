"""flax NNX's other ways of holding state, under scalify, amp and recipes.apply.

flax 0.12 lets a program choose how its Variables live, and NNX's own guide ("NNX Basics") shows
each of them:

* **tree mode** (``nnx.graphlib.set_graph_mode(False)``, the guide's setting): ``nnx.split``
  refuses a Variable shared by two modules unless it is called with ``graph=True``, as a program
  asks for with ``nnx.jit(graph=True)``;
* **ref Variables** (``nnx.var_defaults(ref=True)``): each value is a ``jax.ref`` mutable array,
  updated in place under plain ``jax.jit``;
* **hijax Variables** (``nnx.var_defaults(hijax=True)``, experimental in JAX and flax): each
  Variable is a ``jax.experimental.hijax`` type, a JAX leaf of its own; plain ``jax.jit`` carries
  its updates out, and a loss may capture it and update it under ``jax.grad``.

Each step below is written as those programs are, and runs under the transformation unchanged. The
reference is the same step in float32 on the dequantized parameters under ``jax.jit`` / ``nnx.jit``,
compared within the third-party harness's tolerance (float32 propagation error, far below any
format's rounding: ``thirdparty_harness.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import assert_tree_close, dequantize_tree, make_optimizer

import qformats as qf
import scalify
from scalify import recipes

pytest.importorskip("flax", reason="flax is not installed (pip install -e '.[test]')")
from flax import nnx

FORMATS = ["mxfp8", "int8_per_channel"]
HIGH = recipes.Recipe.uniform("high", None)


class Count(nnx.Variable):
    """A step counter the model increments when called (the guide's custom Variable type)."""


class Dense(nnx.Pytree):
    """``x @ w + b`` that counts its calls in place."""

    def __init__(self, din, dout, rngs):
        self.w = nnx.Param(jax.random.normal(rngs(), (din, dout)) / din**0.5)
        self.b = nnx.Param(jnp.zeros((dout,)))
        self.count = Count(jnp.array(0))

    def __call__(self, x):
        self.count[...] += 1
        return x @ self.w + self.b


class MLP(nnx.Pytree):
    def __init__(self, rngs):
        self.fc1 = Dense(64, 64, rngs)
        self.fc2 = Dense(64, 32, rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def _batch():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 64)), rng.standard_normal((32, 32))
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def _objects(**var_defaults):
    """A fresh (model, optimizer), the same every call; the optimizer is built on float32."""
    with nnx.var_defaults(**{"hijax": False, "ref": False, **var_defaults}):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, make_optimizer(), wrt=nnx.Param)
    return model, optimizer


def _quantize_kernels(model, fmt):
    """The two kernels in ``fmt`` (the reference gets their dequantized values)."""
    for layer in (model.fc1, model.fc2):
        layer.w.set_value(scalify.as_scaled_array(layer.w.get_value(), fmt=fmt))


def _dequantize_kernels(model, like):
    for layer, q in ((model.fc1, like.fc1), (model.fc2, like.fc2)):
        layer.w.set_value(q.w.get_value().to_array(jnp.float32))


def _values(*objects):
    """The Variables' values of ``objects`` as a plain pytree (hijax Variables read out)."""
    return jax.tree.map(
        lambda v: v.get_value(), nnx.state(objects, graph=True), is_leaf=lambda v: isinstance(v, nnx.Variable)
    )


def hijax_step(model, optimizer, x, y):
    """The guide's hijax training step: plain jax.grad over plain copies of the parameters, the
    rest (the counters) captured by the loss and updated inside it."""
    graphdef, params, nondiff = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        model = nnx.merge(graphdef, params, nondiff)
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(nnx.with_vars(params, hijax=False))
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_hijax_step_under_jax_jit(fmt_name):
    """Was: the ScaledArray inside a hijax Variable reached scalify as a constant, and the model's
    ``x @ w`` failed with "ScaledArray has no arithmetic outside scalify"."""
    fmt = qf.get_format(fmt_name)
    (model, optimizer), (ref_model, ref_optimizer) = _objects(hijax=True), _objects(hijax=True)
    _quantize_kernels(model, fmt)
    _dequantize_kernels(ref_model, model)
    x, y = _batch()
    ref_loss = jax.jit(hijax_step)(ref_model, ref_optimizer, x, y)
    loss = jax.jit(scalify.scalify(hijax_step))(model, optimizer, x, y)
    assert int(optimizer.step[...]) == 1 and int(model.fc1.count[...]) == 1  # updated in place
    assert isinstance(model.fc1.w.get_value(), scalify.ScaledArray)
    assert model.fc1.w.hijax  # still the caller's hijax Variable
    assert_tree_close(loss, ref_loss, fmt, "loss")
    assert_tree_close(_values(model, optimizer), _values(ref_model, ref_optimizer), fmt, "model and optimizer")


def test_hijax_variable_passed_alone():
    """A hijax Variable argument (not inside a module) is written back too, as jax.jit does."""
    value = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64)), jnp.float32)
    v = nnx.Param(scalify.as_scaled_array(value, fmt=qf.MXFP8), hijax=True)
    expected = 2 * v.get_value().to_array(jnp.float32) + 1

    def inc(v):
        v[...] = v[...] * 2 + 1

    assert jax.jit(scalify.scalify(inc))(v) is None
    got = v.get_value()
    assert isinstance(got, scalify.ScaledArray)
    np.testing.assert_allclose(np.asarray(got.to_array(jnp.float32)), np.asarray(expected), rtol=1e-6)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_shared_variable_in_tree_mode(fmt_name):
    """The guide's graph-mode example: one Param under two names, in tree mode, under
    ``nnx.jit(graph=True)``. Was: scalify's lifting split the modules in flax's default (tree) mode,
    which refuses the shared Param ("Duplicate Param found at paths [0].a, [0].b")."""
    fmt = qf.get_format(fmt_name)

    class Tied(nnx.Module):
        def __init__(self, p):
            self.a, self.b = p, p

    def forward(model, x):
        model.a[...] = model.a[...] + 1.0  # through one name...
        return model.a * x + model.b  # ...read through both

    rng = np.random.default_rng(2)
    value = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    with nnx.graphlib.set_graph_mode(False):
        got = Tied(nnx.Param(scalify.as_scaled_array(value, fmt=fmt)))
        expected = Tied(nnx.Param(got.a.get_value().to_array(jnp.float32)))
        out = nnx.jit(scalify.scalify(forward), graph=True)(got, x)
        ref = nnx.jit(forward, graph=True)(expected, x)
    assert got.a is got.b
    assert_tree_close(dequantize_tree(out), ref, fmt, "output")
    assert_tree_close(dequantize_tree(got.a.get_value()), expected.a.get_value(), fmt, "the shared Param")


def ref_step(model, optimizer, x, y):
    """A step on ref Variables: jax.grad over plain copies, the update written into the refs."""
    graphdef, params, nondiff = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        return jnp.mean((nnx.merge(graphdef, params, nondiff)(x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(nnx.with_vars(params, ref=False))
    optimizer.update(model, grads)
    return loss


TRANSFORMS = {
    "scalify": scalify.scalify,
    "amp-empty-policy": lambda f: scalify.amp.amp(f, amp_policy={}),
    "recipes.apply-high": lambda f: recipes.apply(f, HIGH),
}


@pytest.mark.parametrize("mode", ["ref", "hijax"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_float32_step_is_unchanged(mode, name):
    """On float32 parameters these transformations change nothing: the step equals the plain one
    (to float32 rounding). Was (ref mode): RecursionError, flax counts a mutable array as a graph
    node, so the lifting lifted its own state again."""
    transform = TRANSFORMS[name]
    step = ref_step if mode == "ref" else hijax_step
    (model, optimizer), (ref_model, ref_optimizer) = _objects(**{mode: True}), _objects(**{mode: True})
    x, y = _batch()
    ref_loss = jax.jit(step)(ref_model, ref_optimizer, x, y)
    loss = jax.jit(transform(step))(model, optimizer, x, y)
    assert int(optimizer.step[...]) == 1
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    got, want = _values(model, optimizer), _values(ref_model, ref_optimizer)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7), got, want)


@pytest.mark.parametrize("mode", ["ref", "hijax"])
def test_mxfp8_recipe_step_matches_ordinary_variables(mode):
    """The MXFP8 recipe on a ref or hijax model gives the step it gives on ordinary Variables under
    nnx.jit (same quantized GEMMs), and that step is not float32's (the recipe ran)."""
    step = ref_step if mode == "ref" else hijax_step
    (model, optimizer), (plain_model, plain_optimizer) = _objects(**{mode: True}), _objects()
    (f32_model, f32_optimizer) = _objects(**{mode: True})
    x, y = _batch()

    def plain_step(model, optimizer, x, y):  # the same step as ordinary NNX code writes it
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    loss = jax.jit(recipes.apply(step, recipes.MXFP8))(model, optimizer, x, y)
    plain_loss = nnx.jit(recipes.apply(plain_step, recipes.MXFP8))(plain_model, plain_optimizer, x, y)
    f32_loss = jax.jit(step)(f32_model, f32_optimizer, x, y)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    got, want = _values(model, optimizer), _values(plain_model, plain_optimizer)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), got, want)
    assert abs(float(loss) - float(f32_loss)) > 1e-4 * abs(float(f32_loss))


@pytest.mark.parametrize(
    "transform",
    [lambda f: scalify.amp.amp(f, amp_policy={}), lambda f: recipes.apply(f, recipes.MXFP8)],
    ids=["amp-empty-policy", "recipes.apply-mxfp8"],
)
def test_captured_hijax_variable(transform):
    """A function that captures a hijax Variable (the guide: "Variables can also be passed as
    captures") gives what it gives with the value captured as an array. Was: amp cast the Variable
    operand of flax's read equation to a dtype of None ("dtype must be specified")."""
    rng = np.random.default_rng(3)
    value = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)
    w = nnx.Param(value, hijax=True)
    x = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32)

    def f(x):
        return jnp.tanh(x @ w[...])

    def f_array(x):
        return jnp.tanh(x @ value)

    np.testing.assert_allclose(jax.jit(transform(f))(x), jax.jit(transform(f_array))(x), rtol=1e-6, atol=1e-7)


def nnx_step(model, optimizer, x, y):
    """The same step as ordinary NNX code writes it (``nnx.value_and_grad`` over the module)."""
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("mode", ["plain", "ref", "hijax"])
def test_quantized_batch_into_a_float32_model(mode):
    """A float32 model trained on an MXFP8 batch, in each mode's own way (ordinary Variables under
    ``nnx.jit``, ref and hijax Variables under ``jax.jit``). Was: the lifting flattened the other
    arguments into ScaledArray's data and scale, so the model received an untraced ScaledArray
    (TracerArrayConversionError in flax's dtype promotion); with ref Variables, the optimizer's
    write of the new float32 parameters into their refs was refused (a carrier is now stored as
    its value). The reference is the float32 step on the dequantized batch."""
    fmt = qf.MXFP8
    jit, step, defaults = {
        "plain": (nnx.jit, nnx_step, {}),
        "ref": (jax.jit, ref_step, {"ref": True}),
        "hijax": (jax.jit, hijax_step, {"hijax": True}),
    }[mode]
    (model, optimizer), (ref_model, ref_optimizer) = _objects(**defaults), _objects(**defaults)
    x, y = _batch()
    qx = scalify.as_scaled_array(x, fmt=fmt)
    loss = jit(scalify.scalify(step))(model, optimizer, qx, y)
    ref_loss = jit(step)(ref_model, ref_optimizer, qx.to_array(jnp.float32), y)
    assert int(optimizer.step[...]) == 1
    assert_tree_close(dequantize_tree(loss), ref_loss, fmt, "loss")
    got = dequantize_tree(_values(model, optimizer))
    assert_tree_close(got, _values(ref_model, ref_optimizer), fmt, "model and optimizer")
