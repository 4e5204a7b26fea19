"""Google DeepMind's penzai: its transformer variants, KV-cached decoding, LoRA and trainer, unchanged.

penzai (``pip install penzai``) builds Gemma, Llama, Mistral and GPT-NeoX decoders from its own
layers on named axes (``pz.nx.NamedArray``, every op a ``jax.vmap`` over the named axes): a third
model style beside flax, equinox, Haiku and Keras. Models hold their weights in ``pz.Parameter``
variables; a JAX transformation sees them the way penzai's own ``variable_jit`` and trainer pass
them, unbound and frozen (``pz.unbind_params`` / ``pz.freeze_params``) and bound again inside the
traced function (``pz.bind_variables``). That glue is penzai's; nothing of the models is changed.

What runs here, each against the same program in float32 on the dequantized weights (the harness's
tolerance, see ``thirdparty_harness.py``):

* a Gemma 2 style decoder (one KV head, alternating sliding-window and global attention, soft-capped
  logits, pre/post norms, tied embeddings, GeGLU) with every block under penzai's
  ``Checkpointed`` (``jax.checkpoint``), and a GPT-NeoX one (LayerNorm, partial rotary, a
  ``LayerStack``: the blocks under one ``lax.scan``): loss, gradient and an Adam step, every format;
* the Gemma 2 style decoder's KV-cached greedy decoding (penzai's ``KVCachingTransformerLM``, state
  variables updated in place, a left-padded prompt) with formatted weights;
* a Llama style decoder in bfloat16;
* penzai's ``StatefulTrainer`` with its step under a training recipe (the step takes the gradient
  inside), with LoRA adapters on the MLPs of the checkpointed decoder, against the recipe's custom
  VJP on the loss.

Found by this suite (regressions in ``tests/scalify/test_scale_propagation.py`` and
``tests/recipes/test_gradient_inside.py``): penzai's attention mask value is a model array, so
under ``jax.checkpoint``, under ``jit`` with the model as an argument, or in bfloat16 it is a traced
scalar, whose power of two set the masked logits' common scale to 2^127 (losses NaN); and under
``Checkpointed`` the weight gradient of each MLP's output projection read an activation remat
recomputed for it alone (the projection itself is not recomputed: its output feeds the residual
add), so the recipe ran it in the forward roles (E4M3 for the gradient where the recipe says E5M2;
under NVFP4 an error), and remat's recomputed forward contractions were counted as backward ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from thirdparty_harness import (
    FORMAT_NAMES,
    Case,
    StepResults,
    assert_tree_close,
    check_grad,
    check_update,
    dequantize_tree,
    quantize_tree,
    run_loss,
)

import qformats as qf
import scalify
from scalify import recipes
from scalify.amp._transposes import Transposes

pz = pytest.importorskip("penzai.pz", reason="penzai is in the test extra; without it this suite cannot run")
from penzai.models.transformer import model_parts, sampling_mode  # noqa: E402
from penzai.models.transformer.variants import gpt_neox  # noqa: E402
from penzai.models.transformer.variants import llamalike_common as ll  # noqa: E402
from penzai.toolshed import basic_training, gradient_checkpointing, lora  # noqa: E402

VOCAB = 64


def gemma2_config(**kw):
    return ll.LlamalikeTransformerConfig(
        num_kv_heads=1,
        query_head_multiplier=2,
        embedding_dim=64,
        projection_dim=32,
        mlp_hidden_dim=128,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=True,
        attention_type=(ll.AttentionTypeSlidingWindowCausal(8), ll.AttentionTypeGlobalCausal()),
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        final_logit_softcap=30.0,
        attn_logits_soft_cap=50.0,
        query_scaling_factor=32**-0.5,
        **kw,
    )


def checkpointed(model):
    """Every transformer block under penzai's ``Checkpointed`` (``jax.checkpoint``)."""
    return pz.select(model).at_instances_of(model_parts.TransformerBlock).apply(gradient_checkpointing.Checkpointed)


def gemma2_model():
    return checkpointed(ll.build_llamalike_transformer(gemma2_config(), init_base_rng=jax.random.key(0)))


def neox_model():
    cfg = gpt_neox.GPTNeoXTransformerConfig(
        num_attention_heads=2,
        embedding_dim=64,
        projection_dim=32,
        mlp_hidden_dim=128,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        activation_fn="gelu_exact",
        rope_subset_size=8,
        rope_wavelength=10_000.0,
        layernorm_epsilon=1e-5,
        parameter_dtype=jnp.float32,
        activation_dtype=jnp.float32,
        use_layer_stack=True,
    )
    return gpt_neox.build_gpt_neox_transformer(cfg, init_base_rng=jax.random.key(0))


def llama_bf16_model():
    cfg = ll.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=64,
        projection_dim=32,
        mlp_hidden_dim=128,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
        parameter_dtype=jnp.bfloat16,
        activation_dtype=jnp.bfloat16,
    )
    return ll.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))


def tokens(batch=2, length=33, seed=1):
    data = np.random.default_rng(seed).integers(1, VOCAB, size=(batch, length))
    return pz.nx.wrap(jnp.asarray(data, jnp.int32)).tag("batch", "seq")


def next_token_nll(model, toks):
    """Mean next-token cross-entropy of a penzai ``TransformerLM`` on ``toks`` (batch, seq)."""
    inputs, targets = toks[{"seq": pz.slice[:-1]}], toks[{"seq": pz.slice[1:]}]
    logits = model(inputs).unwrap("batch", "seq", "vocabulary").astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets.unwrap("batch", "seq")[..., None], axis=-1))


def penzai_case(name, model) -> Case:
    """``loss(params, tokens)`` over the model's frozen parameter values, bound inside (penzai's
    own pattern for a JAX transformation)."""
    unbound, params = pz.unbind_params(model)

    def loss(params, toks):
        return next_token_nll(pz.bind_variables(unbound, params), toks)

    return Case(name, loss, pz.freeze_params(params), tokens())


CASES = {"penzai_gemma2_checkpointed": gemma2_model, "penzai_neox_layer_stack": neox_model}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return penzai_case(request.param, CASES[request.param]())


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)


# -- KV-cached decoding ------------------------------------------------------------------------------
def greedy_decoder(cached: sampling_mode.KVCachingTransformerLM, steps: int):
    """penzai's sampling loop (``simple_decoding_loop``) with argmax for the draw, as one function of
    the frozen parameters and cache state: the cache variables are updated in place inside."""
    unbound, variables = pz.unbind_variables(cached)
    params = [v for v in variables if isinstance(v, pz.Parameter)]
    states = [v for v in variables if isinstance(v, pz.StateVariable)]

    def decode(params, states, prompt):
        mutable = [s.unfreeze_as_copy() for s in states]
        model = pz.bind_variables(unbound, [*params, *mutable])
        logits = model(prompt)
        step_logits = [logits[{"seq": -1}]]
        for _ in range(steps):
            token = pz.nx.nmap(jnp.argmax)(step_logits[-1].untag("vocabulary"))
            step_logits.append(model(token[{"seq": None}]).untag("seq").squeeze(0))
        return [s.unwrap("batch", "vocabulary") for s in step_logits], pz.freeze_variables(mutable)

    return decode, pz.freeze_variables(params), pz.freeze_variables(states)


# One 4-bit serving format in the fast lane (packed 4-bit codes, block scales in the cache path);
# the others' decoding repeats its rules and their loss test's.
DECODE_FAST = ("mxfp4",)


@pytest.mark.parametrize(
    "fmt_name", [n if n in DECODE_FAST else pytest.param(n, marks=pytest.mark.slow) for n in FORMAT_NAMES]
)
def test_kv_cached_greedy_decoding(fmt_name):
    """Decoding with formatted weights from a left-padded prompt: every step's logits and the
    cached keys and values within the harness tolerance of float32's on the dequantized weights,
    and the same greedy tokens written to the cache at the same end index."""
    cached = sampling_mode.KVCachingTransformerLM.from_uncached(gemma2_model(), cache_len=48, batch_axes={"batch": 2})
    decode, params, states = greedy_decoder(cached, steps=6)
    prompt = tokens(length=32).unwrap("batch", "seq").at[1, :5].set(cached.pad_id)  # row 1 left-padded
    prompt = pz.nx.wrap(prompt).tag("batch", "seq")
    fmt = qf.get_format(fmt_name)
    qparams = quantize_tree(params, fmt)
    want = jax.jit(decode)(dequantize_tree(qparams), states, prompt)
    got = jax.jit(scalify.scalify(decode))(qparams, states, prompt)
    assert_tree_close(got[0], want[0], fmt, "decoding logits")
    floats = lambda t: [x for x in jax.tree.leaves(dequantize_tree(t)) if jnp.issubdtype(x.dtype, jnp.floating)]
    ints = lambda t: [np.asarray(x) for x in jax.tree.leaves(t) if not jnp.issubdtype(x.dtype, jnp.floating)]
    assert_tree_close(floats(got[1]), floats(want[1]), fmt, "KV caches")
    assert len(ints(want[1])) == 2  # the written tokens and the cache's end index
    for g, w in zip(ints(got[1]), ints(want[1]), strict=True):
        np.testing.assert_array_equal(g, w)


# -- bfloat16 ----------------------------------------------------------------------------------------
# A bfloat16 program rounds its activations to bfloat16 (unit roundoff 2^-9); under scalify the
# same ops round data that differs from the values by powers of two, except where a rule computes
# in float32 (a sum, a softmax), so the two programs differ by bfloat16 roundings: the tolerance is
# one bfloat16 ulp at the largest magnitude, 2^-8, still 16 times below an E4M3 element's 2^-4.
BF16_RTOL_FACTOR = 2.0**-8 / 5e-5


@pytest.mark.parametrize("fmt_name", ["mxfp8", "nvfp4"])
def test_bfloat16_llama_loss(fmt_name):
    case = penzai_case("penzai_llama_bf16", llama_bf16_model())
    fmt, qparams, dparams = case.quantized(fmt_name)
    want = jax.jit(case.loss)(dparams, case.batch)
    got = jax.jit(scalify.scalify(case.loss))(qparams, case.batch)
    assert_tree_close(got, want, fmt, "bfloat16 llama loss", rtol_factor=BF16_RTOL_FACTOR)


# -- penzai's trainer under a training recipe ---------------------------------------------------------
def lora_model():
    """penzai's LoRA tutorial: the base weights frozen into the model (``pz.freeze_params``:
    values, no longer variables), rank-16 adapter parameters on the MLPs' linears (NVFP4's 16x16
    weight tiles need 16), every block checkpointed. The adapters' B start at zero."""
    model = pz.freeze_params(ll.build_llamalike_transformer(gemma2_config(), init_base_rng=jax.random.key(0)))
    mlps = pz.select(model).at_instances_of(model_parts.TransformerFeedForward)
    return checkpointed(lora.loraify_linears_in_selection(mlps, rank=16, init_base_rng=jax.random.key(3)))


def trainer_loss(*, model, state, rng, toks):
    del rng
    return next_token_nll(model, toks), state, {}


def recipe_on_the_loss(recipe):
    """The trainer's loss under the recipe (its custom VJP runs the backward GEMMs): the reference."""

    def loss_fn(*, model, state, rng, toks):
        inner = lambda m, s, r, t: trainer_loss(model=m, state=s, rng=r, toks=t)
        return recipes.apply(inner, recipe)(model, state, rng, toks)

    return loss_fn


def trainer(model, loss_fn, jit=True):
    return basic_training.StatefulTrainer.build(jax.random.key(2), model, optax.adam(1e-2, eps=1e-2), loss_fn, jit=jit)


TRAINER_RECIPES = {"float8_tensorwise": recipes.FLOAT8_TENSORWISE, "nvfp4": recipes.NVFP4}
TRAINER_MODELS = {"gemma2_checkpointed": gemma2_model, "gemma2_lora": lora_model}


def trainable_values(model):
    _, params = pz.unbind_params(model)
    return [np.asarray(p.value.data_array) for p in params]


# NVFP4's step (Hadamard transforms, stochastic rounding, 16x16 tiles) compiles for over a minute
# on 2 cores: the slow lane; the pairing it relies on is the fast lane's under FLOAT8_TENSORWISE, on
# the LoRA model (frozen base, adapters trained). The checkpointed decoder's step repeats those
# rules under penzai's Checkpointed (remat, whose pairing test_gradient_inside holds): slow lane.
TRAINER_FAST = {("float8_tensorwise", "gemma2_lora")}


@pytest.mark.parametrize(
    ("recipe_name", "model_name"),
    [
        pytest.param(r, m, marks=() if (r, m) in TRAINER_FAST else pytest.mark.slow)
        for r in sorted(TRAINER_RECIPES)
        for m in sorted(TRAINER_MODELS)
    ],
)
def test_stateful_trainer_step_under_a_recipe(recipe_name, model_name):
    """``StatefulTrainer``'s step (``jax.grad`` inside, optax's Adam) with one line changed, the
    step function under the recipe, moves the trainable weights as the same trainer whose loss is
    under the recipe: every backward GEMM paired with its forward one and run in its role."""
    recipe = TRAINER_RECIPES[recipe_name]
    toks = tokens()
    model = TRAINER_MODELS[model_name]()
    t = trainer(model, trainer_loss, jit=False)
    step = recipes.apply(t.step_fn, recipe)
    t = dataclasses.replace(t, step_fn=jax.jit(step, static_argnames=("loss_fn", "optimizer_def")))
    with jax.numpy_dtype_promotion("standard"):
        t.step(toks=toks)
    reference = TRAINER_MODELS[model_name]()
    with jax.numpy_dtype_promotion("standard"):
        trainer(reference, recipe_on_the_loss(recipe)).step(toks=toks)
    got, want = trainable_values(model), trainable_values(reference)
    for g, w in zip(got, want, strict=True):
        # two programs XLA compiles apart (their fusions may sum in another order): within 1e-5 of
        # each leaf's largest magnitude; a gradient rounded in the wrong role moves it by 1e-3 and more
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * max(float(np.max(np.abs(w))), 1e-30))
    plain = TRAINER_MODELS[model_name]()
    with jax.numpy_dtype_promotion("standard"):
        trainer(plain, trainer_loss).step(toks=toks)
    assert any(not np.array_equal(g, p) for g, p in zip(got, trainable_values(plain), strict=True)), "recipe is off"


def test_trainer_step_pairs_every_backward_gemm():
    """The trainer's step on the checkpointed LoRA model, as the recipe's walker reads it: every
    contraction JAX's transposition emitted has its forward one (remat's recomputations are
    forward contractions, not counted)."""
    t = trainer(lora_model(), trainer_loss, jit=False)
    stateless, variables = pz.unbind_variables(t.model)
    trainable = tuple(pz.freeze_variables(variables))

    def step(state, trainable, stateless):
        return t.step_fn(
            root_rng=t.root_rng,
            state=state,
            stateless_model=stateless,
            trainable_params=trainable,
            frozen_params=(),
            state_vars=(),
            loss_fn=t.loss_fn,
            optimizer_def=t.optimizer_def,
            kwargs={"toks": tokens()},
        )

    with jax.numpy_dtype_promotion("standard"):
        paired, emitted = Transposes(jax.make_jaxpr(step)(t.state.value, trainable, stateless)).counts
    assert emitted > 0 and paired == emitted, f"{paired} of {emitted} backward GEMMs paired"
