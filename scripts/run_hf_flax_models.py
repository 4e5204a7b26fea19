"""Run Hugging Face transformers' Flax models, unchanged, under ``scalify`` with the weights in each format.

    python scripts/run_hf_flax_models.py                      # pip download transformers (HF_VERSION)
    python scripts/run_hf_flax_models.py --source DIR         # an unpacked transformers wheel with its pins
    python scripts/run_hf_flax_models.py --formats all --markdown
    python scripts/run_hf_flax_models.py --recipes all        # scalify.recipes.apply on the training losses

The models are the ``Flax*`` classes of ``transformers`` 4.57 (the last release line with Flax
models; 5.0 removed them), each built at a tiny configuration (2 layers, width 64, 2 heads of 32,
vocabulary 64) through its public ``*Config``, initialised by the library (``Model(config,
seed=0)``), and called the way their documentation shows: ``model(inputs, params=params)``,
``model.generate(ids, params=params, ...)``. Nothing of them is copied here.

Checks (rows of the table), each the cross-entropy of its task on one random batch, its gradient
and one Adam update (the third-party harness's check and tolerance: every weight the format accepts
becomes a ScaledArray, the reference is float32 on the dequantized weights):

* decoders, next-token prediction: ``llama`` (grouped-query attention: two query heads share one
  key/value head; rotary, SwiGLU, RMSNorm), ``mistral`` (sliding window), ``gemma`` (multi-query,
  tied embedding scaled by sqrt(d)), ``gpt2`` (Conv1D-style transposed kernels), ``gpt_neo`` (local
  and global layers), ``gptj`` (partial rotary, parallel block), ``opt`` and ``bloom`` (ALiBi);
* encoders, masked-token prediction with a padded row (the attention mask): ``bert``, ``roberta``,
  ``albert`` (one layer's weights shared by all, factorised embedding), ``electra``, ``roformer``
  (rotary) and ``big_bird`` (block-sparse attention at 40 tokens: global, sliding and, in
  inference, fixed "random" blocks gathered from the keys);
* encoder-decoders: ``bart`` (padded source) and ``whisper`` (two 1-D convolutions over mel
  features, then the transformer);
* vision: ``vit``, ``beit`` (relative position bias), ``dinov2``, ``regnet`` (grouped
  convolutions), ``resnet`` (``train=True``: BatchNorm on batch statistics, its new running
  statistics returned beside the logits);
* ``clip``: text and vision towers, the symmetric contrastive loss through ``logit_scale``;
* ``wav2vec2``: the convolutional feature encoder, the grouped positional convolution with weight
  normalisation, and ``optax.ctc_loss`` on its logits;
* generation with the library's own ``generate`` (a ``lax.while_loop`` over a key/value cache):
  ``llama_greedy``, ``gpt2_beam`` (beam search, 3 beams) and ``bart_sample`` (top-k sampling from a
  PRNG key, encoder-decoder). The generated tokens must be float32's.

With ``--recipes`` the float32 weights stay as they are and each training loss runs as
``recipes.apply(loss, recipe)`` under ``jax.value_and_grad`` at 32 tokens
(``run_keras_hub_models.check_recipe``); generation is ``n/a`` there.

Not in the table: T5 and LongT5, whose Flax code calls ``jnp.clip(a_max=...)``, a keyword JAX
0.10 removed, so they fail in float32 before any format is involved.

transformers 4.57 checks at import that ``tokenizers`` and ``huggingface_hub`` are within its pins
(current releases are not); the script downloads its wheel with those two (``pip download
--no-deps``) and puts them first on ``sys.path``, leaving the installed packages as they are, so the
tests run it in a subprocess.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_scalify_source import fetch_wheels  # noqa: E402
from run_flax_examples import failure  # noqa: E402
from run_keras_hub_models import check, check_recipe  # noqa: E402
from run_recurrentgemma import run_table  # noqa: E402
from thirdparty_harness import Case, dequantize_tree, n_scaled, quantize_tree  # noqa: E402

import scalify  # noqa: E402

# The versions the figures in docs/examples.md were measured with.
HF_VERSION = "4.57.6"
WHEELS = (f"transformers=={HF_VERSION}", "tokenizers==0.22.2", "huggingface_hub==0.36.2")
BATCH, SEQ, RECIPE_SEQ, VOCAB, WIDTH, IMAGE = 2, 12, 32, 64, 64, 32
# Special tokens for generation; the random batches draw ids from 3 up.
TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "decoder_start_token_id": 2}
NEW_TOKENS = 8


def fetch(work: Path) -> Path:
    """:data:`WHEELS` (``pip download --no-deps``) unpacked under ``work``; the directory to import from."""
    return fetch_wheels(work, WHEELS, "Unpack those wheels into one directory and pass --source DIR.")


def import_transformers(root: Path):
    """``transformers`` imported from ``root``, its deprecation and init notices silenced."""
    for name in ("transformers", "tokenizers", "huggingface_hub"):
        loaded = sys.modules.get(name)
        if loaded is not None and not Path(loaded.__file__).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"{name} is already imported from {loaded.__file__}; run this in a fresh process")
    sys.path.insert(0, str(root))
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _ids(seq: int, seed: int = 3, vocab: int = VOCAB):
    return jnp.asarray(np.random.default_rng(seed).integers(3, vocab, (BATCH, seq)), jnp.int32)


def _padding_mask(seq: int):
    """The first row whole, the second with its last three positions padded."""
    return jnp.asarray(np.arange(seq)[None] < np.array([[seq], [seq - 3]]), jnp.int32)


def _ce(logits, labels, weights=None):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return losses.mean() if weights is None else (losses * weights).sum() / weights.sum()


def _pixels():
    # NCHW, as the Flax vision models take them (they transpose to NHWC inside).
    return jnp.asarray(np.random.default_rng(5).standard_normal((BATCH, 3, IMAGE, IMAGE)), jnp.float32)


# The sizes every text model shares; configs that name them otherwise (GPT-2's ``n_embd``, BLOOM's
# ``n_head``, ...) map these names onto theirs (``PretrainedConfig.attribute_map``). Heads of 32, so
# that the attention's products contract a multiple of MX's block under a recipe.
HEADS = 2
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": WIDTH,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
}
DECODERS = {
    "llama": ("FlaxLlamaForCausalLM", "LlamaConfig", {"num_key_value_heads": 1}),
    "mistral": ("FlaxMistralForCausalLM", "MistralConfig", {"num_key_value_heads": 1, "sliding_window": 8}),
    "gemma": (
        "FlaxGemmaForCausalLM",
        "GemmaConfig",
        {"num_key_value_heads": 1, "head_dim": WIDTH // HEADS, "hidden_activation": "gelu_pytorch_tanh"},
    ),
    "gpt2": ("FlaxGPT2LMHeadModel", "GPT2Config", {}),
    "gpt_neo": (
        "FlaxGPTNeoForCausalLM",
        "GPTNeoConfig",
        # Its config checks the layer types against its own ``num_layers`` before it maps names.
        {"num_layers": 2, "num_heads": HEADS, "attention_types": [[["global", "local"], 1]], "window_size": 8},
    ),
    "gptj": ("FlaxGPTJForCausalLM", "GPTJConfig", {"rotary_dim": 8}),
    "opt": ("FlaxOPTForCausalLM", "OPTConfig", {"ffn_dim": 128, "word_embed_proj_dim": WIDTH}),
    "bloom": ("FlaxBloomForCausalLM", "BloomConfig", {}),
}
ENCODERS = {
    "bert": ("FlaxBertForMaskedLM", "BertConfig", {}),
    "roberta": ("FlaxRobertaForMaskedLM", "RobertaConfig", {}),
    "albert": ("FlaxAlbertForMaskedLM", "AlbertConfig", {"embedding_size": 32}),
    "electra": ("FlaxElectraForMaskedLM", "ElectraConfig", {"embedding_size": 32}),
    "roformer": ("FlaxRoFormerForMaskedLM", "RoFormerConfig", {}),
    "big_bird": (
        "FlaxBigBirdForMaskedLM",
        "BigBirdConfig",
        {"attention_type": "block_sparse", "block_size": 2, "num_random_blocks": 2},
    ),
}
# Block-sparse attention needs more than (5 + 2 * random blocks) * block size tokens.
ENCODER_SEQ = {"big_bird": 40}
VIT = {
    "image_size": IMAGE,
    "patch_size": 8,
    **{k: TEXT[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")},
}
VISION = {
    "vit": ("FlaxViTForImageClassification", "ViTConfig", {**VIT, "intermediate_size": 128}),
    "beit": (
        "FlaxBeitForImageClassification",
        "BeitConfig",
        {**VIT, "intermediate_size": 128, "use_relative_position_bias": True},
    ),
    "dinov2": ("FlaxDinov2ForImageClassification", "Dinov2Config", {**VIT, "mlp_ratio": 2}),
    "regnet": (
        "FlaxRegNetForImageClassification",
        "RegNetConfig",
        {"embedding_size": 16, "hidden_sizes": [32, 64], "depths": [1, 1], "groups_width": 8},
    ),
    "resnet": (
        "FlaxResNetForImageClassification",
        "ResNetConfig",
        {"embedding_size": 16, "hidden_sizes": [32, 64], "depths": [1, 1]},
    ),
}
LABELS = 5


def _model(hf, spec, **kwargs):
    cls, config, extra = spec
    return getattr(hf, cls)(getattr(hf, config)(**{**kwargs, **extra}), seed=0)


def decoder(hf, name: str, seq: int = SEQ) -> Case:
    """Next-token cross-entropy."""
    model = _model(hf, DECODERS[name], **TEXT, **TOKENS)

    def loss(params, tokens):
        logits = model(tokens, params=params).logits
        return _ce(logits[:, :-1], tokens[:, 1:])

    return Case(name, loss, model.params, _ids(seq))


def encoder(hf, name: str, seq: int = SEQ) -> Case:
    """Cross-entropy of recovering every unpadded token, the second row padded."""
    model = _model(hf, ENCODERS[name], **TEXT)
    seq = max(seq, ENCODER_SEQ.get(name, 0))

    def loss(params, batch):
        tokens, mask = batch
        return _ce(model(tokens, attention_mask=mask, params=params).logits, tokens, mask)

    return Case(name, loss, model.params, (_ids(seq), _padding_mask(seq)))


def vision(hf, name: str, seq: int = SEQ) -> Case:
    """Image classification; ``resnet`` in training mode (batch statistics, running ones returned)."""
    model = _model(hf, VISION[name], num_labels=LABELS)
    train = {"train": True} if name == "resnet" else {}

    def loss(params, batch):
        pixels, labels = batch
        out = model(pixels, params=params, **train)
        if train:  # (outputs, {"batch_stats": ...}): the new statistics are part of what the step computes
            out, state = out
            return _ce(out.logits, labels) + 0.0 * sum(s.sum() for s in jax.tree.leaves(state))
        return _ce(out.logits, labels)

    return Case(name, loss, model.params, (_pixels(), jnp.asarray([1, 3])))


BART = ("FlaxBartForConditionalGeneration", "BartConfig", {"forced_eos_token_id": None})
BART_SIZES = {
    "vocab_size": VOCAB,
    "d_model": WIDTH,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 64,
}


def bart(hf, name: str, seq: int = SEQ) -> Case:
    """Next-token cross-entropy of the decoder over a padded source."""
    model = _model(hf, BART, **BART_SIZES, **TOKENS)

    def loss(params, batch):
        source, mask, target = batch
        logits = model(source, attention_mask=mask, decoder_input_ids=target, params=params).logits
        return _ce(logits[:, :-1], target[:, 1:])

    return Case(name, loss, model.params, (_ids(seq), _padding_mask(seq), _ids(seq, seed=4)))


MELS, FRAMES = 16, 64


def whisper(hf, name: str, seq: int = SEQ) -> Case:
    """Next-token cross-entropy of the decoder over log-mel features."""
    sizes = {k: v for k, v in BART_SIZES.items() if k != "max_position_embeddings"}
    config = hf.WhisperConfig(**sizes, num_mel_bins=MELS, max_source_positions=FRAMES // 2, max_target_positions=64)
    model = hf.FlaxWhisperForConditionalGeneration(config, seed=0)
    features = jnp.asarray(np.random.default_rng(6).standard_normal((BATCH, MELS, FRAMES)), jnp.float32)

    def loss(params, batch):
        features, target = batch
        logits = model(features, decoder_input_ids=target, params=params).logits
        return _ce(logits[:, :-1], target[:, 1:])

    return Case(name, loss, model.params, (features, _ids(seq, seed=4)))


def clip(hf, name: str, seq: int = SEQ) -> Case:
    """CLIP's symmetric contrastive loss (image-to-text and text-to-image cross-entropy)."""
    tower = {k: TEXT[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")}
    config = hf.CLIPConfig(
        text_config={**tower, "vocab_size": VOCAB, "max_position_embeddings": 64},
        vision_config={**tower, "image_size": IMAGE, "patch_size": 8},
        projection_dim=32,
    )
    model = hf.FlaxCLIPModel(config, seed=0)

    def loss(params, batch):
        tokens, pixels = batch
        logits = model(input_ids=tokens, pixel_values=pixels, params=params).logits_per_image
        pairs = jnp.arange(BATCH)
        return _ce(logits, pairs) + _ce(logits.T, pairs)

    return Case(name, loss, model.params, (_ids(seq), _pixels()))


def wav2vec2(hf, name: str, seq: int = SEQ) -> Case:
    """CTC loss (``optax.ctc_loss``, blank 0) of 10 labels over 800 samples of audio, per label."""
    config = hf.Wav2Vec2Config(
        **{k: TEXT[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")},
        vocab_size=32,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    )
    model = hf.FlaxWav2Vec2ForCTC(config, seed=0)
    audio = jnp.asarray(np.random.default_rng(7).standard_normal((BATCH, 800)), jnp.float32)

    def loss(params, batch):
        audio, labels = batch
        logits = model(audio, params=params).logits
        no_padding = jnp.zeros(logits.shape[:2])
        # Per label, as transformers' ``ctc_loss_reduction="mean"``: the summed loss (228 nats here)
        # has gradients up to 50, whose float32 rounding alone (1.2e-4, against float64) moves an Adam
        # step by more than the harness's bound, which is relative to the weights (docs/examples.md).
        return optax.ctc_loss(logits, no_padding, labels, jnp.zeros(labels.shape)).mean() / labels.shape[1]

    return Case(name, loss, model.params, (audio, _ids(10, vocab=32)))


BUILDERS = {
    **dict.fromkeys(DECODERS, decoder),
    **dict.fromkeys(ENCODERS, encoder),
    "bart": bart,
    "whisper": whisper,
    **dict.fromkeys(VISION, vision),
    "clip": clip,
    "wav2vec2": wav2vec2,
}
# name -> (model builder, generate() keywords)
GENERATE = {
    "llama_greedy": ("llama", {}),
    "gpt2_beam": ("gpt2", {"num_beams": 3}),
    "bart_sample": ("bart", {"do_sample": True, "top_k": 10, "prng_key": jax.random.PRNGKey(1)}),
}
CHECKS = (*BUILDERS, *GENERATE)


def build(hf, name: str, seq: int = SEQ) -> Case:
    return BUILDERS[name](hf, name, seq)


def generator(hf, name: str):
    """``(model, fn(params, prompt) -> generated sequences)`` of a :data:`GENERATE` check."""
    base, kwargs = GENERATE[name]
    model = _model(hf, BART, **BART_SIZES, **TOKENS) if base == "bart" else _model(hf, DECODERS[base], **TEXT, **TOKENS)

    def generate(params, prompt):
        return model.generate(prompt, params=params, max_new_tokens=NEW_TOKENS, **kwargs).sequences

    return model, generate


def check_generate(hf, name: str, fmt) -> tuple[str, str]:
    """``(outcome, detail)`` of ``jit(scalify(generate))`` with the weights in ``fmt`` against float32's."""
    model, generate = generator(hf, name)
    qparams = quantize_tree(model.params, fmt)
    if n_scaled(qparams) == 0:
        return "n/a", f"no weight has a shape {fmt.name} accepts"
    prompt = _ids(6)
    try:
        expected = np.asarray(jax.jit(generate)(dequantize_tree(qparams), prompt))
        got = np.asarray(jax.jit(scalify.scalify(generate))(qparams, prompt))
        assert got.shape == expected.shape, f"shape {got.shape} under {fmt.name}, {expected.shape} in float32"
        assert np.array_equal(got, expected), f"tokens\n{got}\nunder {fmt.name},\n{expected}\nin float32"
    except Exception as exc:  # reported per format; the run goes on
        return failure(exc)
    return "ok", f"{got.size} tokens as float32's, {n_scaled(qparams)} weights scaled"


def run_check(hf, name: str, column, recipe_run: bool) -> tuple[str, str]:
    if name in GENERATE:
        return ("n/a", "a recipe quantizes a training step's GEMMs") if recipe_run else check_generate(hf, name, column)
    try:
        case = build(hf, name, seq=RECIPE_SEQ if recipe_run else SEQ)
    except Exception as exc:  # a model the library cannot build is a row of its own
        return failure(exc)
    return check_recipe(case, column) if recipe_run else check(case, column)


def main(argv=None) -> int:
    this = types.SimpleNamespace(
        __doc__=__doc__, package="transformers", version=HF_VERSION, fetch=fetch, load=import_transformers
    )
    return run_table(this, 14, CHECKS, run_check, argv)


if __name__ == "__main__":
    sys.exit(main())
