"""Loss scaling under the recipes: a power-of-two loss scale changes no bit of the gradient.

Dynamic loss scaling (``scalify.amp.dynamic_scale_value_and_grad``, jaxamp's API; jmp's
``DynamicLossScale``, as Haiku's examples use it; flax's ``DynamicScale``) multiplies the loss by
``s = 2**k`` before the backward pass and divides the gradients by it after. Every cotangent is
linear in the loss's, so each is multiplied by ``s``; and each step a recipe takes on a cotangent
commutes with a power of two exactly, away from overflow and underflow:

* a scale computed from an amax follows it: ``E8M0(amax * s) = E8M0(amax) * s`` (floor and rceil
  alike, MX), ``448 / (amax * s) = (448 / amax) / s`` in float32 (torchao's tensorwise and
  row-wise FP8), ``amax * s / 2688 = (amax / 2688) * s`` (NVFP4's tensor scale), so the elements,
  ``x * s / (scale * s)``, are the unscaled ones bit for bit;
* the random Hadamard transform is linear; stochastic rounding draws its bits from a key hashed
  from the operand's sign and mantissa bits, which ``s`` leaves, and from the position; float32
  sums and products of values times ``s`` are the unscaled ones times ``s``.

So ``grad(loss * s) / s`` equals the same compiled program's gradient at ``s = 1`` bit for bit,
under every built-in recipe, with the gradient taken inside or outside ``recipes.apply`` and
through the loss scalers people use. A
recipe step whose scale had a floor or an epsilon (``max(amax, eps)``), or a constant that is not a
power of two applied before rounding, would fail this for small ``s``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scalify.amp as jaxamp
from scalify import recipes

# Block recipes need each GEMM's summed axis to be a multiple of their block (128 for the blockwise
# ones), the weight gradient's included: 128 examples.
N, D, H, C = 128, 128, 256, 128


def _problem():
    rng = np.random.default_rng(71)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    y = jnp.asarray(rng.integers(0, C, N), jnp.int32)
    p = {
        "w1": jnp.asarray(rng.standard_normal((D, H)) / np.sqrt(D), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((H, C)) / np.sqrt(H), jnp.float32),
    }
    return p, x, y


def loss(p, x, y):
    """A two-layer classifier. ReLU's derivative zeroes about half of the first layer's output
    gradient: a stochastic-rounding key hashed from a tensor's bits must not count on every element
    moving with the scale (a plain sum of bit patterns moves by ``count * k << 23``, which wraps to
    zero only when that count is a multiple of 512)."""
    logits = jax.nn.relu(x @ p["w1"]) @ p["w2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _assert_same_bits(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what}: {jax.tree_util.keystr(path)}")


# From 2**-16 to 2**60 (gradients of 1e-10 to 1e21): far from float32's range ends and from E8M0's,
# and above torchao's amax floor (below: test_below_torchaos_amax_floor_the_scale_shows).
EXPONENTS = st.integers(-16, 60)


def _forms(recipe):
    """The gradient at loss scale ``s``, unscaled: outside ``recipes.apply``, inside it, and through
    jaxamp's dynamic loss scaler (the value too). Each is one compiled program whatever ``s`` is, so
    two scales run the same float32 code (XLA may round a differently fused program's float32
    parts differently: the reference is each program at ``s = 1``)."""
    applied = recipes.apply(loss, recipe)

    def unscaled(grads, s):
        return jax.tree.map(lambda g: g / s, grads)

    def amp(p, x, y, s):
        state, (value, grads) = jaxamp.dynamic_scale_value_and_grad(applied)(
            p, x, y, dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=s)
        )
        return value, grads, state.scaler

    return {
        "grad(apply(loss) * s) / s": jax.jit(
            lambda p, x, y, s: unscaled(jax.grad(lambda p: applied(p, x, y) * s)(p), s)
        ),
        "apply(grad(loss * s) / s)": jax.jit(
            recipes.apply(lambda p, x, y, s: unscaled(jax.grad(lambda p: loss(p, x, y) * s)(p), s), recipe)
        ),
        "dynamic_scale_value_and_grad(apply(loss)) at scaler s": jax.jit(amp),
    }


@pytest.mark.parametrize("name", sorted(recipes.BUILTINS))
def test_a_power_of_two_loss_scale_changes_no_bit(name):
    recipe = recipes.BUILTINS[name]
    p, x, y = _problem()
    forms = _forms(recipe)
    one = jnp.float32(1.0)
    want = {what: f(p, x, y, one) for what, f in forms.items()}
    float32 = jax.jit(jax.grad(loss))(p, x, y)
    got = want["grad(apply(loss) * s) / s"]
    assert not np.allclose(got["w1"], float32["w1"], rtol=1e-5), f"{name}: the gradient is float32's"

    @settings(max_examples=6, deadline=None, derandomize=True)
    @given(k=EXPONENTS)
    def check(k):
        s = jnp.float32(2.0**k)
        for what, f in forms.items():
            out = f(p, x, y, s)
            if what.startswith("dynamic"):  # (value, grads, scaler): the scaler is kept, all finite
                assert float(out[2]) == float(s), f"{name}, {what}: the scaler moved at 2**{k}"
                out = out[:2]
                reference = want[what][:2]
            else:
                reference = want[what]
            _assert_same_bits(out, reference, f"{name}, {what}, s = 2**{k}")

    check()


def test_below_torchaos_amax_floor_the_scale_shows():
    """torchao's float8 recipes clamp each amax at ``1e-12`` (``FLOAT8_TENSORWISE`` follows it bit
    for bit): a cotangent scaled below the floor takes the floor's scale, so a loss scale of
    ``2**-40`` (the first layer's output gradient's amax, 2.0e-3, becomes 1.8e-15) changes its rounding, where
    MXFP8, whose E8M0 scales reach 2**-127, keeps every bit: the property above holds for every
    recipe only above the floor."""
    p, x, y = _problem()
    s = jnp.float32(2.0**-40)
    for recipe, changes in [(recipes.FLOAT8_TENSORWISE, True), (recipes.MXFP8, False)]:
        f = _forms(recipe)["grad(apply(loss) * s) / s"]
        same = np.array_equal(f(p, x, y, s)["w1"], f(p, x, y, jnp.float32(1.0))["w1"])
        assert same != changes, f"{recipe.name} at 2**-40: {'unchanged' if same else 'changed'}"


def test_jmp_dynamic_loss_scale_step_under_a_recipe():
    """jmp's loss scaler, as a Haiku step uses it (scale, grad, unscale, ``all_finite``,
    ``adjust``), around the recipe's loss: the unscaled step's gradient bit for bit (the same
    program with a scale of one), and the scale kept (every gradient finite)."""
    jmp = pytest.importorskip("jmp", reason="jmp is not installed (pip install -e '.[test]')")
    p, x, y = _problem()
    # Stochastic rounding and the random Hadamard transform in the backward GEMMs.
    applied = recipes.apply(loss, recipes.NVFP4)

    @jax.jit
    def step(p, x, y, loss_scale):
        grads = jax.grad(lambda p: loss_scale.scale(applied(p, x, y)))(p)
        grads = loss_scale.unscale(grads)
        return grads, loss_scale.adjust(jmp.all_finite(grads))

    with jax.numpy_dtype_promotion("standard"):  # jmp is written for JAX's default promotion
        want, _ = step(p, x, y, jmp.DynamicLossScale(jnp.float32(1.0)))
        grads, loss_scale = step(p, x, y, jmp.DynamicLossScale(jnp.float32(2.0**15)))
    _assert_same_bits(grads, want, "jmp.DynamicLossScale(2**15) under NVFP4")
    assert float(loss_scale.loss_scale) == 2.0**15
