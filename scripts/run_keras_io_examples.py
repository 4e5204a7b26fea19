"""Run keras-io's own examples, unchanged, with ``model.fit`` training under a scalify recipe.

    python scripts/run_keras_io_examples.py --source DIR      # a keras-io checkout (examples/)
    python scripts/run_keras_io_examples.py --source DIR --only mnist_convnet --recipes float8_tensorwise,mxfp8
    python scripts/run_keras_io_examples.py --source DIR --recipes mxfp8 --high-precision-scopes dense --markdown

The programs are examples from keras-io's ``examples/`` (``vision/mnist_convnet.py``,
``nlp/bidirectional_lstm_imdb.py``, ``nlp/text_classification_with_transformer.py``), read from a
checkout given with ``--source`` (keras-io is not on PyPI); nothing of them is copied here. Each
file runs as a fresh ``__main__`` module, top to bottom.

The one change, the line a Keras user adds: every ``model.fit`` call of the example first sets
``model.train_step = scalify.recipes.apply(model.train_step, recipe)``. Keras's JAX trainer
jit-compiles that pure ``train_step(state, data)``, which takes its gradient inside, so the recipe
meets a program JAX has already differentiated and runs each backward GEMM in its role
(docs/recipes.md, "A gradient taken inside").

What the script supplies, and why
---------------------------------
* **Data.** ``keras.datasets.mnist.load_data`` and ``keras.datasets.imdb.load_data`` return
  synthetic arrays of the real ones' shapes and types (320 training and 64 test examples; IMDB
  reviews of 20 to 400 word ids below ``num_words``): nothing is downloaded.
* **TensorFlow.** Examples written before Keras 3 import Keras from TensorFlow (``from tensorflow
  import keras``); their own import statements get Keras itself (``KERAS_BACKEND=jax``), as Keras 3
  under TensorFlow would give them. Nothing else of TensorFlow is used by these examples.
* **Length.** A ``fit`` call trains for one step (``STEPS``; validation on at most two batches),
  and the example stops after its first ``fit``.
* **Adam's epsilon** is raised to 1e-2 (Keras's ``Adam``, built from the examples' ``"adam"``), as
  in the flax, Haiku and equinox scripts: with Keras's 1e-7 the first step is ``lr * sign(g)``, and
  a gradient entry that is zero up to float32 rounding would flip sign between the two runs that
  must agree.
* **Seeds.** ``keras.utils.set_random_seed(0)`` in a fresh Keras session before each run, so every
  run builds the same weights and draws the same dropout masks.

The check: each example runs three times per recipe: (a) with the one-line change; (b) with
``train_step`` replaced by Keras's step written around the recipe'd loss
(``jax.value_and_grad(recipes.apply(loss, recipe))``: the recipe's custom VJP runs the backward
GEMMs; ``thirdparty_harness.keras_step_with_the_recipe_on_the_loss``); (c) unchanged, in float32.
``ok`` when (a)'s weights after the fit equal (b)'s within 1e-5 of each weight's largest magnitude
(two programs XLA compiles apart: the fit's backward GEMMs ran in their roles), (a)'s losses are
finite where (c)'s are, and the recipe's gradient of the model's loss at the initial weights, on the
fit's first batch (dropout off), points the way float32's does (cosine above the floor of
``run_keras_hub_models.py``; ``high``: (a)'s weights are (c)'s to rounding). The gradient, not the
update: Adam normalizes each element, so an update's cosine mostly counts the signs of small
entries (the attention key bias's gradient is zero up to rounding). ``refused`` is the recipe's
own error for a contraction whose widths its formats cannot block, which names the contraction and the fixes.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from run_flax_examples import parse_cli, summary  # noqa: E402
from run_keras_hub_models import _recipes_arg, cosine, cosine_floor, recipe, recipe_outcome  # noqa: E402
from thirdparty_harness import keras_step_with_the_recipe_on_the_loss  # noqa: E402

import scalify  # noqa: E402

EXAMPLES = {
    "mnist_convnet": "examples/vision/mnist_convnet.py",
    "bidirectional_lstm_imdb": "examples/nlp/bidirectional_lstm_imdb.py",
    "text_classification_with_transformer": "examples/nlp/text_classification_with_transformer.py",
}
DEFAULT_RECIPES = ("high", "float8_tensorwise", "float8_rowwise", "mxfp8", "nvfp4")
STEPS = 1  # training steps of the one fit call run: the update compared is the first
N_TRAIN, N_TEST = 320, 64  # mnist: 288 training images after the 10% split, batches of 128, 128, 32


def _mnist():
    rng = np.random.default_rng(0)
    images = lambda n: rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = lambda n: rng.integers(0, 10, n).astype(np.uint8)
    return (images(N_TRAIN), labels(N_TRAIN)), (images(N_TEST), labels(N_TEST))


def _imdb(num_words=20000, **_):
    rng = np.random.default_rng(0)

    def reviews(n):
        out = np.empty(n, dtype=object)
        out[:] = [list(rng.integers(1, num_words, rng.integers(20, 400))) for _ in range(n)]
        return out

    return (reviews(N_TRAIN), rng.integers(0, 2, N_TRAIN)), (reviews(N_TEST), rng.integers(0, 2, N_TEST))


class _Stop(Exception):
    """Raised by the second ``fit`` call: the example has trained once."""


class Run:
    """One run of an example: ``change(model)`` before its ``fit``, what the fit did."""

    def __init__(self, change):
        self.change = change
        self.before = self.after = self.losses = self.model = self.batch = None

    def fit(self, original, model, x=None, y=None, **kwargs):
        if self.after is not None:
            raise _Stop
        self.change(model)
        self.model = model
        self.batch = (x[: kwargs.get("batch_size", 32)], y[: kwargs.get("batch_size", 32)])
        self.before = [np.asarray(v.value) for v in model.trainable_variables]
        has_validation = kwargs.get("validation_data") is not None or kwargs.get("validation_split")
        kwargs.update(epochs=1, steps_per_epoch=STEPS, verbose=0)
        if has_validation:
            kwargs["validation_steps"] = 2
        history = original(model, x, y, **kwargs)
        self.after = [np.asarray(v.value) for v in model.trainable_variables]
        self.losses = np.asarray(history.history["loss"], np.float64)
        return history

    def gradient(self, rec=None) -> np.ndarray:
        """The gradient of the model's loss at its weights before the fit, on the fit's first
        ``batch_size`` examples (dropout off), under ``recipes.apply(loss, rec)`` or in float32."""
        model, (x, y) = self.model, self.batch
        non_trainable = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in model.metrics_variables]

        def loss(trainable):
            return model.compute_loss_and_updates(trainable, non_trainable, metrics, x, y, None, training=False)[0]

        grad = jax.grad(loss if rec is None else scalify.recipes.apply(loss, rec))
        with jax.numpy_dtype_promotion("standard"):
            return np.concatenate([np.ravel(g) for g in grad([jnp.asarray(w) for w in self.before])])


def _import_keras_for_tensorflow(name, globals=None, locals=None, fromlist=(), level=0):
    """The example's ``import`` statements, with ``tensorflow`` and ``tensorflow.keras...`` served
    by Keras itself."""
    if name == "tensorflow":
        return types.SimpleNamespace(keras=keras)
    if name.startswith("tensorflow.keras"):
        module = keras
        for part in name.split(".")[2:]:
            module = getattr(module, part)
        return module
    return builtins.__import__(name, globals, locals, fromlist, level)


@contextlib.contextmanager
def patched(run: Run):
    """Keras's datasets and ``Model.fit`` as the script supplies them, while one example runs."""
    adam = keras.optimizers.Adam
    saved = (keras.datasets.mnist.load_data, keras.datasets.imdb.load_data, keras.Model.fit, adam.__init__)
    original_fit, original_init = keras.Model.fit, adam.__init__

    def fit(model, *args, **kwargs):
        return run.fit(original_fit, model, *args, **kwargs)

    def init(self, *args, epsilon=1e-2, **kwargs):
        original_init(self, *args, epsilon=epsilon, **kwargs)

    keras.datasets.mnist.load_data, keras.datasets.imdb.load_data, keras.Model.fit = _mnist, _imdb, fit
    adam.__init__ = init
    try:
        yield
    finally:
        keras.datasets.mnist.load_data, keras.datasets.imdb.load_data, keras.Model.fit, adam.__init__ = saved


def execute(path: Path, run: Run) -> None:
    """Run the example file as ``__main__`` under :func:`patched`, until its second ``fit``."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    code = compile(path.read_text(), str(path), "exec")
    env = {"__name__": "__main__", "__file__": str(path)}
    env["__builtins__"] = {**vars(builtins), "__import__": _import_keras_for_tensorflow}
    with patched(run), contextlib.redirect_stdout(None), jax.numpy_dtype_promotion("standard"):
        try:
            exec(code, env)
        except _Stop:
            pass
    if run.after is None:
        raise AssertionError(f"{path.name} never called model.fit")


def check(path: Path, rec) -> tuple[str, str]:
    """(outcome, detail) of the example under ``rec`` (see the module docstring)."""
    apply = lambda m: setattr(m, "train_step", scalify.recipes.apply(m.train_step, rec))
    on_loss = lambda m: setattr(m, "train_step", keras_step_with_the_recipe_on_the_loss(m, rec))
    got, ref, f32 = Run(apply), Run(on_loss), Run(lambda m: None)

    def run():
        for r in (got, ref, f32):
            execute(path, r)
        if (~np.isfinite(got.losses) & np.isfinite(f32.losses)).any():
            raise AssertionError(f"losses {got.losses} not finite where float32's {f32.losses} are")
        for i, (a, b) in enumerate(zip(got.after, ref.after, strict=True)):
            tol = 1e-5 * np.abs(b).max()
            np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"weight {i} vs the loss-side recipe")
        c = cosine(got.gradient(rec), got.gradient())
        detail = f"{len(got.after)} weights as the loss-side recipe's; gradient's cosine with float32's {c:.4f}"
        floor = cosine_floor(rec)
        if floor is None:
            for a, b in zip(got.after, f32.after, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(b).max())))
        return c, detail, floor

    return recipe_outcome(run)


def main(argv=None) -> int:
    recipe_names, options, argv = _recipes_arg(argv)
    args, names, _ = parse_cli(__doc__, EXAMPLES, "keras-io", argv)
    if args.source is None:
        raise SystemExit("keras-io is not on PyPI: pass --source DIR (a git checkout of keras-team/keras-io)")
    runs = [recipe(n, **options) for n in (recipe_names or DEFAULT_RECIPES)]
    print(f"keras {keras.__version__} ({keras.backend.backend()}), examples from {args.source.resolve()}")
    rows = []
    for name in names:
        path = args.source.resolve() / EXAMPLES[name]
        for rec in runs:
            outcome, detail = check(path, rec)
            rows.append((name, rec.name, outcome, detail))
            print(f"{name:38s} {rec.name:18s} {outcome:7s} {detail}", flush=True)
    return summary(rows, names, runs, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
