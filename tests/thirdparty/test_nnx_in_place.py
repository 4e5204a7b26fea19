"""flax NNX steps that update their arguments in place, under scalify, amp and recipes.apply.

An NNX training step changes its model, optimizer, metrics and Rngs in place and returns nothing
(flax's mnist example, the gemma example's ``nnx_train_step``); ``nnx.jit`` carries the updates out.
scalify's transformations trace on copies of their arguments, so without lifting the updates stayed
on the copies and the model silently did not train (the optimizer's step stayed 0). The reference is
the same step under ``nnx.jit`` in float32 on the dequantized parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import assert_tree_close, dequantize_tree, make_optimizer, n_scaled, quantize_tree

import qformats as qf
import scalify

pytest.importorskip("flax", reason="flax is not installed (pip install -e '.[test]')")
from flax import nnx


class Net(nnx.Module):
    """Linear, BatchNorm (running statistics updated in place), Dropout (an Rngs stream), Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(64, 64, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.fc2 = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x)))))


def train_step(model, optimizer, metrics, x, labels):
    """The shape of flax's mnist step: value_and_grad over the module, in-place updates, no return."""

    def loss_fn(model):
        logits = model(x)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0]), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    metrics.update(loss=loss, logits=logits, labels=labels)
    optimizer.update(model, grads)


def _objects():
    """Fresh (model, optimizer, metrics), the same every call (seeded)."""
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_optimizer(), wrt=nnx.Param)  # on float32 (docs/examples.md)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def _pair(fmt):
    got, expected = _objects(), _objects()
    qparams = quantize_tree(nnx.state(got[0], nnx.Param), fmt)
    assert n_scaled(qparams) == 2
    nnx.update(got[0], qparams)
    nnx.update(expected[0], dequantize_tree(qparams))
    return got, expected


def _batch():
    rng = np.random.default_rng(0)
    # 32 rows: the MXFP8 recipe blocks the weight gradient's operands along the batch.
    return jnp.asarray(rng.standard_normal((32, 64)), jnp.float32), jnp.asarray(rng.integers(0, 32, 32), jnp.int32)


@pytest.mark.parametrize("fmt_name", ["mxfp8", "int8_per_channel", "fp8_e4m3"])
def test_in_place_updates_reach_the_caller(fmt_name):
    """The step as flax's mnist example runs it, under ``nnx.jit``. (Eager calls take the same
    lifting path, one equation at a time: ``test_a_module_passed_twice_stays_one_module``.)"""
    fmt = qf.get_format(fmt_name)
    (got, expected), (x, labels) = _pair(fmt), _batch()
    assert nnx.jit(train_step)(*expected, x, labels) is None
    assert nnx.jit(scalify.scalify(train_step))(*got, x, labels) is None
    model, optimizer, _ = got
    assert int(optimizer.step[...]) == 1  # was 0: the update stayed on scalify's copies
    assert isinstance(model.fc1.kernel.get_value(), scalify.ScaledArray)  # stored back in the format
    assert_tree_close(nnx.state(got), nnx.state(expected), fmt, "model, optimizer and metrics after the step")


@pytest.mark.parametrize("fmt_name", ["mxfp8", "nvfp4"])
def test_dequantize_outputs_leaves_the_modules_state_in_its_format(fmt_name):
    """``scalify(step, dequantize_outputs=True)`` returns the step's logits as plain float32, while
    the module it updates in place keeps its kernel scaled (the option is about what the step
    returns, not about the state written back), and both equal the float32 step's."""
    fmt = qf.get_format(fmt_name)
    (got, expected), (x, labels) = _pair(fmt), _batch()

    def step(model, optimizer, metrics, x, labels):
        train_step(model, optimizer, metrics, x, labels)
        return model(x)

    want = nnx.jit(step)(*expected, x, labels)
    logits = nnx.jit(scalify.scalify(step, dequantize_outputs=True))(*got, x, labels)
    assert isinstance(logits, jax.Array) and logits.dtype == jnp.float32
    # Still scaled (the updated kernel is a carrier, as without the option), not dequantized.
    assert isinstance(got[0].fc1.kernel.get_value(), scalify.ScaledArray)
    assert_tree_close(logits, want, fmt, "logits returned plain")
    assert_tree_close(nnx.state(got), nnx.state(expected), fmt, "model, optimizer and metrics after the step")


def test_a_module_passed_twice_stays_one_module():
    """The graph nodes among the arguments are split together, so aliases survive the lifting."""
    model = Net(nnx.Rngs(0))
    model.fc1.kernel.set_value(scalify.as_scaled_array(model.fc1.kernel.get_value(), fmt=qf.MXFP8))

    def step(a, b):
        b.bn.mean[...] = b.bn.mean[...] + 1.0  # written through one argument...
        return a.bn.mean[...], a.fc1.kernel.get_value() * 2  # ...read through the other

    mean, kernel2 = scalify.scalify(step)(model, model)  # eager: jax.jit would drop the write itself
    np.testing.assert_array_equal(np.asarray(mean), np.ones(64, np.float32))
    np.testing.assert_array_equal(np.asarray(model.bn.mean[...]), np.ones(64, np.float32))
    kernel = model.fc1.kernel.get_value()
    np.testing.assert_array_equal(np.asarray(kernel2.to_array()), 2 * np.asarray(kernel.to_array()))


@pytest.mark.parametrize(
    "transform, exact",
    [
        (lambda f: scalify.amp.amp(f, amp_policy={}), True),
        (lambda f: scalify.recipes.apply(f, scalify.recipes.MXFP8), False),
    ],
    ids=["amp", "recipes.apply"],
)
def test_batchnorm_statistics_updated_inside_a_transformed_loss(transform, exact):
    """amp and recipes.apply wrap the loss under ``nnx.value_and_grad``: BatchNorm's running statistics,
    written there, must reach the model. amp with an empty policy changes nothing, so its statistics
    equal the plain step's exactly; under the MXFP8 recipe they equal those of fc1's output computed
    with the recipe's quantized operands."""
    x, _ = _batch()
    model = Net(nnx.Rngs(0))

    def loss(model):
        return jnp.sum(model(x) ** 2)

    plain = Net(nnx.Rngs(0))
    nnx.value_and_grad(loss)(plain)
    nnx.value_and_grad(transform(loss))(model)
    got, want = np.asarray(model.bn.mean[...]), np.asarray(plain.bn.mean[...])
    assert np.abs(got).max() > 0  # updated (it starts at zero)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        # Each element of fc1's output is an MXFP8-quantized dot: within a few element roundings.
        np.testing.assert_allclose(got, want, rtol=0, atol=0.1 * np.abs(want).max())


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.fc = nnx.Linear(64, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.gelu(self.fc(self.norm(x))))


class _Stacked(nnx.Module):
    """Four residual blocks created with ``nnx.vmap`` (one stacked (4, 64, 64) kernel, per-layer
    Dropout streams) and run with ``nnx.scan``, as NNX decoders stack their layers."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _Block(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, x):
            return block(x)

        return self.head(body(self.blocks, x))


def test_layers_stacked_with_nnx_vmap_and_scanned():
    """A step over layers made by ``nnx.vmap`` and run by ``nnx.scan`` (lifted transforms inside the
    scalified step), with the stacked kernel in MXFP8 (blocked along its input features): the
    model, optimizer and Dropout streams after the step equal float32's on the dequantized kernels."""
    fmt = qf.MXFP8

    def objects():
        model = _Stacked(nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_optimizer(), wrt=nnx.Param)

    (model, optimizer), (ref_model, ref_optimizer) = objects(), objects()
    qparams = quantize_tree(nnx.state(model, nnx.Param), fmt)
    # the stacked kernel, the stacked (4, 64) norm scales and biases, and the head's kernel
    assert n_scaled(qparams) == 5 and qparams["blocks"]["fc"]["kernel"].get_value().shape == (4, 64, 64)
    nnx.update(model, qparams)
    nnx.update(ref_model, dequantize_tree(qparams))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((32, 64)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(2).standard_normal((32, 32)), jnp.float32)

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    loss = nnx.jit(scalify.scalify(step))(model, optimizer, x, y)
    ref_loss = nnx.jit(step)(ref_model, ref_optimizer, x, y)
    assert int(optimizer.step[...]) == 1
    assert isinstance(model.blocks.fc.kernel.get_value(), scalify.ScaledArray)
    assert_tree_close(dequantize_tree(loss), ref_loss, fmt, "loss")
    assert_tree_close(nnx.state((model, optimizer)), nnx.state((ref_model, ref_optimizer)), fmt, "after the step")
