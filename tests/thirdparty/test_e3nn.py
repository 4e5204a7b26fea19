"""e3nn-jax: an equivariant interatomic potential trained on energies and forces.

A NequIP-shaped model written with e3nn-jax 0.21's public API only (the library MACE-jax and
NequIP-jax are built on): species embedded by an ``e3nn.flax.Linear``, two interaction blocks
(spherical harmonics of the edge vectors up to l = 2, ``e3nn.tensor_product`` of each sender's
features with them, per-irrep channel mixing by ``e3nn.flax.Linear``, a radial MLP on a Bessel
basis times a smooth envelope weighting every message, ``e3nn.scatter_sum`` to the receivers, a
self-connection and ``e3nn.gate``) and a scalar readout summed over atoms. The loss is force
matching, as these potentials are trained: the forces are minus the gradient of the energy with
respect to the positions, taken inside the loss, so the training gradient is a second derivative.

e3nn's tensor products and spherical harmonics are ``jnp.einsum`` calls of features against
constant Clebsch-Gordan tensors (``"...ui,...uj,ijk->...uk"``), one coefficient tensor read by the
paths of several irrep pairs, the channel mixing is ``einsum("uw,ui->wi", weight, x)`` (weight
first), and every parameter is a small matrix (32 x 32 to 128 x 32), one per path.

Found here: under a recipe, the gradient taken inside a step raised the pairing error on the
tensor products (one Clebsch-Gordan constant read by two contractions whose other operands order
its axes differently: their input gradients are one and the same backward GEMM). Fixed in
``scalify.recipes._apply`` (candidates are compared by the backward GEMM they give, through a hook
of ``scalify.amp._transposes``); the same-shaped program without e3nn is
``tests/recipes/test_gradient_inside.py``'s ``shared_constant_rowwise``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import (
    Case,
    StepResults,
    assert_recipe_distance,
    check_grad,
    check_gradient_under_recipe,
    check_update,
    flat_values,
    perturbed_gradient_cosines,
    recipe_rounding,
    run_loss,
)

from scalify import recipes

e3nn = pytest.importorskip("e3nn_jax", reason="e3nn-jax is not installed (pip install -e '.[test]')")
nn = pytest.importorskip("flax.linen", reason="flax is not installed (pip install -e '.[test]')")

MUL = 32  # channels per irrep: the weights' axes are multiples of the MX block
CUTOFF = 2.0
ATOMS, EDGES, SPECIES = 32, 256, 4


class Interaction(nn.Module):
    """One NequIP-style message-passing block (e3nn's public API only)."""

    @nn.compact
    def __call__(self, nodes, vectors, senders, receivers):
        sh = e3nn.spherical_harmonics("0e + 1o + 2e", vectors, normalize=True, normalization="component")
        length = e3nn.norm(vectors).array[:, 0]
        radial = e3nn.bessel(length, 8, CUTOFF) * e3nn.soft_envelope(length, CUTOFF)[:, None]
        messages = e3nn.tensor_product(nodes[senders], sh, filter_ir_out="0e + 1o + 2e")
        messages = e3nn.flax.Linear(f"{MUL}x0e + {MUL}x1o + {MUL}x2e")(messages)
        weights = e3nn.flax.MultiLayerPerceptron(
            (MUL, messages.irreps.num_irreps), jax.nn.silu, output_activation=False, name="radial"
        )(radial)
        aggregated = e3nn.scatter_sum(messages * weights, dst=receivers, output_size=nodes.shape[0]) / 4.0
        gated = f"{3 * MUL}x0e + {MUL}x1o + {MUL}x2e"  # scalars, one gate per nonscalar, nonscalars
        skip = e3nn.flax.Linear(gated, force_irreps_out=True)(nodes)
        return e3nn.gate(e3nn.flax.Linear(gated, force_irreps_out=True)(aggregated) + skip)


class Potential(nn.Module):
    @nn.compact
    def __call__(self, positions, species, senders, receivers):
        nodes = e3nn.flax.Linear(f"{MUL}x0e", name="embed")(e3nn.IrrepsArray(f"{SPECIES}x0e", species))
        vectors = e3nn.IrrepsArray("1o", positions[receivers] - positions[senders])
        for _ in range(2):
            nodes = Interaction()(nodes, vectors, senders, receivers)
        return jnp.sum(e3nn.flax.Linear("0e", name="readout")(nodes).array[:, 0])


def _system():
    """32 atoms of 4 species in a 3 x 3 x 3 box; 256 of the pairs closer than the cutoff (a
    multiple of the MX and NVFP4 blocks: the messages' rows); reference energy and forces."""
    rng = np.random.default_rng(0)
    positions = rng.uniform(0, 3.0, (ATOMS, 3)).astype(np.float32)
    species = np.eye(SPECIES, dtype=np.float32)[rng.integers(0, SPECIES, ATOMS)]
    distance = np.linalg.norm(positions[:, None] - positions[None], axis=-1)
    senders, receivers = np.nonzero((distance < CUTOFF) & (distance > 0))
    keep = np.sort(rng.permutation(len(senders))[:EDGES])
    forces = (0.1 * rng.standard_normal((ATOMS, 3))).astype(np.float32)
    return positions, species, senders[keep], receivers[keep], np.float32(-3.0), forces


MODEL = Potential()


def energy_and_forces(params, positions, species, senders, receivers):
    energy_fn = lambda p: MODEL.apply({"params": params}, p, species, senders, receivers)
    energy, gradient = jax.value_and_grad(energy_fn)(positions)
    return energy, -gradient


def force_matching_loss(params, batch):
    positions, species, senders, receivers, energy_ref, forces_ref = batch
    energy, forces = energy_and_forces(params, positions, species, senders, receivers)
    return (energy - energy_ref) ** 2 / ATOMS + jnp.mean((forces - forces_ref) ** 2)


def energy_loss(params, batch):
    positions, species, senders, receivers, energy_ref, _ = batch
    return (MODEL.apply({"params": params}, positions, species, senders, receivers) - energy_ref) ** 2


@pytest.fixture(scope="module")
def system():
    batch = _system()
    params = MODEL.init(jax.random.key(0), *batch[:4])["params"]
    return params, batch


@pytest.fixture(scope="module")
def case(system):
    return Case("e3nn_force_matching", force_matching_loss, *system)


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)


# -- recipes ---------------------------------------------------------------------------------------
# The recipe checks compile the model two to four times (50-100 s each on 2 cores): the slow lane.
# The fast lane holds the pairing they found in tests/recipes/test_gradient_inside.py.
@pytest.mark.slow
def test_the_energys_gradient_taken_inside_equals_outside(system):
    """The tensor products' shared Clebsch-Gordan constants (the pairing error this suite found):
    a step that takes the energy's gradient inside ``recipes.apply`` (which raised the pairing
    error) equals ``jax.grad`` of the applied loss bit for bit, and is within the recipe bar of
    float32's."""
    check_gradient_under_recipe(Case("e3nn_energy", energy_loss, *system), recipes.FLOAT8_ROWWISE)


def _second_order_under_recipe(case: Case, recipe) -> dict:
    """The force-matching gradient under ``recipe`` in both orders. They differentiate different
    programs (inside, JAX transposes the walked backward GEMMs of the forces; outside, the recipe's
    straight-through VJP: docs/recipes.md, "Second-order derivatives"), so they are not bit for bit
    alike: each must be finite, not float32's, and within the first-order check's bar
    (:func:`assert_recipe_distance` against the probes of :func:`perturbed_gradient_cosines` at
    the recipe's coarsest rounding)."""
    reference = jax.jit(jax.grad(case.loss))(case.params, case.batch)
    noise = perturbed_gradient_cosines(case, recipe_rounding(recipe))
    out = {"noise": noise}
    programs = {
        "inside": recipes.apply(jax.grad(case.loss), recipe),
        "outside": jax.grad(recipes.apply(case.loss, recipe)),
    }
    for order, program in programs.items():
        got = jax.jit(program)(case.params, case.batch)
        assert np.isfinite(flat_values(got)).all(), f"{recipe.name} {order}: NaN/Inf in the gradient"
        cos, ratio = assert_recipe_distance(f"{case.name} under {recipe.name} ({order})", got, reference, noise)
        assert cos < 1 - 1e-6, f"{recipe.name} {order}: the gradient is float32's (nothing quantized)"
        out[order] = (cos, ratio)
    return out


# Per-tensor and row-wise scales quantize every contraction of the model, tensor products and
# spherical harmonics included (their axes of 1, 3 and 5 components are no block's multiple).
# The measured distances are in docs/examples.md ("e3nn-jax").
@pytest.mark.slow
@pytest.mark.parametrize("name", ["FLOAT8_TENSORWISE", "FLOAT8_TENSORWISE_POW2", "FLOAT8_ROWWISE"])
def test_force_matching_under_a_per_tensor_recipe(case, name):
    _second_order_under_recipe(case, getattr(recipes, name))


# What a block recipe keeps in the program's precision on this model: the layers whose summed axes
# no block fits (the species embedding sums over 4, the readout's input gradient over 1, the radial
# MLP's first layer over 8 Bessel functions) by their flax names, and e3nn's spherical harmonics
# and tensor products (features against Clebsch-Gordan constants, summed over 1 to 5 components)
# by the scopes e3nn's einsums carry, each named in the error that refuses it. ``weights_only``:
# the tensor products of two activations keep it too.
GEOMETRY = (
    "embed",
    "readout",
    "Dense_0",
    "...i,...j,ijk->...k",
    "...i,...k,ijk->...j",
    "...ui , ...vj , ijk -> ...uvk",
    "...ui , ...uj , ijk -> ...uk",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["MXFP8_RCEIL", "NVFP4"])
def test_force_matching_under_a_block_recipe_with_the_geometry_kept(case, name):
    """The channel-mixing ``e3nn.flax.Linear`` weights (32 to 128 channels per irrep) under MX and
    NVFP4 blocks, the rest as :data:`GEOMETRY` keeps it, both orders within the bar."""
    recipe = getattr(recipes, name).replace(weights_only=True, high_precision_scopes=GEOMETRY)
    _second_order_under_recipe(case, recipe)


def test_a_block_recipe_names_the_contraction_it_cannot_block(case):
    """MX and NVFP4 block 32 or 16 elements along the summed axis: the species embedding sums over
    4 species, and the spherical harmonics' and tensor products' contractions over 1, 3 or 5
    components. The recipe refuses, naming the einsum and its flax scope and the fixes, before
    anything runs."""
    match = r"recipe 'mxfp8' cannot quantize .* at Potential/embed/.*high_precision_scopes"
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(jax.grad(recipes.apply(case.loss, recipes.MXFP8)), case.params, case.batch)
    keep = recipes.MXFP8.replace(high_precision_scopes=("embed",))
    with pytest.raises(ValueError, match=r"cannot quantize .* at Potential/Interaction_0/.*ijk"):
        jax.eval_shape(jax.grad(recipes.apply(case.loss, keep)), case.params, case.batch)
