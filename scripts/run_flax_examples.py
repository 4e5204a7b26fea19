"""Run flax's own example training steps, unchanged, under ``scalify`` with parameters in each format.

    python scripts/run_flax_examples.py                       # pip download flax's sdist (installed version)
    python scripts/run_flax_examples.py --source DIR          # an unpacked flax sdist or a git clone
    python scripts/run_flax_examples.py --only lm1b,wmt --formats all --markdown
    python scripts/run_flax_examples.py --recipes high,float8_tensorwise,mxfp8   # training recipes

The programs are the ``train_step`` functions of flax's ``examples/`` (seq2seq, sst2, vae, lm1b,
wmt, nlp_seq, imagenet, and the NNX examples mnist and gemma), read from flax's sdist of the
installed version (or ``--source DIR``); nothing of them is copied into this repository. Each
example's ``train.py`` is imported as it is, and its ``train_step`` is called as the example's own
``main`` calls it: under ``jax.jit`` with the same static arguments, under
``jax.pmap(axis_name="batch")`` where the step averages gradients with ``lax.pmean`` (wmt, nlp_seq,
imagenet; one device here), or under ``nnx.jit`` where the step updates NNX modules, optimizer,
metrics and Rngs in place (mnist; gemma, whose ``jax.jit`` mode runs too as ``gemma+jax.jit``).
The only change is ``jax.jit(train_step)`` -> ``jax.jit(scalify.scalify(train_step))``.

What the script supplies, and why
---------------------------------
* **Data and logging modules are stand-ins.** The examples import ``tensorflow``,
  ``tensorflow_datasets``, ``clu``, ``ml_collections``, ``tensorboard``, ``sentencepiece``, ``PIL``,
  ``grain``, ``orbax`` and ``jaxtyping`` at module level for input pipelines, tokenizers, metric
  writers, checkpoints, image files and annotations; no train step calls them. An import hook
  serves any module under those names (when not installed) as an inert placeholder.
* **Small configurations and synthetic batches** (built with the examples' own constructors and
  initialisation functions): widths 32-64, two layers, a batch of 4-16. Shapes are multiples of 32
  where the example allows, so that MX and NVFP4 layouts accept the kernels.
* **The optimiser.** Every state gets ``optax.adam(1e-2, eps=1e-2)`` (the third-party harness's
  optimiser; gemma keeps its own ``adamw`` and schedule, with ``eps=1e-2``): with the examples'
  ``eps=1e-8`` the first Adam step is ``lr * sign(g)``, and a gradient entry that is zero up to
  float32 rounding would flip sign. The optimiser state is
  initialised on the float32 parameters; see ``docs/examples.md`` for why not on MX ones.
* **Flax's ``DynamicScale``** (wmt, imagenet): each of the two runs once more with
  ``TrainState(dynamic_scale=DynamicScale())``, the half-precision path of those examples.

The check: parameters whose shape the format's layout accepts (rank >= 2, blocks that fit) are
quantized with ``as_scaled_array(p, fmt=...)`` (NNX: in the model, after its optimizer is built);
the reference is the same ``train_step`` in float32 on the dequantized parameters. Every leaf of
the returned state and metrics (NNX: of every object the step updates, and of its outputs) must
agree within the third-party harness's tolerance (``tests/thirdparty/thirdparty_harness.py``:
float32 propagation error, far below any format's element rounding).

With ``--recipes`` (built-in names, ``high`` or ``all``; ``--high-precision-scopes`` and
``--weights-only`` as in ``run_keras_hub_models.py``) the step runs as
``scalify.recipes.apply(train_step, recipe)`` on the float32 parameters instead. Each step takes its
gradient inside, so the recipe pairs every backward GEMM with its forward one; the check requires
all of them paired (a count the script reads from the walker), every output finite where float32's
is, and the step's change of the parameters and optimizer state at a cosine with float32's above
the recipe's floor
(``high``: float32's values to rounding). ``refused`` is the recipe's own error for a contraction
whose widths its formats cannot block.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import tempfile
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_scalify_source import fetch_sdist  # noqa: E402
from thirdparty_harness import (  # noqa: E402
    FAMILY_REPRESENTATIVES,
    assert_tree_close,
    dequantize_tree,
    make_optimizer,
    n_scaled,
    quantize_tree,
)

import qformats as qf  # noqa: E402
import scalify  # noqa: E402

# Imported by the examples' train.py for data, logging and images, never by a train step.
STAND_INS = (
    "tensorflow",
    "tensorflow_datasets",
    "tensorflow_text",
    "tensorboard",
    "clu",
    "ml_collections",
    "sentencepiece",
    "PIL",
    "grain",
    "orbax",
    "jaxtyping",
)


class _Inert(types.ModuleType):
    """A module whose every attribute, call, subscript and ``|`` is itself (so annotations such as
    ``tf.data.Dataset | None`` and decorators evaluate)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return self

    def __getitem__(self, key):
        return self

    def __or__(self, other):
        return self

    __ror__ = __or__


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Inert(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_stand_ins(names=STAND_INS):
    """Serve the modules of ``names`` that are not installed as inert placeholders."""
    missing = [m for m in names if importlib.util.find_spec(m) is None]
    if missing:
        sys.meta_path.insert(0, _StandIns(missing))
    return missing


def fetch_flax(work: Path) -> Path:
    """``pip download`` the sdist of the installed flax version and unpack it; return its root."""
    return fetch_sdist(work, importlib.metadata.version("flax"), "flax", "https://github.com/google/flax")


# -- the examples -------------------------------------------------------------------------------------
# Each builder takes the examples directory and returns (state, run, train_step): run(step, state)
# calls `step` (the example's train_step, or scalify of it) the way the example's main does.
_EXAMPLE_MODULES = (
    "train",
    "models",
    "input_pipeline",
    "utils",
    "temperature_sampler",
    "decode",
    "bleu",
    "tokenizer",
    # gemma's
    "transformer",
    "transformer_cfg",
    "train_cfg",
    "modules",
    "layers",
    "helpers",
    "params",
    "positional_embeddings",
    "sampler",
    "sow_lib",
)


def _load(examples: Path, name: str, *modules):
    """Import modules of ``examples/name`` fresh (the examples reuse module names such as ``train``)."""
    for m in _EXAMPLE_MODULES:
        sys.modules.pop(m, None)
    sys.path.insert(0, str(examples / name))
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.path.pop(0)


def _jitted(static_argnums=()):
    return lambda step, *args: jax.jit(step, static_argnums=static_argnums)(*args)


def _pmapped(**static):
    """``jax.pmap(partial(step, **static), axis_name="batch")`` on a one-device replica of the args."""

    def run(step, *args):
        replicate = lambda tree: jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
        out = jax.pmap(functools.partial(step, **static), axis_name="batch")(*map(replicate, args))
        return jax.tree.map(lambda x: x[0], out)

    return run


def _tokens(seed, shape, low, high):
    return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape), jnp.int32)


def seq2seq(examples):
    """LSTM encoder-decoder (``nn.scan``-lifted cells, sampling from the logits): ``@jax.jit`` step."""
    train, pipeline = _load(examples, "seq2seq", "train", "input_pipeline")
    train.FLAGS(["run_flax_examples"])  # absl flags hold the model's sizes (defaults)
    table = pipeline.CharacterTable("0123456789+= ")
    state = train.get_train_state(jax.random.key(0), table).replace(tx=make_optimizer())
    batch = table.get_batch(8)
    return state, lambda step, st: _jitted()(step, st, batch, jax.random.key(1), table.eos_id), train.train_step


def sst2(examples):
    """Embedding, word dropout and a bidirectional LSTM classifier; SGD with momentum in the example."""
    train, models = _load(examples, "sst2", "train", "models")
    from flax.training import train_state

    model = models.TextClassifier(
        embedding_size=32, hidden_size=32, vocab_size=50, output_size=1, dropout_rate=0.5, word_dropout_rate=0.1
    )
    params = train.get_initial_params(jax.random.key(0), model)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer())
    batch = {
        "token_ids": _tokens(0, (8, 12), 2, 50),
        "length": _tokens(1, (8,), 3, 12),
        "label": _tokens(2, (8,), 0, 2).astype(jnp.float32),
    }
    return state, lambda step, st: _jitted()(step, st, batch, {"dropout": jax.random.key(1)}), train.train_step


def vae(examples):
    """Variational autoencoder (reparameterisation with a PRNG key, sigmoid cross-entropy, KL)."""
    train, models = _load(examples, "vae", "train", "models")
    from flax.training import train_state

    latents = 20
    params = models.model(latents).init(jax.random.key(0), jnp.ones((1, 784)), jax.random.key(1))["params"]
    state = train_state.TrainState.create(apply_fn=models.model(latents).apply, params=params, tx=make_optimizer())
    # The example trains on binarised MNIST (0/1 pixels). With 0/1 inputs and int8 codes the
    # encoder's dot products are exact integer sums times a channel scale, and one pre-activation
    # cancels to within 1e-8 of 0 (0.0 under scalify, 2e-8 in float32, -1.9e-8 in float64): ReLU's
    # gradient flips under any change of summation order. Grey levels in [0, 1) avoid the tie.
    batch = jnp.asarray(np.random.default_rng(0).random((16, 784)), jnp.float32)
    return state, lambda step, st: _jitted(3)(step, st, batch, jax.random.key(2), latents), train.train_step


def lm1b(examples):
    """Decoder-only Transformer LM with dropout and a learning-rate schedule (static config)."""
    train, models = _load(examples, "lm1b", "train", "models")
    from flax.training import train_state

    config = models.TransformerConfig(
        vocab_size=64, output_vocab_size=64, emb_dim=64, num_heads=2, num_layers=2, qkv_dim=64, mlp_dim=128, max_len=32
    )
    inputs = _tokens(0, (4, 16), 1, 64)
    params = models.TransformerLM(dataclasses.replace(config, deterministic=True)).init(jax.random.key(0), inputs)
    state = train_state.TrainState.create(apply_fn=None, params=params["params"], tx=make_optimizer())
    schedule = train.create_learning_rate_schedule(1e-3, 10)
    run = _jitted((2, 3))
    batch = {"inputs": inputs}
    return state, lambda step, st: run(step, st, batch, config, schedule, 0.0, jax.random.key(3)), train.train_step


def wmt(examples, dynamic_scale=False):
    """Encoder-decoder Transformer; gradients averaged with ``lax.pmean`` under ``pmap``."""
    train, models = _load(examples, "wmt", "train", "models")
    from flax.training import dynamic_scale as dynamic_scale_lib

    config = models.TransformerConfig(
        vocab_size=64, output_vocab_size=64, emb_dim=64, num_heads=2, num_layers=2, qkv_dim=64, mlp_dim=128, max_len=32
    )
    batch = {"inputs": _tokens(0, (4, 16), 1, 64), "targets": _tokens(1, (4, 12), 1, 64)}
    model = models.Transformer(dataclasses.replace(config, deterministic=True))
    params = model.init(jax.random.key(0), batch["inputs"], batch["targets"])["params"]
    scale = dynamic_scale_lib.DynamicScale() if dynamic_scale else None
    state = train.TrainState.create(apply_fn=None, params=params, tx=make_optimizer(), dynamic_scale=scale)
    schedule = train.create_learning_rate_schedule(1e-3, 10)
    run = _pmapped(config=config, learning_rate_fn=schedule, dropout_rng=jax.random.key(3))
    return state, lambda step, st: run(step, st, batch), train.train_step


def nlp_seq(examples):
    """Transformer sequence tagger (encoder only) under ``pmap`` with ``lax.pmean``."""
    train, models = _load(examples, "nlp_seq", "train", "models")
    from flax.training import train_state

    config = models.TransformerConfig(
        vocab_size=64, output_vocab_size=16, emb_dim=64, num_heads=2, num_layers=2, qkv_dim=64, mlp_dim=128, max_len=32
    )
    model = models.Transformer(config)
    batch = {"inputs": _tokens(0, (4, 16), 1, 64), "targets": _tokens(1, (4, 16), 1, 16)}
    params = model.init(jax.random.key(0), inputs=batch["inputs"], train=False)["params"]
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=make_optimizer())
    schedule = train.create_learning_rate_scheduler(base_learning_rate=0.05, warmup_steps=10)
    run = _pmapped(model=model, learning_rate_fn=schedule, dropout_rng=jax.random.key(3))
    return state, lambda step, st: run(step, st, batch), train.train_step


def imagenet(examples, dynamic_scale=False):
    """ResNet (one stage) with BatchNorm statistics as mutable state, under ``pmap``."""
    train, models = _load(examples, "imagenet", "train", "models")
    from flax.training import dynamic_scale as dynamic_scale_lib

    train.NUM_CLASSES = 10  # the example's module constant (1000 ImageNet classes)
    model = models._ResNet1(num_classes=10, num_filters=32)
    params, batch_stats = train.initialized(jax.random.key(0), 32, model)
    scale = dynamic_scale_lib.DynamicScale() if dynamic_scale else None
    state = train.TrainState.create(
        apply_fn=model.apply, params=params, tx=make_optimizer(), batch_stats=batch_stats, dynamic_scale=scale
    )
    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.standard_normal((8, 32, 32, 3)), jnp.float32), "label": _tokens(1, (8,), 0, 10)}
    run = _pmapped(learning_rate_fn=lambda step: 0.1)
    return state, lambda step, st: run(step, st, batch), train.train_step


# -- NNX examples: the step changes the model, optimizer, metrics and Rngs in place ----------------
# Each builder returns (build, run, train_step): build() makes fresh objects (same seeds every call),
# run(step, objects) calls the step the way the example's main does and returns its output.


def mnist(examples):
    """CNN with Conv, BatchNorm, Dropout and avg_pool; ``@nnx.jit`` step updating everything in place."""
    from flax import nnx

    (train,) = _load(examples, "mnist", "train")

    def build():
        model = train.CNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, make_optimizer(), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        return model, optimizer, metrics, nnx.Rngs(0)

    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.random((8, 28, 28, 1)), jnp.float32), "label": _tokens(1, (8,), 0, 10)}

    def run(step, objects):
        model, optimizer, metrics, rngs = objects
        model.train()
        return nnx.jit(step)(model, optimizer, metrics, batch, rngs)

    # The module decorates its step with @nnx.jit; the undecorated function is what a user wraps.
    return build, run, train.train_step.__wrapped__


def _gemma(examples, variant):
    from flax import nnx

    train, transformer_lib, transformer_cfg = _load(examples, "gemma", "train", "transformer", "transformer_cfg")
    config = transformer_lib.TransformerConfig.from_dict(
        num_layers=2,
        num_embed=64,
        embed_dim=64,
        hidden_dim=128,
        num_heads=2,
        head_dim=32,
        num_kv_heads=1,
        use_post_attn_norm=False,
        use_post_ffw_norm=False,
        attention_types=(1, 1),
        final_logit_softcap=None,
        shd_config=transformer_cfg.ShardingConfig.no_sharding(),
    )

    def build():
        model = transformer_lib.Transformer(config, rngs=nnx.Rngs(params=0, dropout=0))
        schedule = train.create_learning_rate_schedule(learning_rate=1e-2, warmup_steps=10)
        tx = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-2, weight_decay=0.1)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
        return model, optimizer, nnx.Rngs(params=0, dropout=0), metrics

    # As the example's input pipeline makes them: sequences padded with 0 (the pad id) to 16 tokens,
    # targets shifted one token left, positions and segment ids of packed examples.
    lengths = np.array([16, 13, 9, 6])
    inputs = np.where(np.arange(16) < lengths[:, None], np.asarray(_tokens(0, (4, 16), 1, 64)), 0)
    batch = {
        "inputs": jnp.asarray(inputs),
        "targets": jnp.asarray(np.pad(inputs[:, 1:], [(0, 0), (0, 1)])),
        "inputs_position": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (4, 16)),
        "inputs_segmentation": jnp.asarray(inputs > 0, jnp.int32),
    }
    step = train.nnx_train_step if variant == "nnx" else train.jax_train_step
    jit = nnx.jit if variant == "nnx" else jax.jit

    def run(step, objects):
        # As gemma's main: static label_smoothing and pad_id; the jax.jit step returns the new state.
        model, optimizer, rngs, metrics = objects
        out = jit(step, static_argnames=("label_smoothing", "pad_id"))(model, optimizer, rngs, batch, metrics, 0.0, 0)
        if variant == "jax":
            updates, out = out
            nnx.update(objects, updates)
        return out

    return build, run, functools.partial(step, with_capture=False)


EXAMPLES = {
    "seq2seq": seq2seq,
    "sst2": sst2,
    "vae": vae,
    "lm1b": lm1b,
    "wmt": wmt,
    "wmt+DynamicScale": functools.partial(wmt, dynamic_scale=True),
    "nlp_seq": nlp_seq,
    "imagenet": imagenet,
    "imagenet+DynamicScale": functools.partial(imagenet, dynamic_scale=True),
    "mnist": mnist,
    "gemma": functools.partial(_gemma, variant="nnx"),
    "gemma+jax.jit": functools.partial(_gemma, variant="jax"),
}
NNX_EXAMPLES = ("mnist", "gemma", "gemma+jax.jit")


def check(state, run, train_step, fmt) -> tuple[str, str]:
    """(outcome, detail) of the example's step on ``fmt`` parameters against float32."""
    qparams = quantize_tree(state.params, fmt)
    if n_scaled(qparams) == 0:
        return "n/a", f"no parameter has a shape that {fmt.name} accepts"
    dparams = dequantize_tree(qparams)
    opt_state = state.tx.init(dparams)
    try:
        expected = run(train_step, state.replace(params=dparams, opt_state=opt_state))
        got = run(scalify.scalify(train_step), state.replace(params=qparams, opt_state=opt_state))
        assert_tree_close(got, expected, fmt, "state and metrics")
    except Exception as exc:  # reported per example and format (traceback on stderr), not raised
        return failure(exc)
    return "ok", f"{n_scaled(qparams)} parameters scaled"


def check_nnx(build, run, train_step, fmt) -> tuple[str, str]:
    """(outcome, detail) of an NNX example's step on ``fmt`` parameters against float32: the objects
    the step updates in place must hold the same state afterwards, and the outputs must agree."""
    from flax import nnx

    got_objects, expected_objects = build(), build()
    qparams = quantize_tree(nnx.state(got_objects[0], nnx.Param), fmt)
    if n_scaled(qparams) == 0:
        return "n/a", f"no parameter has a shape that {fmt.name} accepts"
    nnx.update(got_objects[0], qparams)
    nnx.update(expected_objects[0], dequantize_tree(qparams))
    try:
        expected = run(train_step, expected_objects)
        got = run(scalify.scalify(train_step), got_objects)
        assert_tree_close(got, expected, fmt, "outputs")
        assert_tree_close(nnx.state(got_objects), nnx.state(expected_objects), fmt, "state after the step")
    except Exception as exc:  # reported per example and format (traceback on stderr), not raised
        return failure(exc)
    return "ok", f"{n_scaled(qparams)} parameters scaled"


class _Counting:
    """Records ``(paired, emitted)`` of every traced program's backward contractions while the
    recipe walks a step (:class:`scalify.amp._transposes.Transposes`)."""

    def __enter__(self):
        from scalify.amp import _transposes

        self.module, self.original, self.counts = _transposes, _transposes.Transposes, []
        counts = self.counts

        class Recording(self.original):
            def __init__(self, closed):
                super().__init__(closed)
                counts.append(self.counts)

        _transposes.Transposes = Recording
        return self

    def __exit__(self, *exc):
        self.module.Transposes = self.original

    def totals(self) -> tuple[int, int]:
        """``(paired, emitted)`` over every program traced."""
        return sum(c[0] for c in self.counts), sum(c[1] for c in self.counts)

    def summary(self) -> str:
        return "{} of {} backward GEMMs paired".format(*self.totals())


def _float_leaves(tree) -> list:
    return [
        np.asarray(x, np.float64) for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]


def _change(before: list, after) -> np.ndarray:
    """``after - before``, flat; ``before``: :func:`_float_leaves` of the same tree, taken (copied)
    before an NNX step updates it in place."""
    return np.concatenate([(a - b).ravel() for a, b in zip(_float_leaves(after), before, strict=True)])


def check_recipe(name, examples, rec) -> tuple[str, str]:
    """(outcome, detail) of the example's step as ``recipes.apply(train_step, rec)`` against float32:
    every backward GEMM of the step (its gradient is taken inside) paired with its forward one, every
    output finite where float32's is, and the step's change of the parameters and optimizer state
    pointing the way float32's does (cosine above the recipe's floor; ``high``: float32's values to
    rounding). The optimizer state counts because gemma's warm-up schedule starts at a learning rate
    of 0: its first step moves only Adam's moments."""
    from run_keras_hub_models import cosine, cosine_floor, recipe_outcome

    nnx_example = name in NNX_EXAMPLES

    def trained(objects_or_state):
        """The parameters and optimizer state (NNX: of the model and optimizer objects)."""
        if nnx_example:
            from flax import nnx

            return [nnx.state(objects_or_state[0]), nnx.state(objects_or_state[1])]
        return [objects_or_state.params, objects_or_state.opt_state]

    def run():
        if nnx_example:
            build, step_run, train_step = EXAMPLES[name](examples)
            got_objects, expected_objects = build(), build()
            before = _float_leaves(trained(expected_objects))
            expected = step_run(train_step, expected_objects)
            with _Counting() as counting:
                got = step_run(scalify.recipes.apply(train_step, rec), got_objects)
            got_trained, expected_trained = trained(got_objects), trained(expected_objects)
        else:
            state, step_run, train_step = EXAMPLES[name](examples)
            before = _float_leaves(trained(state))
            expected = step_run(train_step, state)
            with _Counting() as counting:
                got = step_run(scalify.recipes.apply(train_step, rec), state)
            from flax.training.train_state import TrainState

            new_state = lambda out: out if isinstance(out, TrainState) else out[0]  # vae returns the state alone
            got_trained, expected_trained = trained(new_state(got)), trained(new_state(expected))
        paired, emitted = counting.totals()
        if paired != emitted:
            raise AssertionError(f"only {counting.summary()}: the others ran in the forward roles")
        for i, (a, b) in enumerate(zip(_float_leaves(got), _float_leaves(expected), strict=True)):
            if (~np.isfinite(a) & np.isfinite(b)).any():
                raise AssertionError(f"output {i}: NaN/Inf where float32 is finite")
        floor = cosine_floor(rec)
        if floor is None:
            for a, b in zip(_float_leaves(got_trained), _float_leaves(expected_trained), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(b).max(initial=0))))
        c = cosine(_change(before, got_trained), _change(before, expected_trained))
        return c, f"{counting.summary()}; the step's change at cosine {c:.4f}", floor

    return recipe_outcome(run)


def failure(exc) -> tuple[str, str]:
    """``("FAIL", first line)`` of an exception, its traceback printed to stderr."""
    traceback.print_exc()
    return "FAIL", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def pop_option(argv: list, flag: str, what: str):
    """The value after ``flag`` in ``argv`` (both removed), or ``None`` when ``flag`` is absent; the
    examples scripts' own options, taken out before :func:`parse_cli` sees the shared ones."""
    if flag not in argv:
        return None
    i = argv.index(flag)
    if i + 1 >= len(argv):
        raise SystemExit(f"{flag} needs a value: {what}")
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def parse_cli(doc, examples, package, argv):
    """``(args, names, formats)`` of the examples scripts' command line (``--source``, ``--only``,
    ``--formats``, ``--markdown``), the example names and formats validated."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help=f"unpacked {package} sdist or git clone (holding examples/)")
    parser.add_argument("--only", help=f"comma-separated examples (default all: {', '.join(examples)})")
    parser.add_argument("--formats", help="comma-separated formats, or 'all' (default: one per family)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)

    names = args.only.split(",") if args.only else list(examples)
    unknown = [n for n in names if n not in examples]
    if unknown:
        parser.error(f"unknown example(s) {unknown}; choose from {list(examples)}")
    formats = args.formats.split(",") if args.formats and args.formats != "all" else None
    formats = list(qf.list_formats()) if args.formats == "all" else formats or list(FAMILY_REPRESENTATIVES)
    unknown = [f for f in formats if f not in qf.list_formats()]
    if unknown:
        parser.error(f"unknown format(s) {unknown}; choose from {list(qf.list_formats())} or 'all'")
    return args, names, [qf.get_format(f) for f in formats]


def summary(rows, names, formats, markdown: bool) -> int:
    """Print the (example, format) outcomes (and a markdown table); the exit status."""
    if markdown:
        print("\n| example | " + " | ".join(f.name for f in formats) + " |")
        print("| --- |" + " --- |" * len(formats))
        for name in names:
            print(f"| {name} | " + " | ".join(r[2] for r in rows if r[0] == name) + " |")
    failed = [r for r in rows if r[2] == "FAIL"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} (example, format) pairs ok or n/a; {len(failed)} failed")
    return 1 if failed else 0


def main(argv=None) -> int:
    from run_keras_hub_models import _recipes_arg, recipe

    recipe_names, options, argv = _recipes_arg(argv)
    args, names, formats = parse_cli(__doc__, EXAMPLES, "flax", argv)
    runs = [recipe(n, **options) for n in recipe_names] if recipe_names else formats
    stand_ins = install_stand_ins()
    with tempfile.TemporaryDirectory(prefix="flax_examples_") as tmp:
        root = args.source.resolve() if args.source else fetch_flax(Path(tmp))
        examples = root / "examples"
        if not examples.is_dir():
            raise SystemExit(f"{root} has no examples/ directory; pass the root of a flax sdist or checkout.")
        version = importlib.metadata.version("flax")
        print(f"flax {version} examples from {root.name}; stand-ins for {stand_ins or 'none'}")
        rows = []
        for name in names:
            if not recipe_names:
                state, step_run, train_step = EXAMPLES[name](examples)
            for run in runs:
                if recipe_names:
                    outcome, detail = check_recipe(name, examples, run)
                else:
                    checker = check_nnx if name in NNX_EXAMPLES else check
                    outcome, detail = checker(state, step_run, train_step, run)
                rows.append((name, run.name, outcome, detail))
                print(f"{name:22s} {run.name:18s} {outcome:7s} {detail}", flush=True)
    return summary(rows, names, runs, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
