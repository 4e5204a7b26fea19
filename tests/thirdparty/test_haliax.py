"""haliax: a named-axis decoder and a mixture of experts from haliax's layers (levanter's blocks).

haliax names every axis (``hax.Axis("embed", 64)``) and contracts by name: ``hnn.Linear`` is
``inputs.dot(weight, axis=In)``, a ``jnp.einsum`` / ``dot_general`` whose operand order and axis
positions follow the names, not the user's ``x @ w``. Levanter's language models are built from
these layers; the decoder here is the same shape, written with haliax's public API only:

* ``lm``: ``hnn.Embedding`` -> ``hnn.Stacked`` of pre-norm blocks (``hnn.RmsNorm``, one fused
  ``hnn.Linear`` to (qkv, heads, head_size), ``hnn.attention.dot_product_attention`` with
  ``causal_mask``, an output ``hnn.Linear`` over (heads, head_size), a two-layer ``hnn.MLP``) ->
  ``hnn.RmsNorm`` -> the embedding's ``unembed`` (tied weights) -> ``hnn.cross_entropy_loss``.
  ``Stacked`` is levanter's scan over layers: the block's weights are stacked along a ``layers``
  axis (``haliax.vmap`` of the block's ``init``) and ``fold`` is a ``lax.scan`` over them, with
  gradient checkpointing in the ``lm_remat`` case.
* ``moe``: a token-choice mixture of experts: a router ``hnn.Linear``, top-1 routing, tokens sorted
  by expert, two ``hnn.MoELinear`` s (``lax.ragged_dot_general`` over the expert bank: the grouped
  GEMM), un-sorted and weighted by the router's probability.

Every weight matrix is a ScaledArray under ``scalify`` (the stacked ones are rank 3). Under the
recipes the gradient is taken inside and outside ``recipes.apply``, and a sharpness-aware step.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import (
    SAM_RECIPE,
    Case,
    StepResults,
    check_grad,
    check_gradient_under_recipe,
    check_sharpness_aware_step,
    check_update,
    flat_values,
    run_loss,
)

from scalify import recipes

eqx = pytest.importorskip("equinox", reason="equinox is not installed (pip install -e '.[test]')")
with warnings.catch_warnings():
    # haliax 1.4's modules still declare fields with equinox's deprecated ``static_field``.
    warnings.simplefilter("ignore", UserWarning)
    hax = pytest.importorskip("haliax", reason="haliax is not installed (pip install -e '.[test]')")
    hnn = pytest.importorskip("haliax.nn")

Pos = hax.Axis("position", 32)
KPos = Pos.alias("key_position")
Embed = hax.Axis("embed", 64)
Heads = hax.Axis("heads", 2)
HeadSize = hax.Axis("head_size", 32)
Qkv = hax.Axis("qkv", 3)
Mlp = hax.Axis("mlp", 128)
Vocab = hax.Axis("vocab", 64)
Layers = hax.Axis("layers", 2)
Batch = hax.Axis("batch", 2)


class Block(eqx.Module):
    """A pre-norm decoder block, written as levanter's are: names, not positions."""

    ln1: hnn.RmsNorm
    qkv: hnn.Linear
    out: hnn.Linear
    ln2: hnn.RmsNorm
    mlp: hnn.MLP

    @staticmethod
    def init(*, key):
        k_qkv, k_out, k_mlp = jax.random.split(key, 3)
        return Block(
            hnn.RmsNorm.init(Embed),
            hnn.Linear.init(In=Embed, Out=(Qkv, Heads, HeadSize), key=k_qkv, use_bias=False),
            hnn.Linear.init(In=(Heads, HeadSize), Out=Embed, key=k_out, use_bias=False),
            hnn.RmsNorm.init(Embed),
            hnn.MLP.init(Embed, Embed, width=Mlp, depth=2, activation=hnn.gelu, key=k_mlp),
        )

    def __call__(self, x, mask):
        q, k, v = self.qkv(self.ln1(x)).unbind(Qkv)
        k, v = k.rename({Pos: KPos}), v.rename({Pos: KPos})
        x = x + self.out(hnn.attention.dot_product_attention(KPos, HeadSize, q, k, v, mask=mask))
        return x + self.mlp(self.ln2(x))


class Decoder(eqx.Module):
    embed: hnn.Embedding
    blocks: hnn.Stacked
    ln_f: hnn.RmsNorm

    @staticmethod
    def init(*, key, remat=False):
        k_embed, k_blocks = jax.random.split(key)
        return Decoder(
            hnn.Embedding.init(Vocab, Embed, key=k_embed),
            hnn.Stacked.init(Layers, Block, gradient_checkpointing=remat)(key=jax.random.split(k_blocks, Layers.size)),
            hnn.RmsNorm.init(Embed),
        )

    def __call__(self, tokens):
        mask = hnn.attention.causal_mask(Pos, KPos)
        x = self.blocks.fold(self.embed(tokens), mask)
        return self.embed.unembed(self.ln_f(x))


def _split_case(name, model, batch, loss_of_model):
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, batch):
        return loss_of_model(eqx.combine(params, static), batch)

    return Case(name, loss, params, batch)


def _next_token_loss(model, tokens):
    """Mean cross-entropy of each position's logits against the next token (the last position has
    none: ``where`` masks it out, as levanter's loss mask does)."""
    targets = hax.roll(tokens, -1, Pos)
    not_last = hax.arange(Pos) < Pos.size - 1
    logits = model(tokens)
    return hnn.cross_entropy_loss(
        logits,
        Vocab,
        hnn.one_hot(targets, Vocab),
        reduction=hax.mean,
        where=hax.broadcast_to(not_last, logits.axes[:-1]),
    ).scalar()


def lm_case(remat=False):
    model = Decoder.init(key=jax.random.key(61), remat=remat)
    tokens = hax.named(
        jnp.asarray(np.random.default_rng(61).integers(0, Vocab.size, (Batch.size, Pos.size))), (Batch, Pos)
    )
    return _split_case("haliax_lm_remat" if remat else "haliax_lm", model, tokens, _next_token_loss)


Experts = hax.Axis("experts", 4)
Token = hax.Axis("token", 64)
Hidden = hax.Axis("hidden", 64)


class MoE(eqx.Module):
    """Top-1 token-choice routing over ``hnn.MoELinear`` expert banks (``ragged_dot_general``)."""

    router: hnn.Linear
    up: hnn.MoELinear
    down: hnn.MoELinear

    @staticmethod
    def init(*, key):
        k_router, k_up, k_down = jax.random.split(key, 3)
        return MoE(
            hnn.Linear.init(In=Embed, Out=Experts, key=k_router, use_bias=False),
            hnn.MoELinear.init(Experts, Embed, Hidden, key=k_up, use_bias=False),
            hnn.MoELinear.init(Experts, Hidden, Embed, key=k_down, use_bias=False),
        )

    def __call__(self, x):  # x: (token, embed)
        with jax.named_scope("router"):  # kept in the program's precision under the recipes (below)
            probs = hnn.softmax(self.router(x), Experts)
        expert = hax.argmax(probs, Experts)
        order = jnp.argsort(expert.array)
        sorted_x = hax.named(x.array[order], (Token, Embed))
        sizes = hax.named(jnp.bincount(expert.array, length=Experts.size).astype(jnp.int32), (Experts,))
        h = self.down(hnn.gelu(self.up(sorted_x, sizes)), sizes)
        y = hax.named(jnp.zeros_like(h.array).at[order].set(h.array), (Token, Embed))
        gate = hax.take(probs, Experts, expert)
        return x + y * gate


def _moe_loss(model, batch):
    x, target = batch
    return hax.mean((model(x) - target) ** 2).scalar()


def moe_case():
    rng = np.random.default_rng(62)
    x = hax.named(jnp.asarray(rng.standard_normal((Token.size, Embed.size)), jnp.float32), (Token, Embed))
    target = hax.named(jnp.asarray(rng.standard_normal((Token.size, Embed.size)), jnp.float32), (Token, Embed))
    return _split_case("haliax_moe", MoE.init(key=jax.random.key(62)), (x, target), _moe_loss)


CASES = {"haliax_lm": lm_case, "haliax_lm_remat": lambda: lm_case(remat=True), "haliax_moe": moe_case}
# The remat case differs from the plain one by the scan's checkpoint policy only: slow lane.
CASE_PARAMS = ["haliax_lm", pytest.param("haliax_lm_remat", marks=pytest.mark.slow), "haliax_moe"]


@functools.cache
def make_case(name):
    return CASES[name]()


@pytest.fixture(scope="module", params=CASE_PARAMS)
def case(request):
    return make_case(request.param)


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)


def _recipe_for(case, recipe):
    """The router contracts the tokens to four experts, so its input gradient sums over 4: no
    block fits, and the block recipes refuse it (``test_the_router_is_refused_by_name``).
    Transformer Engine and torchao's MoE training keep routers in high precision; so does this
    program, by scope."""
    return recipe.replace(high_precision_scopes=("router",)) if case.name == "haliax_moe" else recipe


# MXFP8's floor scales clip a block's largest elements by up to 12.5%: on the mixture of experts its
# distance from float32's gradient is 1.92 times the probes' (RCEIL's 1.35), near the bar of 2, so
# the fast lane runs RCEIL (docs/examples.md has every built-in's figure), on the mixture of experts
# (the decoder's took 52 s on a 2-core AMD EPYC VM: slow lane).
@pytest.mark.parametrize(
    "recipe_name",
    ["MXFP8_RCEIL"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("MXFP8", "FLOAT8_TENSORWISE", "NVFP4")],
)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) for n in ("haliax_lm", "haliax_lm_remat")] + ["haliax_moe"]
)
def test_gradient_under_recipe(name, recipe_name):
    case = make_case(name)
    check_gradient_under_recipe(case, _recipe_for(case, getattr(recipes, recipe_name)))


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["MXFP8", "NVFP4"])
def test_scan_checkpointing_changes_no_bit(recipe_name):
    """``Stacked(..., gradient_checkpointing=True)`` recomputes each block's forward in the backward
    scan: the recipe quantizes the recomputed operands as it did the first time (same values,
    same stochastic-rounding keys), so the gradient is the one without checkpointing, bit for bit."""
    recipe = getattr(recipes, recipe_name)
    plain, remat = make_case("haliax_lm"), make_case("haliax_lm_remat")
    want = flat_values(jax.jit(recipes.apply(jax.grad(plain.loss), recipe))(plain.params, plain.batch))
    got = flat_values(jax.jit(recipes.apply(jax.grad(remat.loss), recipe))(remat.params, remat.batch))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("haliax_lm", marks=pytest.mark.slow),
        pytest.param("haliax_lm_remat", marks=pytest.mark.slow),
        "haliax_moe",
    ],
)
def test_sharpness_aware_step_under_recipe(name):
    """Both gradients of a sharpness-aware step taken inside ``recipes.apply``, on named-axis
    contractions (haliax's operand order is the names', not ``x @ w``)."""
    case = make_case(name)
    check_sharpness_aware_step(case, _recipe_for(case, SAM_RECIPE))


@pytest.mark.parametrize("recipe_name", ["MXFP8", "NVFP4"])
def test_the_router_is_refused_by_name(recipe_name):
    """Without the router's scope in ``high_precision_scopes`` a block recipe refuses its GEMMs,
    naming the scope the program gave them and the way out (no silent high precision): NVFP4 its
    (4, 64) weight's 16x16 tiles, MXFP8 the input gradient's sum over the 4 experts. (With the
    gradient taken inside, MXFP8 runs: the router reads the data, whose gradient nobody takes, so
    JAX's transposition emits no input-gradient GEMM; the recipe's VJP cannot know that.)"""
    case = make_case("haliax_moe")
    with pytest.raises(ValueError, match=r"(?s)router/.*high_precision_scopes"):
        jax.jit(jax.grad(recipes.apply(case.loss, getattr(recipes, recipe_name)))).lower(case.params, case.batch)
