"""Run Google DeepMind's RecurrentGemma (Griffin), unchanged, under ``scalify`` with the weights in each format.

    python scripts/run_recurrentgemma.py                      # pip download recurrentgemma (RG_VERSION)
    python scripts/run_recurrentgemma.py --source DIR         # an unpacked recurrentgemma wheel or a git clone
    python scripts/run_recurrentgemma.py --formats all --markdown
    python scripts/run_recurrentgemma.py --recipes all        # scalify.recipes.apply on the training loss

The model is ``recurrentgemma.jax.Griffin``, the flax implementation that Google DeepMind publishes
beside the RecurrentGemma checkpoints: residual blocks alternating the RG-LRU recurrence (gated
block-diagonal linears, the decay ``a = exp(-8 r softplus(a_param))`` with ``r`` the recurrence gate, the
``sqrt(1 - a^2)`` input normalisation, a temporal 1-D convolution, a linear scan or an associative
scan over the sequence) with local multi-query attention (a window of 8 tokens, rotary embeddings on
half the head), a gated GELU MLP, RMSNorm, a tied embedding read out with logit soft-capping, and
``nn.remat`` around every block. It is built at a tiny configuration (width 64, one recurrent and
one attention block, vocabulary 64) through its public ``GriffinConfig``; nothing of it is copied here.

Checks (rows of the table):

* ``griffin`` / ``griffin_associative``: the cross-entropy of next-token prediction, its gradient
  and one Adam update (the third-party harness's check and tolerance: every weight the format
  accepts becomes a ScaledArray, the reference is float32 on the dequantized weights), with the
  RG-LRU run by ``ScanType.LINEAR_NATIVE`` (a ``lax.scan``) and ``ScanType.ASSOCIATIVE_NATIVE``
  (``lax.associative_scan``).
* ``decode``: RecurrentGemma's own ``Sampler`` (prompt processing, then greedy decoding in a
  ``lax.while_loop`` that carries the recurrent states, the convolution's window and the attention's
  key/value cache), with a SentencePiece vocabulary trained here on a few sentences. The sampler's two
  programs (``prompt_processing_fn`` and ``sample_fn``, the public properties its ``__call__`` uses)
  run as ``jax.jit(scalify.scalify(fn, dequantize_outputs=True))``: its ``SamplingState`` is a
  jaxtyping-checked ``flax.struct`` dataclass that accepts ``jax.Array`` fields only, so the state
  it returns is plain (the weights stay scaled inside). The generated tokens must be float32's and
  the logits of every step within the harness's tolerance.

With ``--recipes`` the float32 weights stay as they are and the loss on 32 tokens runs as
``recipes.apply(loss, recipe)`` under ``jax.value_and_grad`` (``run_keras_hub_models.check_recipe``).

recurrentgemma pins ``typeguard<3`` (its ``array_typing.typed`` hands jaxtyping typeguard 2's
``typechecked``; typeguard 4 cannot instrument its string shapes) and ``numpy<2.4``; the script
downloads its wheel with those of typeguard 2.13.3, einops and sentencepiece (``pip download
--no-deps``) and puts them first on ``sys.path``, leaving the installed packages as they are.
"""

from __future__ import annotations

import functools
import io
import sys
import tempfile
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
from run_flax_examples import failure, parse_cli, summary  # noqa: E402
from run_keras_hub_models import _recipes_arg, check, check_recipe, recipe  # noqa: E402
from thirdparty_harness import Case, assert_tree_close, dequantize_tree, n_scaled, quantize_tree  # noqa: E402

import scalify  # noqa: E402

# The version the figures in docs/examples.md were measured with.
RG_VERSION = "1.0.1"
WHEELS = (f"recurrentgemma=={RG_VERSION}", "typeguard==2.13.3", "einops", "sentencepiece")
SEQ, RECIPE_SEQ, BATCH = 12, 32, 2
CHECKS = ("griffin", "griffin_associative", "decode")
PROMPTS = ("the quick", "a stitch in")
DECODE_STEPS = 12


def fetch(work: Path) -> Path:
    """:data:`WHEELS` (``pip download --no-deps``) unpacked under ``work``; the directory to import from."""
    hint = (
        "Unpack those wheels into one directory (or clone https://github.com/google-deepmind/recurrentgemma "
        "beside typeguard 2, einops and sentencepiece) and pass --source DIR."
    )
    return fetch_wheels(work, WHEELS, hint)


def import_recurrentgemma(root: Path):
    """``recurrentgemma.jax`` (``.rg``), ``recurrentgemma.common`` and ``sentencepiece`` imported from ``root``."""
    loaded = sys.modules.get("typeguard")
    if loaded is not None and not Path(loaded.__file__).resolve().is_relative_to(root.resolve()):
        raise SystemExit(
            f"typeguard is already imported from {loaded.__file__}; recurrentgemma needs the typeguard 2 in {root}"
        )
    sys.path.insert(0, str(root))
    import recurrentgemma.jax as rg
    import sentencepiece as spm
    from recurrentgemma import common

    return types.SimpleNamespace(rg=rg, common=common, spm=spm)


def griffin(lib, scan: str = "LINEAR_NATIVE"):
    """A tiny Griffin: one RG-LRU block and one local-attention block, width 64."""
    kinds = lib.common.TemporalBlockType
    config = lib.rg.GriffinConfig(
        vocab_size=64,
        width=64,
        mlp_expanded_width=128,
        num_heads=2,
        block_types=(kinds.RECURRENT, kinds.ATTENTION),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=8,
        logits_soft_cap=30.0,
        lru_width=64,
        scan_type=lib.common.ScanType[scan],
    )
    return lib.rg.Griffin(config)


def build(lib, name: str, seq: int = SEQ) -> Case:
    """Next-token cross-entropy of Griffin on one random batch, a pure function of its weights."""
    model = griffin(lib, "ASSOCIATIVE_NATIVE" if name == "griffin_associative" else "LINEAR_NATIVE")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (BATCH, seq)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq), (BATCH, seq))
    params = model.init(jax.random.PRNGKey(0), tokens, positions)["params"]

    def loss(params, batch):
        tokens, positions = batch
        logits, _ = model.apply({"params": params}, tokens, positions)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return Case(name, loss, params, (tokens, positions))


def vocabulary(lib):
    """A character-level SentencePiece model trained in memory (pad 0, bos 1, eos 2)."""
    text = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine"] * 10
    proto = io.BytesIO()
    lib.spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=proto,
        vocab_size=40,
        model_type="char",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    return lib.spm.SentencePieceProcessor(model_proto=proto.getvalue())


def scalified_sampler(lib):
    """``Sampler`` whose two programs run under ``jit(scalify(..., dequantize_outputs=True))``."""

    class ScalifiedSampler(lib.rg.Sampler):
        @functools.cached_property
        def prompt_processing_fn(self):
            fn = scalify.scalify(self._prompt_processing_fn, dequantize_outputs=True)
            return jax.jit(fn, static_argnums=(4, 5, 6))

        @functools.cached_property
        def sample_fn(self):
            return jax.jit(scalify.scalify(self._sample_fn, dequantize_outputs=True), static_argnums=(2,))

    return ScalifiedSampler


def check_decode(lib, fmt) -> tuple[str, str]:
    """``(outcome, detail)`` of greedy decoding with the weights in ``fmt`` against float32's."""
    model = griffin(lib)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32), jnp.arange(4)[None])["params"]
    qparams = quantize_tree(params, fmt)
    if n_scaled(qparams) == 0:
        return "n/a", f"no weight has a shape {fmt.name} accepts"
    vocab = vocabulary(lib)
    try:
        expected = lib.rg.Sampler(model, vocab, dequantize_tree(qparams))(
            PROMPTS, total_generation_steps=DECODE_STEPS, return_logits=True
        )
        got = scalified_sampler(lib)(model, vocab, qparams)(
            PROMPTS, total_generation_steps=DECODE_STEPS, return_logits=True
        )
        for i, (g, e) in enumerate(zip(got.tokens, expected.tokens, strict=True)):
            assert np.array_equal(np.asarray(g), np.asarray(e)), (
                f"prompt {i}: tokens {g} under {fmt.name}, {e} in float32"
            )
        assert_tree_close(list(got.logits), list(expected.logits), fmt, "decoding logits")
    except Exception as exc:  # reported per format; the run goes on
        return failure(exc)
    return "ok", f"{sum(len(t) for t in got.tokens)} tokens as float32's, {n_scaled(qparams)} weights scaled"


def run_check(lib, name: str, column, recipe_run: bool) -> tuple[str, str]:
    if recipe_run:
        if name == "decode":
            return "n/a", "a recipe quantizes a training step's GEMMs"
        return check_recipe(build(lib, name, seq=RECIPE_SEQ), column)
    return check_decode(lib, column) if name == "decode" else check(build(lib, name), column)


def run_table(target, name_width: int, checks, check_one, argv=None) -> int:
    """The command line shared with ``run_gemma_library.py``: every (check, format) pair, or every
    (check, recipe) pair with ``--recipes``, through ``check_one(lib, name, format or recipe,
    recipe_run)``, ``lib`` being what ``target.load`` imported; ``target`` also names the package,
    its version and ``fetch``. Prints each row and the summary; returns the exit status."""
    recipe_names, options, argv = _recipes_arg(argv)
    args, names, formats = parse_cli(target.__doc__, checks, target.package, argv)
    with tempfile.TemporaryDirectory(prefix=f"{target.package}_") as tmp:
        root = args.source.resolve() if args.source else target.fetch(Path(tmp))
        lib = target.load(root)
        print(f"{target.package} {target.version if not args.source else 'from ' + str(root)}")
        rows = []
        with jax.numpy_dtype_promotion("standard"):
            for name in names:
                for column in recipe_names or formats:
                    run = recipe(column, **options) if recipe_names else column
                    label = column if recipe_names else column.name
                    outcome, detail = check_one(lib, name, run, bool(recipe_names))
                    rows.append((name, label, outcome, detail))
                    print(f"{name:{name_width}s} {label:22s} {outcome:5s} {detail}", flush=True)
    columns = [types.SimpleNamespace(name=r) for r in recipe_names] if recipe_names else formats
    return summary(rows, names, columns, args.markdown)


def main(argv=None) -> int:
    this = types.SimpleNamespace(
        __doc__=__doc__, package="recurrentgemma", version=RG_VERSION, fetch=fetch, load=import_recurrentgemma
    )
    return run_table(this, 20, CHECKS, run_check, argv)


if __name__ == "__main__":
    sys.exit(main())
