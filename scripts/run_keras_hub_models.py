"""Run KerasHub's model code, unchanged, under ``scalify`` with the weights in each format.

    python scripts/run_keras_hub_models.py                    # pip download the keras-hub wheel (KERAS_HUB_VERSION)
    python scripts/run_keras_hub_models.py --source DIR       # an unpacked keras-hub wheel or a git clone
    python scripts/run_keras_hub_models.py --only gemma,mixtral --formats all --markdown
    python scripts/run_keras_hub_models.py --recipes all      # scalify.recipes.apply instead of scalify
    python scripts/run_keras_hub_models.py --recipes mxfp8 --only gpt_oss --high-precision-scopes router
    python scripts/run_keras_hub_models.py --recipes nvfp4 --only smollm3 --weights-only   # linear layers only

The models are KerasHub's own task models (``GemmaCausalLM``, ``Llama3CausalLM``, ``MixtralCausalLM``,
``BertClassifier``, ``ResNetImageClassifier``, ...): Google's Keras team's implementations of the
architectures people fine-tune and serve, with their own layers, initialisers, masks, rotary
embeddings (partial in GPT-NeoX, absent in SmolLM3's NoPE layers), ALiBi, soft-capping,
mixture-of-experts routers (with a shared expert in Qwen-MoE), recurrences (RWKV-7, Qwen 3.5's gated
delta rule), Fourier mixing (F-Net), relative-position attention (DeBERTa-v3), shared layers (ALBERT),
shifted-window attention (Swin), spatially reduced attention (MiT), depthwise and separable
convolutions with squeeze-and-excite (EfficientNet, MobileNet, Xception) and BatchNorm. Each is built at a tiny
configuration (2 layers, width 64) through its public constructor and called as any JAX user of
Keras calls it, ``model.stateless_call(trainable, non_trainable, inputs)``; nothing of KerasHub is
copied into this repository or changed.

KerasHub's wheel is fetched with ``pip download --no-deps`` into a temporary directory and put on
``sys.path``: its declared dependency on ``tensorflow-text`` (through it, TensorFlow) is for its
tokenizers' data pipelines, which no model call touches, and ``keras_hub`` imports without it
(``tokenizers``, which it imports eagerly, is in the test extra).

The check per (model, format) is the third-party harness's (``tests/thirdparty/thirdparty_harness.py``):
weights whose shape the format accepts become ScaledArrays; the reference is the same program in
float32 on the dequantized weights; the loss, its gradient and one Adam update (moments and
parameters) must agree leaf by leaf within the harness's tolerance, which is below a quarter of the
format's unit roundoff, so an intermediate silently rounded to the format would fail. ``n/a``: no
weight of the model has a shape the format accepts.

With ``--recipes`` the float32 weights stay as they are and the loss runs as
``recipes.apply(loss, recipe)`` under ``jax.value_and_grad`` on 32 tokens (``check_recipe``): the
all-high-precision recipe (``high``) must reproduce float32's loss and gradient, and each built-in
recipe must give a finite loss and a gradient pointing the way float32's does (cosine floor per
element width, ``RECIPE_COSINE_FLOOR``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_scalify_source import fetch_wheels  # noqa: E402
from run_flax_examples import failure, parse_cli, pop_option, summary  # noqa: E402
from thirdparty_harness import Case, assert_tree_close, n_scaled, quantize_tree, run_step  # noqa: E402

# The version the figures in docs/examples.md were measured with (KerasHub changes its models' code).
KERAS_HUB_VERSION = "0.32.0"
VOCAB, SEQ, BATCH, CLASSES = 64, 8, 2, 10
MAX_SEQ = 64  # position tables of GPT-2 and BERT
TINY_LM = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=64, intermediate_dim=128)


def fetch_keras_hub(work: Path, version: str = KERAS_HUB_VERSION) -> Path:
    """The keras-hub wheel (``pip download --no-deps``) unpacked under ``work``; the directory to import from."""
    hint = "Unpack a keras-hub wheel (or clone https://github.com/keras-team/keras-hub) and pass --source DIR."
    return fetch_wheels(work, [f"keras-hub=={version}"], hint)


def import_keras_hub(root: Path):
    """``keras_hub`` imported from ``root`` (a keras version it does not support fails here, by name)."""
    sys.path.insert(0, str(root))
    import keras_hub

    return keras_hub


def _case(hub, name, backbone, task, config, inputs, labels, **task_args) -> Case:
    """Cross-entropy of ``task(backbone(**config), preprocessor=None, **task_args)`` on one batch,
    a pure function of the trainable weights through ``stateless_call``."""
    import keras

    keras.utils.set_random_seed(5)
    model = getattr(hub.models, task)(backbone=getattr(hub.models, backbone)(**config), preprocessor=None, **task_args)
    if isinstance(inputs, dict):  # the inputs the backbone declares (F-Net has no padding mask, DeBERTa no segments)
        inputs = {k: v for k, v in inputs.items() if k in model.backbone.input}
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(trainable, batch):
        inputs, labels = batch
        logits, _ = model.stateless_call(trainable, non_trainable, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()

    return Case(name, loss, trainable, (inputs, labels))


def _rng(seed=5):
    return np.random.default_rng(seed)


def causal_lm(hub, name: str, backbone: str, task: str, seq: int = SEQ, **config) -> Case:
    """Next-token cross-entropy of a causal LM on random tokens."""
    tokens = jnp.asarray(_rng().integers(0, VOCAB, (BATCH, seq + 1)), jnp.int32)
    inputs = {"token_ids": tokens[:, :-1], "padding_mask": jnp.ones((BATCH, seq), jnp.int32)}
    return _case(hub, name, backbone, task, config, inputs, tokens[:, 1:])


def text_classifier(hub, name: str, backbone: str, task: str, seq: int = SEQ, **config) -> Case:
    """Cross-entropy of a sequence classifier (token, segment ids and a padding mask with padding)."""
    padding = np.ones((BATCH, seq), np.int32)
    padding[1, seq - 3 :] = 0  # the second sequence is padded: the attention mask is exercised
    inputs = {
        "token_ids": jnp.asarray(_rng().integers(0, VOCAB, (BATCH, seq)), jnp.int32),
        "segment_ids": jnp.zeros((BATCH, seq), jnp.int32),
        "padding_mask": jnp.asarray(padding),
    }
    labels = jnp.asarray(_rng(6).integers(0, CLASSES, BATCH), jnp.int32)
    return _case(hub, name, backbone, task, config, inputs, labels, num_classes=CLASSES)


def image_classifier(hub, name: str, backbone: str, task: str, seq: int = SEQ, **config) -> Case:
    """Cross-entropy of an image classifier on random 32x32 RGB images (BatchNorm in inference mode;
    ``seq`` is unused)."""
    del seq
    images = jnp.asarray(_rng().standard_normal((BATCH, 32, 32, 3)), jnp.float32)
    labels = jnp.asarray(_rng(6).integers(0, CLASSES, BATCH), jnp.int32)
    return _case(hub, name, backbone, task, config, images, labels, num_classes=CLASSES)


# name -> (builder, backbone, task, config). Heads of 32 and widths that are multiples of 32, so the
# MX and NVFP4 layouts accept the projections (the harness leaves other shapes in float32).
MODELS = {
    "gemma": (causal_lm, "GemmaBackbone", "GemmaCausalLM",
              dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, head_dim=32)),
    "gemma3": (causal_lm, "Gemma3Backbone", "Gemma3CausalLM",
               dict(TINY_LM, image_size=32, num_query_heads=2, num_key_value_heads=1, head_dim=32,
                    use_post_ffw_norm=True, use_post_attention_norm=True, attention_logit_soft_cap=50.0,
                    final_logit_soft_cap=30.0, use_sliding_window_attention=True, sliding_window_size=4)),
    "llama3": (causal_lm, "Llama3Backbone", "Llama3CausalLM",
               dict(TINY_LM, num_query_heads=2, num_key_value_heads=1)),
    "mistral": (causal_lm, "MistralBackbone", "MistralCausalLM",
                dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, sliding_window=4)),
    "qwen3": (causal_lm, "Qwen3Backbone", "Qwen3CausalLM",
              dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, head_dim=32)),
    "phi3": (causal_lm, "Phi3Backbone", "Phi3CausalLM",
             dict(TINY_LM, num_query_heads=2, num_key_value_heads=1)),
    "gpt2": (causal_lm, "GPT2Backbone", "GPT2CausalLM",
             dict(TINY_LM, num_heads=2, max_sequence_length=MAX_SEQ)),
    "mixtral": (causal_lm, "MixtralBackbone", "MixtralCausalLM",
                dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, num_experts=4, top_k=2)),
    "qwen3_moe": (causal_lm, "Qwen3MoeBackbone", "Qwen3MoeCausalLM",
                  dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, head_dim=32, moe_intermediate_dim=64,
                       num_experts=4, top_k=2)),
    "gpt_oss": (causal_lm, "GptOssBackbone", "GptOssCausalLM",
                dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, top_k=2,
                     sliding_window=4)),
    "bloom": (causal_lm, "BloomBackbone", "BloomCausalLM", dict(TINY_LM, num_heads=2)),
    "falcon": (causal_lm, "FalconBackbone", "FalconCausalLM", dict(TINY_LM, num_attention_heads=2)),
    "rwkv7": (causal_lm, "RWKV7Backbone", "RWKV7CausalLM",
              dict(vocabulary_size=VOCAB, num_layers=2, hidden_size=64, head_size=32, intermediate_dim=128,
                   gate_lora=32, mv_lora=32, aaa_lora=32, decay_lora=32)),
    "qwen3_5": (causal_lm, "Qwen3_5Backbone", "Qwen3_5CausalLM",
                dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, head_dim=32,
                     layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                     linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32)),
    "gpt_neo_x": (causal_lm, "GPTNeoXBackbone", "GPTNeoXCausalLM",
                  dict(TINY_LM, num_heads=2, max_sequence_length=MAX_SEQ)),
    "smollm3": (causal_lm, "SmolLM3Backbone", "SmolLM3CausalLM",
                dict(vocabulary_size=VOCAB, hidden_dim=64, intermediate_dim=128, num_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, attention_bias=False, attention_dropout=0.0,
                     rope_layer_enabled_list=[True, False], layer_types=["full_attention"] * 2, mlp_bias=False,
                     layer_norm_epsilon=1e-6, max_position_embeddings=MAX_SEQ, rope_theta=10000.0,
                     partial_rotary_factor=1.0)),
    "qwen_moe": (causal_lm, "QwenMoeBackbone", "QwenMoeCausalLM",
                 dict(TINY_LM, num_query_heads=2, num_key_value_heads=1, moe_intermediate_dim=64,
                      shared_expert_intermediate_dim=128, num_experts=4, top_k=2)),
    "bert": (text_classifier, "BertBackbone", "BertClassifier",
             dict(TINY_LM, num_heads=2, max_sequence_length=MAX_SEQ)),
    "deberta_v3": (text_classifier, "DebertaV3Backbone", "DebertaV3TextClassifier",
                   dict(TINY_LM, num_heads=2, max_sequence_length=MAX_SEQ, bucket_size=16)),
    "f_net": (text_classifier, "FNetBackbone", "FNetTextClassifier", dict(TINY_LM, max_sequence_length=MAX_SEQ)),
    "albert": (text_classifier, "AlbertBackbone", "AlbertTextClassifier",
               dict(TINY_LM, num_heads=2, embedding_dim=32, max_sequence_length=MAX_SEQ)),
    "vit": (image_classifier, "ViTBackbone", "ViTImageClassifier",
            dict(image_shape=(32, 32, 3), patch_size=8, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128)),
    "resnet": (image_classifier, "ResNetBackbone", "ResNetImageClassifier",
               dict(input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 64],
                    stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
                    image_shape=(32, 32, 3))),
    "densenet": (image_classifier, "DenseNetBackbone", "DenseNetImageClassifier",
                 dict(stackwise_num_repeats=[1, 1], image_shape=(32, 32, 3))),
    "swin": (image_classifier, "SwinTransformerBackbone", "SwinTransformerImageClassifier",
             dict(image_shape=(32, 32, 3), embed_dim=32, depths=[2, 2], num_heads=[1, 2], window_size=4,
                  patch_size=4, drop_path=0.0)),
    "mit": (image_classifier, "MiTBackbone", "MiTImageClassifier",
            dict(layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2], layerwise_sr_ratios=[2, 1],
                 max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2],
                 image_shape=(32, 32, 3), hidden_dims=[32, 64])),
    "efficientnet": (image_classifier, "EfficientNetBackbone", "EfficientNetImageClassifier",
                     dict(stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
                          stackwise_input_filters=[32, 32], stackwise_output_filters=[32, 64],
                          stackwise_expansion_ratios=[1, 4], stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
                          stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
                          stackwise_force_input_filters=[0, 0], stackwise_nores_option=[False, False],
                          stackwise_width_coefficients=[1.0, 1.0], stackwise_depth_coefficients=[1.0, 1.0],
                          input_shape=(32, 32, 3), num_features=64, dropout=0.0)),
    "mobilenet": (image_classifier, "MobileNetBackbone", "MobileNetImageClassifier",
                  dict(stackwise_expansion=[[64], [128, 128]], stackwise_num_blocks=[1, 2],
                       stackwise_num_filters=[[32], [32, 32]], stackwise_kernel_size=[[3], [3, 3]],
                       stackwise_num_strides=[[2], [1, 1]], stackwise_se_ratio=[[None], [0.25, 0.25]],
                       stackwise_activation=[["relu"], ["hard_swish", "hard_swish"]], stackwise_padding=[[1], [1, 1]],
                       output_num_filters=64, input_activation="hard_swish", output_activation="hard_swish",
                       input_num_filters=32, image_shape=(32, 32, 3), depthwise_filters=32, squeeze_and_excite=0.5,
                       depthwise_stride=1, depthwise_residual=False, last_layer_filter=64)),
    "xception": (image_classifier, "XceptionBackbone", "XceptionImageClassifier",
                 dict(stackwise_conv_filters=[[32, 64], [64, 64]], stackwise_pooling=[True, False],
                      image_shape=(32, 32, 3))),
}  # fmt: skip


def build(hub, name: str, seq: int = SEQ) -> Case:
    """The model ``name`` of :data:`MODELS` with a batch of ``seq`` tokens (images: 32x32)."""
    builder, backbone, task, config = MODELS[name]
    return builder(hub, name, backbone, task, seq=seq, **config)


def check(case: Case, fmt) -> tuple[str, str]:
    """``(outcome, detail)`` of the loss, gradient and Adam update of ``case`` under ``fmt``."""
    if n_scaled(quantize_tree(case.params, fmt)) == 0:
        return "n/a", f"no weight has a shape {fmt.name} accepts"
    try:
        # One compiled step serves all four checks: its value is the loss (a separate forward-only
        # program cost as much again; the third-party suites run that one per format).
        fmt, got, expected = run_step(case, fmt.name)
        for i, what in enumerate(("value", "gradient", "Adam-updated weights", "Adam state")):
            assert_tree_close(got[i], expected[i], fmt, f"{case.name} {what}")
    except Exception as exc:  # reported per (model, format); the run goes on
        return failure(exc)
    return "ok", f"{n_scaled(case.quantized(fmt.name)[1])} of {len(jax.tree.leaves(case.params))} weights scaled"


# --recipes: a block recipe blocks attention's products and the weight gradients along the
# sequence, so these runs use 32 tokens (a multiple of MX's block of 32 and of NVFP4's tiles of 16).
RECIPE_SEQ = 32
# Cosine between the recipe's gradient (all weights, flattened) and float32's. A loose detector of a
# GEMM computed wrongly, not a precision claim: 8-bit elements round each operand to ~2**-4
# relative, 4-bit ones to ~2**-2, and a mixture of experts routes some tokens to other experts once
# its router logits move (measured: 0.965 to 0.997 for 8-bit recipes, 0.89 for NVFP4 on Gemma; see
# docs/examples.md).
RECIPE_COSINE_FLOOR = {8: 0.95, 4: 0.8}


def _flat(tree):
    import jax

    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)])


def cosine_floor(recipe):
    """:data:`RECIPE_COSINE_FLOOR` for ``recipe``'s narrowest element, or None when every role is in
    high precision (then the program must be float32's, to rounding)."""
    from scalify import recipes

    formats = [f for f in (recipe.format_of(role) for role in recipes.ROLES) if f is not None]
    return RECIPE_COSINE_FLOOR[4 if min(f.element.bits for f in formats) <= 4 else 8] if formats else None


def cosine(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def recipe_outcome(run) -> tuple[str, str]:
    """``(outcome, detail)`` of a recipe check ``run() -> (cosine, detail, floor)``: ``ok`` above the
    floor (or with no floor: ``run`` has compared with float32 itself), ``FAIL`` below it or on an
    error; ``refused`` on the recipe's own error for a contraction its formats cannot block (a width
    of 3), which names the contraction and the fixes: what a user sees, not a wrong value."""
    try:
        c, detail, floor = run()
    except ValueError as exc:
        if "cannot quantize" not in str(exc):
            return failure(exc)
        return "refused", str(exc).split(":")[0]
    except Exception as exc:  # reported per example and recipe (traceback on stderr), not raised
        return failure(exc)
    if floor is None:
        return "ok", detail
    return ("ok" if c > floor else "FAIL"), f"{detail} (floor {floor})"


def check_recipe(case: Case, recipe) -> tuple[str, str]:
    """``(outcome, detail)`` of ``recipes.apply(loss, recipe)`` under ``jax.value_and_grad``.

    The all-high-precision recipe must reproduce float32's loss and gradient (the walk preserves
    the program); a built-in one must give finite values and a gradient whose cosine with float32's
    is above :data:`RECIPE_COSINE_FLOOR` for its narrowest element.
    """
    import jax

    from scalify import recipes

    try:
        ref_value, ref_grad = jax.jit(jax.value_and_grad(case.loss))(case.params, case.batch)
        value, grad = jax.jit(jax.value_and_grad(recipes.apply(case.loss, recipe)))(case.params, case.batch)
        g, r = _flat(grad), _flat(ref_grad)
        if not (np.isfinite(g).all() and np.isfinite(float(value))):
            return "FAIL", f"non-finite loss or gradient under {recipe.name}"
        c = cosine(g, r)
        detail = f"loss {float(value):.4f} (float32 {float(ref_value):.4f}), gradient cosine {c:.4f}"
        floor = cosine_floor(recipe)
        if floor is None:
            np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.max(np.abs(r)))
            return "ok", detail
        return ("ok" if c > floor else "FAIL"), detail + f" (floor {floor})"
    except Exception as exc:  # reported per (model, recipe); the run goes on
        return failure(exc)


def _recipes_arg(argv):
    """``(recipe names or None, options for :func:`recipe`, the other arguments)``: ``--recipes
    all|a,b`` switches to recipe runs, ``--high-precision-scopes a,b`` sets every recipe's
    ``high_precision_scopes``, ``--weights-only`` its ``weights_only``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    value = pop_option(argv, "--recipes", "'all' or comma-separated built-in recipe names")
    scopes = pop_option(argv, "--high-precision-scopes", "comma-separated jax.named_scope names")
    weights_only = "--weights-only" in argv
    if weights_only:
        argv.remove("--weights-only")
    if value is None:
        if scopes is not None or weights_only:
            raise SystemExit("--high-precision-scopes and --weights-only apply to recipe runs: add --recipes")
        return None, {}, argv
    from scalify import recipes

    names = ["high", *sorted(recipes.BUILTINS)] if value == "all" else value.split(",")
    unknown = [n for n in names if n != "high" and n not in recipes.BUILTINS]
    if unknown:
        raise SystemExit(f"unknown recipe(s) {unknown}; choose from {sorted(recipes.BUILTINS)}, 'high' or 'all'")
    options = {"high_precision_scopes": tuple(scopes.split(",")) if scopes else (), "weights_only": weights_only}
    return names, options, argv


def recipe(name, high_precision_scopes=(), weights_only=False):
    """A built-in recipe by name, or ``"high"`` (every role in high precision), keeping the
    contractions under ``high_precision_scopes`` (and, with ``weights_only``, every product of two
    activations) in the program's precision."""
    from scalify import recipes

    r = recipes.Recipe.uniform("high", None) if name == "high" else recipes.BUILTINS[name]
    return r.replace(
        high_precision_scopes=r.high_precision_scopes + tuple(high_precision_scopes), weights_only=weights_only
    )


def main(argv=None) -> int:
    recipe_names, options, argv = _recipes_arg(argv)
    args, names, formats = parse_cli(__doc__, MODELS, "keras-hub", argv)
    with tempfile.TemporaryDirectory(prefix="keras_hub_") as tmp:
        root = args.source.resolve() if args.source else fetch_keras_hub(Path(tmp))
        hub = import_keras_hub(root)
        print(f"keras-hub {hub.__version__} from {root.name}")
        rows = []
        for name in names:
            case = build(hub, name, seq=RECIPE_SEQ if recipe_names else SEQ)
            for column in recipe_names or formats:
                if recipe_names:
                    label, (outcome, detail) = column, check_recipe(case, recipe(column, **options))
                else:
                    label, (outcome, detail) = column.name, check(case, column)
                rows.append((name, label, outcome, detail))
                print(f"{name:12s} {label:18s} {outcome:5s} {detail}", flush=True)
    columns = [types.SimpleNamespace(name=r) for r in recipe_names] if recipe_names else formats
    return summary(rows, names, columns, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
