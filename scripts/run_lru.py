"""Linear Recurrent Units (complex diagonal recurrences) trained by their own code, under ``scalify``.

    git clone https://github.com/NicolasZucchet/minimal-LRU /tmp/minimal-LRU
    python scripts/run_lru.py --source /tmp/minimal-LRU                   # one format per family
    python scripts/run_lru.py --source /tmp/minimal-LRU --formats all --markdown
    python scripts/run_lru.py --source /tmp/minimal-LRU --recipes all     # scalify.recipes.apply

The model is ``lru/model.py`` of a checkout of minimal-LRU (Zucchet's JAX implementation of Orvieto
et al. 2023, "Resurrecting Recurrent Neural Networks for Long Sequences"), imported from
``--source`` at run time with its training code ``lru/train_helpers.py``; nothing of it is copied
here. An LRU layer holds complex parameters as real pairs (``B_re``, ``B_im``, ``C_re``, ``C_im``) and
log-parametrised eigenvalues, projects the real features with the complex ``B`` (``dot_general``
of float32 and complex64 operands), runs the diagonal recurrence ``h_t = lambda h_{t-1} + B u_t``
with ``jax.lax.associative_scan`` over complex values and reads ``Re(C h_t) + D u_t``; each
sequence layer adds a GELU, a GLU of two ``nn.Dense`` and a normalisation. The classifier is
``BatchClassificationModel``: ``nn.vmap`` over the batch with ``axis_name="batch"``, so its
``nn.BatchNorm`` averages across the vmapped batch, and dropout draws one key per sequence.

The checks run the repository's own jitted ``train_step`` (``jax.value_and_grad`` of its loss,
``TrainState.apply_gradients`` with the optimizer of its ``create_train_state``:
``optax.multi_transform`` of ``inject_hyperparams(adam)`` for the recurrence's parameters and
``inject_hyperparams(adamw)`` for the rest; Adam's ``eps`` set to 1e-2 in that state, see
:func:`build`), at d_model = d_hidden = 64, 2 layers, 32 steps of 8
input channels, batch 4, 10 classes, dropout 0.1:

* ``lru_batchnorm``: the repository's default classifier (BatchNorm after each layer);
* ``lru_layernorm``: LayerNorm before each layer (``norm="layer"``, ``prenorm=True``).

Per format, ``jax.jit(scalify.scalify(train_step))`` on a state whose weight matrices the format
accepts are ScaledArrays (the third-party harness's ``quantize_tree``) against the same step in
float32 on the dequantized weights: loss, updated parameters, optimizer state and batch statistics
within the harness's tolerance. Complex values have no narrow form: under ``scalify`` they are
computed from the float32 values of their operands (``docs/operators.md``), so the LRU's complex
products must equal float32's; before that rule a real ScaledArray times a complex matrix dropped
the imaginary part (a loss 0.8% off float32's).

With ``--recipes`` the float32 state stays as it is: ``recipes.apply(loss, recipe)`` under
``jax.value_and_grad`` (``run_keras_hub_models.check_recipe``: the gradient's cosine with float32's
above the recipe's floor; the high-precision recipe reproduces float32), then the repository's
``train_step`` itself under ``recipes.apply`` (finite, its loss that of the recipe's forward), at
widths and 128 input channels (:data:`RECIPE_WIDTH`) with the classifier head in high precision.
The recipes quantize the ``nn.Dense`` GEMMs; the complex contractions stay the program's (a
recipe's formats are real).
"""

from __future__ import annotations

import importlib
import sys
import types
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from run_flax_examples import failure  # noqa: E402
from run_keras_hub_models import check_recipe  # noqa: E402
from run_recurrentgemma import run_table  # noqa: E402
from thirdparty_harness import Case, assert_tree_close, dequantize_tree, n_scaled, quantize_tree  # noqa: E402

import scalify  # noqa: E402
from scalify import recipes  # noqa: E402

REPO = "https://github.com/NicolasZucchet/minimal-LRU"
D_MODEL, D_HIDDEN, LAYERS, SEQ, IN_DIM, BATCH, CLASSES, DROPOUT = 64, 64, 2, 32, 8, 4, 10, 0.1
# Under a recipe every quantized GEMM dimension must be a multiple of the recipe's block (128 for
# the blockwise float8 ones): 128 input channels (a one-hot vocabulary of 128 symbols, as the
# repository's text tasks feed) and widths; the classifier head (10 classes, its weight gradient
# summed over the 4 sequences) stays in high precision, as Transformer Engine keeps a last layer.
RECIPE_WIDTH, RECIPE_SCOPES = 128, ("decoder",)
MODELS = {"lru_batchnorm": {"norm": "batch", "prenorm": False}, "lru_layernorm": {"norm": "layer", "prenorm": True}}
CHECKS = tuple(MODELS)


def fetch(work: Path) -> Path:
    raise SystemExit(f"minimal-LRU is not on PyPI: git clone {REPO} and pass --source DIR.")


def import_lru(root: Path):
    """``lru.model`` and ``lru.train_helpers`` of the checkout at ``root``."""
    sys.path.insert(0, str(root))
    return types.SimpleNamespace(
        model=importlib.import_module("lru.model"), helpers=importlib.import_module("lru.train_helpers")
    )


def build(lib, name: str, recipe_run: bool = False):
    """``(state, model, step, batch)``: the repository's ``TrainState``, its classifier in training
    mode, its ``train_step`` with the model bound, and one batch ``(key, inputs, labels, masks)``."""
    m, h = lib.model, lib.helpers
    width, in_dim = (RECIPE_WIDTH, RECIPE_WIDTH) if recipe_run else (D_MODEL, IN_DIM)
    lru = partial(m.LRU, d_hidden=width, d_model=width, r_min=0.4, r_max=0.99)
    model_cls = partial(
        m.BatchClassificationModel,
        lru=lru,
        d_output=CLASSES,
        d_model=width,
        n_layers=LAYERS,
        dropout=DROPOUT,
        pooling="mean",
        **MODELS[name],
    )
    norm = MODELS[name]["norm"]
    state = h.create_train_state(model_cls, jax.random.PRNGKey(0), in_dim, BATCH, SEQ, 0.05, norm, 1e-3, 4e-3)
    # Adam's eps, an injected hyperparameter, set in the state as the repository's
    # ``update_learning_rate_per_step`` sets the learning rate: at optax's 1e-8 the first step is
    # lr * g / (|g| + 1e-8), which turns a gradient entry that is zero up to float32 rounding (a
    # dropped-out unit's: 9e-11 in float32, 5e-10 scaled) into a step of any size up to lr. The
    # harness's Adam uses 1e-2 for the same reason (``make_optimizer``).
    for group in ("regular", "ssm"):
        state.opt_state.inner_states[group].inner_state.hyperparams["eps"] = jnp.asarray(1e-2, jnp.float32)
    rng = np.random.default_rng(0)
    batch = (
        jax.random.PRNGKey(1),
        jnp.asarray(rng.standard_normal((BATCH, SEQ, in_dim)), jnp.float32),
        jnp.asarray(rng.integers(0, CLASSES, BATCH)),
        jnp.ones((BATCH, SEQ)),
    )
    model = model_cls(training=True)
    return state, model, partial(h.train_step, model=model, norm=norm), batch


def check_step(lib, name: str, fmt) -> tuple[str, str]:
    """``(outcome, detail)`` of the repository's ``train_step`` under ``scalify`` in ``fmt``."""
    try:
        state, _, step, batch = build(lib, name)
        qparams = quantize_tree(state.params, fmt)
        if n_scaled(qparams) == 0:
            return "n/a", f"no weight has a shape {fmt.name} accepts"
        expected = jax.jit(step)(state.replace(params=dequantize_tree(qparams)), *batch)
        got = jax.jit(scalify.scalify(step))(state.replace(params=qparams), *batch)
        (new, loss), (new_ref, loss_ref) = got, expected
        assert_tree_close(loss, loss_ref, fmt, f"{name} loss")
        assert_tree_close(new.params, new_ref.params, fmt, f"{name} updated parameters")
        assert_tree_close(new.opt_state, new_ref.opt_state, fmt, f"{name} optimizer state")
        if MODELS[name]["norm"] == "batch":
            assert_tree_close(new.batch_stats, new_ref.batch_stats, fmt, f"{name} batch statistics")
    except Exception as exc:  # reported per (model, format); the run goes on
        return failure(exc)
    n = len(jax.tree.leaves(state.params))
    return "ok", f"loss {float(loss):.4f} as float32's, {n_scaled(qparams)} of {n} weights scaled"


def check_step_recipe(lib, name: str, recipe) -> tuple[str, str]:
    """``(outcome, detail)`` of ``recipes.apply`` on the loss (the gradient's cosine) and on the
    repository's ``train_step`` as a whole."""
    try:
        state, model, step, (key, inputs, labels, masks) = build(lib, name, recipe_run=True)
        recipe = recipe.replace(high_precision_scopes=(*recipe.high_precision_scopes, *RECIPE_SCOPES))
        stats = {"batch_stats": state.batch_stats} if MODELS[name]["norm"] == "batch" else {}

        def loss(params, batch):
            key, inputs, labels, masks = batch
            out = model.apply({"params": params, **stats}, inputs, rngs={"dropout": key}, mutable=list(stats))
            return lib.helpers.loss_fn(out[0], labels, masks)

        outcome, detail = check_recipe(Case(name, loss, state.params, (key, inputs, labels, masks)), recipe)
        if outcome != "ok":
            return outcome, detail
        new, value = jax.jit(recipes.apply(step, recipe))(state, key, inputs, labels, masks)
        forward = jax.jit(recipes.apply(loss, recipe))(state.params, (key, inputs, labels, masks))
        np.testing.assert_allclose(float(value), float(forward), rtol=1e-6)
        assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(new.params)), "non-finite step"
    except Exception as exc:  # reported per (model, recipe); the run goes on
        return failure(exc)
    return "ok", detail + "; train_step under the recipe: finite, its loss the recipe's"


def run_check(lib, name: str, column, recipe_run: bool) -> tuple[str, str]:
    return check_step_recipe(lib, name, column) if recipe_run else check_step(lib, name, column)


def main(argv=None) -> int:
    this = types.SimpleNamespace(__doc__=__doc__, package="minimal-LRU", version="", fetch=fetch, load=import_lru)
    return run_table(this, 14, CHECKS, run_check, argv)


if __name__ == "__main__":
    sys.exit(main())
