"""``recipes.apply`` on a training step that takes its gradient inside, as flax's, equinox's and
Keras's steps do: its backward GEMMs must run in their roles, as under ``jax.grad(apply(loss))``.

Reference: the recipe's custom VJP (``jax.value_and_grad(recipes.apply(loss, recipe))``), whose
quantized operands are bit-identical to torchao's (``test_torchao_vectors.py``). A step that takes
the gradient inside reaches the walker differentiated, its backward GEMMs bound by JAX's transpose
rules; the walker pairs each with its forward contraction and quantizes its operands in the
recipe's dgrad or wgrad roles. Both paths quantize the same values with the same keys and run the
same float32 contractions, so the results are compared bit for bit. Before the pairing, a
backward GEMM took the forward roles: E4M3 gradients under ``FLOAT8_TENSORWISE``, no stochastic
rounding or Hadamard transform under ``NVFP4``, a quantized weight gradient where the recipe keeps
it in high precision, none under ``weights_only``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from scalify import recipes


def _data(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _layer(w, h):
    return jax.nn.gelu(jnp.einsum("fd,bf->bd", w, h))  # the weight bound first


def _loss(p, x):
    """A contraction in each place the walker must pair across: an inner jit, a scan of
    rematerialised layers (residuals stacked by the forward scan, read by the backward one), a
    weight bound first, a convolution (its input gradient reverses the kernel), a scoped head and
    a tied embedding read twice in the forward pass (no transpose of the other)."""
    h = jax.jit(lambda a, b: a @ b)(x, p["w1"])
    h, _ = lax.scan(lambda h, w: (jax.checkpoint(_layer)(w, h), None), h, p["stack"])
    img = jnp.tile(h.reshape(32, 8, 8, 1), (1, 1, 1, 32))
    c = lax.conv_general_dilated(img, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = h + c.mean(axis=(1, 2)).repeat(2, axis=-1)
    e = h @ p["emb"].T  # scores against the embedding
    h = jax.nn.softmax(e) @ p["emb"]  # and the embedding read as a weight
    with jax.named_scope("head"):
        out = h @ p["head"]
    return jnp.mean(out**2)


PARAMS = {
    "w1": _data((64, 64), 0, 0.1),
    "stack": _data((3, 64, 64), 1, 0.1),
    "k": _data((3, 3, 32, 32), 2, 0.1),
    "emb": _data((96, 64), 3, 0.1),
    "head": _data((64, 32), 4, 0.1),
}
X = _data((32, 64), 5)

RECIPES = {
    "float8_tensorwise": recipes.FLOAT8_TENSORWISE,  # E5M2 gradients
    "nvfp4": recipes.NVFP4,  # stochastic rounding, Hadamard, 16x16 weight tiles
    "mxfp8_weights_only": recipes.MXFP8.replace(weights_only=True),
    "float8_rowwise_hp_wgrad": recipes.FLOAT8_ROWWISE.replace(wgrad_lhs=None, wgrad_rhs=None),
    "mxfp8_hp_head": recipes.MXFP8.replace(high_precision_scopes=("head",)),
}


def _assert_trees_equal(got, want, compiled=False):
    """Bit for bit; ``compiled``: two programs XLA compiled apart, whose fusions may sum in another
    order, within 1e-5 of each leaf's largest magnitude (a gradient rounded in a wrong role, E4M3
    for E5M2 or a skipped Hadamard transform, moves it by 1e-2 and more)."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if compiled:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b)), err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


# NVFP4 eagerly dispatches hundreds of small ops (Hadamard, stochastic rounding, 16x16 tiles) for
# 25 s on 2 cores: the slow lane; under jit it runs in the fast lane, and every other recipe both ways.
@pytest.mark.parametrize(
    ("name", "jit"),
    [
        pytest.param(
            n, j, marks=pytest.mark.slow if (n, j) == ("nvfp4", False) else (), id=f"{n}-{'jit' if j else 'eager'}"
        )
        for n in sorted(RECIPES)
        for j in (False, True)
    ],
)
def test_a_gradient_taken_inside_runs_each_backward_gemm_in_its_role(name, jit):
    recipe = RECIPES[name]
    step = recipes.apply(lambda p, x: jax.value_and_grad(_loss)(p, x), recipe)
    want = jax.value_and_grad(recipes.apply(_loss, recipe))
    got = (jax.jit(step) if jit else step)(PARAMS, X)
    _assert_trees_equal(got, (jax.jit(want) if jit else want)(PARAMS, X), compiled=jit)
    assert not np.array_equal(got[1]["w1"], jax.grad(_loss)(PARAMS, X)["w1"])  # the recipe is on


def test_an_optax_step_with_its_gradient_inside():
    """An optax training step (gradient, Adam update, new parameters) under the recipe as a whole
    equals the same step around the gradient of the applied loss."""
    opt = optax.adam(1e-2)
    recipe = recipes.NVFP4

    def step(p, state, x, grad_fn):
        loss, g = grad_fn(p, x)
        updates, state = opt.update(g, state, p)
        return loss, optax.apply_updates(p, updates), state

    state = opt.init(PARAMS)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes int32 and float
        got = jax.jit(recipes.apply(lambda p, s, x: step(p, s, x, jax.value_and_grad(_loss)), recipe))(PARAMS, state, X)
        want = jax.jit(lambda p, s, x: step(p, s, x, jax.value_and_grad(recipes.apply(_loss, recipe))))(
            PARAMS, state, X
        )
    _assert_trees_equal(got, want, compiled=True)


def test_a_backward_gemms_error_names_the_gemm():
    """A width the block cannot divide fails where that GEMM sums over it: here only the input
    gradient sums over the 10 outputs."""
    p = {"w1": _data((64, 64), 0), "w2": _data((64, 10), 1)}
    step = recipes.apply(jax.grad(lambda p, x: jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])), recipes.MXFP8)
    with pytest.raises(ValueError, match=r"cannot quantize dy \(dgrad_lhs.*input-gradient GEMM dx = dy.w"):
        step(p, _data((32, 64), 2))


def test_a_partial_batch_names_the_convolutions_weight_gradient():
    """A convolution's weight gradient sums over the batch, blocked along it: a batch of 24 (a
    dataset's last partial batch) fails there, in both orders of gradient and recipe, and the
    error says which axis to resize."""

    def loss(k, x):
        return jnp.mean(lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)

    k, x = _data((3, 3, 32, 32), 0, 0.1), _data((24, 8, 8, 32), 1)
    match = r"weight-gradient GEMM dw = dy.x of the conv_general_dilated.*the batch for a convolution's weight gradient"
    with pytest.raises(ValueError, match=match):
        jax.grad(recipes.apply(loss, recipes.MXFP8))(k, x)
    with pytest.raises(ValueError, match=match):
        recipes.apply(jax.grad(loss), recipes.MXFP8)(k, x)
    recipes.apply(loss, recipes.MXFP8)(k, x)  # the forward sums over 32 channels: it runs


def _conv(x, k, **kw):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)


def _gated(p, x):
    """A gated MLP: one activation read by two forward contractions of one output shape."""
    h = jnp.tanh(x @ p["w0"])
    with jax.named_scope("gate"):
        g = h @ p["wg"]
    return jnp.mean((jax.nn.silu(g) * (h @ p["wu"])) ** 2)


def _shared_weight(p, x):
    """One weight read as ``h @ w`` and, bound first, as ``w^T sin(h)^T``."""
    h = jnp.tanh(x @ p["w0"])
    b = lax.dot_general(p["w"], jnp.sin(h), (((0,), (1,)), ((), ()))).T
    return jnp.mean((h @ p["w"] * b) ** 2)


def _gram(p, x):
    h = jnp.tanh(x @ p["w0"])
    return jnp.mean(lax.dot_general(h, h, (((1,), (1,)), ((), ()))) ** 2)


_COEFFICIENTS = _data((8, 1, 8), 10)


def _shared_constant(p, x):
    """One constant coefficient tensor read by two contractions whose other operands order its
    summed axes differently (e3nn's tensor products: ``jnp.einsum("...ui,...uj,ijk->...uk")`` of
    each pair of irreps against one Clebsch-Gordan tensor). Both input gradients are the same
    ``dot_general(dy, C)``, whichever forward each transposes."""
    h = jnp.tanh(x @ p["w0"]).reshape(32, 8, 8)
    y1 = lax.dot_general(h[..., None], _COEFFICIENTS, (((2, 3), (0, 1)), ((), ())))
    y2 = lax.dot_general(jnp.sin(h)[:, :, None, :], _COEFFICIENTS, (((3, 2), (0, 1)), ((), ())))
    return jnp.mean((y1 * y2) ** 2)


def _remat_convs(p, x):
    """Rematerialised convolutions whose inputs and outputs share a shape (a ResNet block's)."""
    block = jax.checkpoint(lambda k, x: jnp.tanh(_conv(x, k)))
    return jnp.mean(block(p["k2"], block(p["k1"], x)) ** 2)


def _remat_residual(p, x):
    """Checkpointed residual blocks (penzai's ``Checkpointed``, a LoRA's ``(h A) B``): the last
    projection's output is not needed by the backward pass, so remat recomputes the activation its
    weight gradient reads but not the projection itself, and no recomputed contraction reads it."""
    block = jax.checkpoint(lambda a, b, h: h + (jnp.tanh(h) @ a) @ b)
    return jnp.mean(jnp.tanh(block(p["w0"], p["w"], block(p["wg"][:, :64], p["wu"][:, :64], x))) ** 2)


def _grouped_conv(p, x):
    return jnp.mean(_conv(jnp.tanh(_conv(x, p["k0"])), p["k"], feature_group_count=2) ** 2)


_W = {"w0": _data((64, 64), 0, 0.1), "wg": _data((64, 128), 1, 0.1), "wu": _data((64, 128), 2, 0.1)}
_W["w"] = _data((64, 64), 3, 0.1)
_K = {"k1": _data((3, 3, 32, 32), 4, 0.1), "k2": _data((3, 3, 32, 32), 5, 0.1)}
_K["k0"], _K["k"] = _data((3, 3, 32, 64), 6, 0.1), _data((3, 3, 32, 64), 7, 0.1)
_XI = _data((32, 8, 8, 32), 8)
HARD = {
    "gated_gate_kept": (_gated, recipes.FLOAT8_TENSORWISE.replace(high_precision_scopes=("gate",)), _W, X[:, :64]),
    # Without stochastic rounding: the first layer's gradient operand here draws its rounding bits
    # from a digest of its float32 bits, and on an AMD EPYC CPU without AVX-512 the two programs'
    # float32 values of it differed in their low bits (every gradient was still bit-identical with
    # stochastic rounding off; with it, that one weight's gradient differed by the rounding noise).
    # The stochastically rounded cases below still compare bit for bit.
    "shared_weight_bound_first": (_shared_weight, recipes.NVFP4.replace(stochastic_rounding=()), _W, X[:, :64]),
    "gram_matrix": (_gram, recipes.NVFP4, _W, X[:, :64]),
    "shared_constant_rowwise": (_shared_constant, recipes.FLOAT8_ROWWISE, _W, X[:, :64]),
    "rematerialised_convs": (_remat_convs, recipes.NVFP4, _K, _XI),
    "grouped_conv_kept": (_grouped_conv, recipes.NVFP4, _K, _XI),
    "remat_residual_float8": (_remat_residual, recipes.FLOAT8_TENSORWISE, _W, X[:, :64]),
    "remat_residual_nvfp4": (_remat_residual, recipes.NVFP4, _W, X[:, :64]),
    "out_dtype": (_gated, recipes.NVFP4.replace(out_dtype=jnp.bfloat16), _W, X[:, :64]),
    "conv_kernel_rounded_stochastically": (
        lambda p, x: jnp.mean(_conv(jnp.tanh(_conv(x, p["k1"])), p["k2"]) ** 2),
        recipes.NVFP4.replace(stochastic_rounding=("dgrad_lhs", "wgrad_lhs", "dgrad_rhs")),
        _K,
        _XI,
    ),
}


# remat_residual_nvfp4 holds remat_residual_float8's pairing with NVFP4's transforms, which
# rematerialised_convs holds under remat in the fast lane: the slow lane (30 s on 2 cores).
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "remat_residual_nvfp4" else n for n in sorted(HARD)]
)
def test_hard_pairings_match_the_custom_vjp(name):
    """Cases found by review (all but the shared weight failed on the first version of the pairing),
    each bit-identical now: two forward
    contractions reading one activation with one output shape (told apart by scope), a weight read
    twice (told apart by dimension numbers), a Gram matrix (the two gradients of one product), a
    rematerialised convolution under the transposition (not its own input gradient), a grouped
    convolution (kept in the program's precision, both ways), ``out_dtype`` (the cotangent of the
    rounded output) and a stochastically rounded kernel read reversed by the input gradient; then
    (found on penzai's checkpointed blocks) a weight gradient reading an activation remat recomputed
    for it alone; and (found on e3nn's tensor products, where it raised the pairing error) one
    constant read by two contractions that transpose to the same backward GEMM."""
    loss, recipe, params, x = HARD[name]
    got = recipes.apply(lambda p, x: jax.value_and_grad(loss)(p, x), recipe)(params, x)
    _assert_trees_equal(got, jax.value_and_grad(recipes.apply(loss, recipe))(params, x))


def _sam(loss, rho=0.05, lr=0.1):
    """A sharpness-aware minimisation step (Foret et al., 2021): the gradient at the weights, the
    weights moved along it by ``rho`` over its global norm, and the gradient there applied at the
    weights. The second gradient is taken at a point computed from the first."""

    def step(p, x):
        g = jax.grad(loss)(p, x)
        norm = optax.global_norm(g)
        moved = jax.tree.map(lambda w, d: w + rho * d / norm, p, g)
        return jax.tree.map(lambda w, d: w - lr * d, p, jax.grad(loss)(moved, x))

    return step


def _sam_loss(p, x):
    """The batch read by the first layer at both points; a bias; a layer written as equinox's
    ``Linear`` (``w @ v``, vmapped: the weight bound first)."""
    h = jnp.tanh(x @ p["w0"] + p["b"])
    h = jax.nn.gelu(jax.vmap(lambda v: p["w"] @ v)(h))
    return jnp.mean((h @ p["wg"]) ** 2)


def _first_order_maml(loss, steps=2, lr=0.1):
    """First-order MAML's meta-gradient: the gradient at the weights after ``steps`` gradient
    steps (each at a point computed from the previous gradient)."""

    def step(p, x):
        for _ in range(steps):
            p = jax.tree.map(lambda w, d: w - lr * d, p, jax.grad(loss)(p, x))
        return jax.grad(loss)(p, x)

    return step


_SAM_W = {**_W, "b": _data((64,), 9, 0.1)}
_MOVED = {"sam": _sam, "first_order_maml": _first_order_maml}


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("program", sorted(_MOVED))
def test_a_gradient_at_a_point_moved_along_a_gradient(program, name):
    """A sharpness-aware step, and first-order MAML's meta-gradient, under the recipe equal the
    same program around the applied loss's gradient, bit for bit. A moved point's weights would
    mix every input of the step (the batch, through the earlier gradient): the gradient counts as
    no input there, as outside, and the batch stays the activation the first point's layer took
    it as. Before, the batch's weight gradient raised the pairing error (the moved point's first
    layer had taken the batch as its weight), then the equinox layer's weight took an activation's
    roles there (NVFP4's tiles), and ``weights_only`` kept every layer after the first in float32
    there.

    Compared as two programs compiled apart (``compiled=True``): the moved point is computed from
    a gradient whose reductions (the bias's, the global norm) XLA may sum in another order in
    each, and a point one ulp away moves a per-tensor FP8 scale by an ulp (bit for bit on the VM it
    was written on; on a 2-core AMD EPYC VM, ulps: 2.4e-6 relative at most). For the
    same reason NVFP4's stochastic rounding is off here: its draws are keyed by the bits of the
    gradient, so an ulp anywhere gives another draw (relative differences of order one); its
    16x16 tiles and Hadamard transform still tell the roles apart."""
    recipe, make = RECIPES[name], _MOVED[program]
    recipe = recipe.replace(stochastic_rounding=frozenset())
    got = recipes.apply(make(_sam_loss), recipe)(_SAM_W, X[:, :64])
    _assert_trees_equal(got, make(recipes.apply(_sam_loss, recipe))(_SAM_W, X[:, :64]), compiled=True)


def test_one_jitted_function_at_two_sites_the_recipe_treats_apart_raises():
    """A jitted helper traced once, called on a weight (a linear layer) and on two activations:
    under ``weights_only`` its forward equation is quantized at one site and kept at the other, and
    its shared backward equations cannot tell which site they serve; an error says so."""
    mm = jax.jit(lambda a, b: a @ b)

    def loss(p, x):
        h = jnp.tanh(mm(jnp.tanh(x @ p["w0"]), p["w"]))
        return jnp.mean(mm(h, jnp.tanh(x @ p["wg"][:, :64]).T @ h / 32.0) ** 2)

    step = recipes.apply(lambda p, x: jax.value_and_grad(loss)(p, x), recipes.MXFP8.replace(weights_only=True))
    with pytest.raises(ValueError, match=r"several forward contractions .* jax.grad\(recipes.apply\(loss, recipe\)\)"):
        step(_W, X[:, :64])


def test_remat_recomputations_are_forward_contractions():
    """Under ``jax.checkpoint`` the backward pass recomputes forward contractions (JAX scopes them
    ``rematted_computation``): they are forward GEMMs, not backward ones left unpaired. The two
    checkpointed blocks of ``_remat_residual`` have 7 backward GEMMs (each weight's gradient, the
    input gradients but the first block's), all paired."""
    from scalify.amp._transposes import Transposes

    closed = jax.make_jaxpr(jax.grad(_remat_residual))(_W, X[:, :64])
    assert Transposes(closed).counts == (7, 7)
