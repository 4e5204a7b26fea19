"""Run Google DeepMind's ``gemma`` library (``gm.nn.Transformer``, Gemma 3), unchanged, under ``scalify``.

    python scripts/run_gemma_library.py                       # pip download the gemma wheels (GEMMA_VERSION)
    python scripts/run_gemma_library.py --source DIR          # a directory holding gemma and its dependencies
    python scripts/run_gemma_library.py --formats all --markdown
    python scripts/run_gemma_library.py --recipes all --only gemma3

The model is the ``Transformer`` of ``gemma.gm.nn``, the flax implementation behind Google
DeepMind's Gemma 3 checkpoints, built at a tiny Gemma 3 configuration through its public
``TransformerConfig``: a sliding-window layer (window 4, RoPE base 10k) and a global layer (RoPE base
1M), grouped-query attention with one key/value head and QK-norm, pre- and post-norms around
attention and MLP (RMSNorm with a ``1 + scale`` gain), the transposed gated-GELU einsum, a tied
embedding read-out; width 64, vocabulary 64. Nothing of it is copied here.

Checks (rows of the table):

* ``gemma3``: next-token cross-entropy, its gradient and one Adam update with every weight the
  format accepts as a ScaledArray, against float32 on the dequantized weights (the third-party
  harness's check and tolerance).
* ``gemma3_qlora``: QLoRA with the library's own LoRA (``gm.nn.LoRA(rank=4)``, adapters on every
  einsum): the frozen base weights in the format, the adapters in float32; the loss, its gradient
  with respect to the adapters and one Adam update of them (``gemma.peft.split_params`` and
  ``merge_params`` split and join the two trees, as the library's fine-tuning recipe does).
* ``gemma3_decode``: a prompt of 6 tokens prefilled into the library's key/value cache
  (``TransformerConfig.init_cache``) with ``return_last_only=True``, then 8 greedy steps that feed
  the cache back with a position and a mask over the cache, as ``gm.text.Sampler``'s loop does;
  each step is ``jax.jit(scalify.scalify(step))``, the cache a dict of ScaledArrays between steps.
  The tokens must be float32's and every step's logits within the harness's tolerance.

With ``--recipes`` the float32 weights stay as they are and the loss on 32 tokens runs as
``recipes.apply(loss, recipe)`` under ``jax.value_and_grad`` (``run_keras_hub_models.check_recipe``).

The library's declared dependencies include kauldron's training stack (TensorFlow, TFDS, grain,
...), which no model call touches. The script downloads the wheels the model's modules import
(:data:`WHEELS`, ``pip download --no-deps``), puts them first on ``sys.path``, and stands in for the
one TensorFlow name ``kauldron.typing`` reads at import (``tf.Tensor``, a type of its array
aliases) when TensorFlow is not installed. kauldron's typeguard 4 and recurrentgemma's typeguard 2
cannot share a process: the tests run this script in a subprocess.
"""

from __future__ import annotations

import importlib.util
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
from thirdparty_harness import (  # noqa: E402
    Case,
    assert_tree_close,
    dequantize_tree,
    make_optimizer,
    n_scaled,
    quantize_tree,
)

import scalify  # noqa: E402

# The versions the figures in docs/examples.md were measured with (gemma 4 needs Python 3.12).
GEMMA_VERSION = "3.3.0"
WHEELS = (
    f"gemma=={GEMMA_VERSION}",
    "kauldron==1.4.2",
    "typeguard==4.6.1",
    "einops==0.8.2",
    "sentencepiece==0.2.3",
    "chex==0.1.92",
    "clu==0.0.12",
    "lark==1.3.1",
    "ml_collections==1.1.0",
    "immutabledict==4.3.1",
    "toolz==1.2.0",
)
SEQ, RECIPE_SEQ, BATCH = 12, 32, 2
PROMPT, DECODE_STEPS, CACHE = 6, 8, 16
CHECKS = ("gemma3", "gemma3_decode", "gemma3_qlora")


def fetch(work: Path) -> Path:
    """:data:`WHEELS` (``pip download --no-deps``) unpacked under ``work``; the directory to import from."""
    hint = "Unpack those wheels into one directory and pass --source DIR."
    return fetch_wheels(work, WHEELS, hint)


def import_gemma(root: Path):
    """``gemma.gm.nn``'s transformer modules, imported from ``root``."""
    if importlib.util.find_spec("tensorflow") is None:
        tf = types.ModuleType("tensorflow")
        tf.Tensor = type("Tensor", (), {"__module__": "tensorflow"})  # never instantiated: no tensor reaches it
        sys.modules["tensorflow"] = tf
    sys.path.insert(0, str(root))
    from gemma import peft
    from gemma.gm.nn import _config, _lora, _modules, _transformer

    return types.SimpleNamespace(config=_config, modules=_modules, transformer=_transformer, lora=_lora, peft=peft)


def gemma3(lib):
    """A tiny Gemma 3: one sliding-window and one global layer, width 64, float32."""
    kinds = lib.modules.AttentionType
    config = lib.config.TransformerConfig(
        num_embed=64,
        embed_dim=64,
        hidden_dim=128,
        num_heads=2,
        head_dim=32,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=(kinds.LOCAL_SLIDING, kinds.GLOBAL),
        sliding_window_size=4,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
    )
    return lib.transformer.Transformer(config=config, dtype=jnp.float32)


def _tokens(seq: int, seed: int = 3):
    # Ids from 3: 0 is the library's padding id (masked out of the attention).
    return jnp.asarray(np.random.default_rng(seed).integers(3, 64, (BATCH, seq)), jnp.int32)


def build(lib, seq: int = SEQ) -> Case:
    """Next-token cross-entropy of the Gemma 3 transformer on one batch, a function of its weights."""
    model = gemma3(lib)
    tokens = _tokens(seq)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]

    def loss(params, tokens):
        logits = model.apply({"params": params}, tokens).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return Case("gemma3", loss, params, tokens)


def decoder(model):
    """``(prefill, step)``: the prompt into the key/value cache, then one greedy token; the mask
    lets each position see the cache up to itself (the layers add the sliding window)."""
    visible = jnp.arange(CACHE)

    def prefill(params, tokens, cache):
        n = tokens.shape[1]
        mask = jnp.broadcast_to(visible[None, None, :] <= jnp.arange(n)[None, :, None], (BATCH, n, CACHE))
        positions = jnp.broadcast_to(jnp.arange(n), (BATCH, n))
        out = model.apply(
            {"params": params}, tokens, positions=positions, cache=cache, attention_mask=mask, return_last_only=True
        )
        return out.logits, jnp.argmax(out.logits, axis=-1), out.cache

    def step(params, token, position, cache):
        mask = jnp.broadcast_to(visible <= position, (BATCH, 1, CACHE))
        out = model.apply(
            {"params": params},
            token[:, None],
            positions=jnp.full((BATCH, 1), position),
            cache=cache,
            attention_mask=mask,
        )
        return out.logits[:, 0], jnp.argmax(out.logits[:, 0], axis=-1), out.cache

    return prefill, step


def greedy(lib, model, params, transform):
    """The prompt's logits and tokens, then :data:`DECODE_STEPS` steps, each program ``jit(transform(f))``."""
    prefill, step = (jax.jit(transform(f)) for f in decoder(model))
    cache = model.config.init_cache(BATCH, dtype=jnp.float32, cache_length=CACHE)
    logits, token, cache = prefill(params, _tokens(PROMPT, seed=4), cache)
    all_logits, tokens = [logits], [token]
    for position in range(PROMPT, PROMPT + DECODE_STEPS):
        logits, token, cache = step(params, token, jnp.int32(position), cache)
        all_logits.append(logits)
        tokens.append(token)
    return all_logits, np.stack([np.asarray(t) for t in tokens], axis=1)


def check_decode(lib, fmt) -> tuple[str, str]:
    """``(outcome, detail)`` of greedy decoding with the weights in ``fmt`` against float32's."""
    model = gemma3(lib)
    params = model.init(jax.random.PRNGKey(0), _tokens(SEQ))["params"]
    qparams = quantize_tree(params, fmt)
    if n_scaled(qparams) == 0:
        return "n/a", f"no weight has a shape {fmt.name} accepts"
    try:
        want_logits, want_tokens = greedy(lib, model, dequantize_tree(qparams), lambda f: f)
        got_logits, got_tokens = greedy(lib, model, qparams, scalify.scalify)
        assert np.array_equal(got_tokens, want_tokens), (
            f"tokens {got_tokens} under {fmt.name}, {want_tokens} in float32"
        )
        assert_tree_close(got_logits, want_logits, fmt, "decoding logits")
    except Exception as exc:  # reported per format; the run goes on
        return failure(exc)
    return "ok", f"{got_tokens.size} tokens as float32's, {n_scaled(qparams)} weights scaled"


def check_qlora(lib, fmt) -> tuple[str, str]:
    """``(outcome, detail)`` of a QLoRA step: base weights in ``fmt``, float32 adapters trained."""
    model = lib.lora.LoRA(rank=4, model=gemma3(lib), dtype=jnp.float32)
    tokens = _tokens(SEQ)
    base, lora = lib.peft.split_params(model.init(jax.random.PRNGKey(0), tokens)["params"])
    # The adapters' B starts at zero (the model starts as the base): move it so A gets a gradient.
    lora = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.PRNGKey(1), a.shape), lora)
    qbase = quantize_tree(base, fmt)
    if n_scaled(qbase) == 0:
        return "n/a", f"no weight has a shape {fmt.name} accepts"

    def loss(lora, base, tokens):
        logits = model.apply({"params": lib.peft.merge_params(base, lora)}, tokens).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    opt = make_optimizer()

    def step(lora, state, base, tokens):
        value, grads = jax.value_and_grad(loss)(lora, base, tokens)
        updates, state = opt.update(grads, state, lora)
        return value, grads, optax.apply_updates(lora, updates), state

    try:
        state = opt.init(lora)
        expected = jax.jit(step)(lora, state, dequantize_tree(qbase), tokens)
        got = jax.jit(scalify.scalify(step))(lora, state, qbase, tokens)
        for i, what in enumerate(("loss", "adapter gradient", "Adam-updated adapters", "Adam state")):
            assert_tree_close(got[i], expected[i], fmt, f"QLoRA {what}")
    except Exception as exc:  # reported per format; the run goes on
        return failure(exc)
    return "ok", f"{n_scaled(qbase)} base weights scaled, {len(jax.tree.leaves(lora))} adapter weights trained"


def run_check(lib, name: str, column, recipe_run: bool) -> tuple[str, str]:
    if recipe_run:
        if name != "gemma3":
            return "n/a", "the recipe runs are of the training step"
        return check_recipe(build(lib, seq=RECIPE_SEQ), column)
    checks = {
        "gemma3": lambda lib, fmt: check(build(lib), fmt),
        "gemma3_decode": check_decode,
        "gemma3_qlora": check_qlora,
    }
    return checks[name](lib, column)


def main(argv=None) -> int:
    this = types.SimpleNamespace(
        __doc__=__doc__, package="gemma", version=GEMMA_VERSION, fetch=fetch, load=import_gemma
    )
    return run_table(this, 14, CHECKS, run_check, argv)


if __name__ == "__main__":
    sys.exit(main())
