"""Training modes and the training loop.

The models (:mod:`examples.train.models`) are plain JAX; each mode sets the numerics from outside,
through the public API only (:func:`describe_mode`):

* ``fp32`` / ``bf16`` / ``fp16``: plain ``jax.jit`` step. Parameters, activations, gradients and the
  optimizer state are stored and computed in that dtype; no scaling of any kind, no float32 master
  weights. The loss (log-softmax and cross-entropy) is computed in float32 in every mode.
* ``fp16-scalify``: the parameters are float16 :class:`scalify.ScaledArray` s
  (``scalify.as_scaled_array``: data float16, float32 scale) and the whole step (forward, backward,
  optax update) runs under ``jax.jit(scalify.scalify(step))``; scalify's rules renormalise the
  contractions' outputs, nothing in the model rescales by hand. The optimizer state (SGD: none;
  Adam: both moments) is float16 ScaledArrays; Adam's arithmetic (moment recurrences, bias
  correction, ``mu / (sqrt(nu) + eps)``) runs on a float32 carrier and its second moment is stored as
  ``sqrt(nu)`` (:func:`adam_fp32_update`: ``nu = g**2`` spans more than float16's range within one
  tensor). The initial optimizer state is built in the layout the step returns
  (``scalify.tree.settle_state``), so the step compiles once.
* any registered qformats format ``F`` (except ``fp16`` and ``bf16``, whose names the plain modes
  take): the unchanged float32 model's loss under ``scalify.amp.amp`` with ``F`` as the policy of
  every ``dot_general``: both operands of every matmul are quantized into ``F`` (block formats block
  along the contracted axis, per-channel formats put their channels on a free axis) with a
  straight-through gradient, so backward matmuls run on float32 gradients. ``fp8_e4m3`` instead runs
  under ``scalify.recipes.apply`` with a recipe that also quantizes the gradient of every matmul
  output into per-tensor ``fp8_e5m2`` (E4M3 forward, E5M2 backward). Weights and optimizer state
  stay float32 (master weights).
* ``recipe:NAME`` (``--recipe NAME``): the unchanged float32 loss under
  ``scalify.recipes.apply(loss, NAME)``.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax

import qformats as qf
import scalify
from examples.train import data, models
from scalify import amp, ops, recipes

PLAIN_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
SCALIFY_FP16 = "fp16-scalify"
MODELS = ("mlp", "transformer")
# Per-model hyperparameters (fixed; small enough for a CPU).
MLP_HPARAMS = {"batch_size": 128, "lr": 0.1, "optimizer": "sgd"}
GPT_HPARAMS = {"batch_size": 32, "lr": 3e-3, "optimizer": "adam", "eval_batches": 8}
GRAD_FORMATS = {"fp8_e4m3": "fp8_e5m2"}


def list_modes() -> list[str]:
    """Every ``--format`` value: the plain dtypes, ``fp16-scalify`` and the registered formats."""
    fmts = [f for f in qf.list_formats() if f not in PLAIN_DTYPES]
    return [*PLAIN_DTYPES, SCALIFY_FP16, *fmts]


@attrs.frozen
class Mode:
    """A ``--format`` value: the dtype the model computes in and the numerics set from outside it."""

    name: str
    dtype: object
    mechanism: str
    use_scalify: bool = False  # float16 ScaledArray parameters, whole step under scalify
    quantize: object = None  # a qformats format (amp policy of every matmul) or a scalify.recipes.Recipe


RECIPE_PREFIX = "recipe:"


def recipe_mode(recipe_name: str) -> str:
    """The mode name of ``--recipe NAME``."""
    return RECIPE_PREFIX + recipe_name


def get_mode(name: str) -> Mode:
    """The :class:`Mode` of a ``--format`` value (raises ``ValueError`` naming the valid values)."""
    if name.startswith(RECIPE_PREFIX):
        recipe = recipes.get_recipe(name[len(RECIPE_PREFIX) :])
        mech = (
            f"recipes.apply(loss, {recipe.name}) on the unchanged float32 model: every matmul's forward, "
            f"input-gradient and weight-gradient GEMMs quantized as the recipe says"
        )
        return Mode(name, jnp.float32, mech, quantize=recipe)
    if name in PLAIN_DTYPES:
        dt = PLAIN_DTYPES[name]
        return Mode(name, dt, f"plain jit, everything in {jnp.dtype(dt).name}")
    if name == SCALIFY_FP16:
        mech = (
            "scalify: float16 ScaledArray params/activations/grads/optimizer state, scales set by scalify's rules "
            "(the Adam update on a float32 carrier, Adam's second moment stored as sqrt(nu))"
        )
        return Mode(name, jnp.float16, mech, use_scalify=True)
    try:
        fmt = qf.get_format(name)
    except Exception as e:
        raise ValueError(f"Unknown --format {name!r}; choose one of: {', '.join(list_modes())}") from e
    grad = GRAD_FORMATS.get(fmt.name)
    if grad is None:
        mech = f"amp: both operands of every matmul fake-quantized to {fmt.name} (straight-through backward)"
        return Mode(name, jnp.float32, mech, quantize=fmt)
    # The gradient dy of every matmul output in the grad format, in both backward GEMMs; the
    # forward operands in fmt, as the forward quantized them.
    recipe = recipes.Recipe.uniform(name, fmt).replace(dgrad_lhs=grad, wgrad_lhs=grad)
    mech = f"recipes.apply: matmul operands in {fmt.name}, the gradient of every matmul output in {grad}"
    return Mode(name, jnp.float32, mech, quantize=recipe)


def describe_mode(name: str) -> str:
    """How mode ``name`` trains, in one line."""
    return get_mode(name).mechanism


def with_numerics(mode: Mode, fn: Callable) -> Callable:
    """``fn`` (a loss or a model, unchanged) with the mode's quantization applied from outside."""
    if isinstance(mode.quantize, recipes.Recipe):
        return recipes.apply(fn, mode.quantize)
    if mode.quantize is not None:
        return amp.amp(fn, compute_dtype=jnp.float32, amp_policy={p: mode.quantize for p in amp.MATMUL_PRIMITIVES})
    return fn


def _cross_entropy(logits, labels, n_classes):
    """Mean cross-entropy, computed in float32 in every mode."""
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, n_classes, dtype=jnp.float32)
    return -jnp.mean(jnp.sum(onehot * logp, axis=-1))


def _plain(x):
    """The value of a ScaledArray (a loss under scalify), or ``x``."""
    return x.to_array() if isinstance(x, scalify.ScaledArray) else x


def _make_optimizer(kind, lr, fp32_update=False):
    """optax SGD or Adam; ``fp32_update``: :func:`adam_fp32_update` (float16 ScaledArray moments)."""
    if kind == "sgd":
        return optax.sgd(lr)
    if fp32_update:
        return adam_fp32_update(lr)
    return optax.adam(lr)


class AdamState(NamedTuple):
    count: jnp.ndarray
    mu: object
    rms: object  # sqrt of Adam's second moment nu (see adam_fp32_update)


def adam_fp32_update(lr, b1=0.9, b2=0.999, eps=1e-8) -> optax.GradientTransformation:
    """Adam whose moments are stored like the parameters (float16 ScaledArrays under fp16-scalify)
    while the moment recurrences, the bias correction and ``mu / (sqrt(nu) + eps)`` run on a float32
    carrier, the results cast back to the gradient's dtype.

    The second moment is stored as its square root ``rms = sqrt(nu)`` (``nu = rms**2`` is recomputed in
    float32 at each step). ``nu`` holds ``g**2``, whose spread within one tensor is the square of the
    gradient's: a transformer's gradient spans ~1e6 inside a weight matrix, so ``g**2`` spans ~1e12,
    more than float16 holds under one per-tensor scale (normal range ~1e9, subnormals included ~1e12).
    Stored as ``nu``, the small entries flush to zero while ``mu`` keeps them, and their update
    ``mu / (0 + eps)`` is thousands of times Adam's ``lr`` (measured on the char transformer's first
    step: up to 6000x on a few hundred weights, which set its training back by tens of steps). ``rms``
    has the gradient's own spread, the same as ``mu``'s.
    """

    def init(params):
        return AdamState(
            jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params)
        )

    def new_rms(r, x):
        r32, x32 = r.astype(jnp.float32), x.astype(jnp.float32)
        nu = b2 * (r32 * r32) + (1 - b2) * (x32 * x32)
        return ops.dynamic_rescale_max(jnp.sqrt(nu)).astype(x.dtype)

    def update(g, state, params=None):
        del params
        count = state.count + 1
        mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
        rms = jax.tree.map(new_rms, state.rms, g)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        sqrt_c2 = jnp.sqrt(1 - b2 ** count.astype(jnp.float32))

        def upd(m, r, x):
            m32 = m.astype(jnp.float32) / c1
            r32 = r.astype(jnp.float32) / sqrt_c2
            return ops.dynamic_rescale_max(-lr * m32 / (r32 + eps)).astype(x.dtype)

        return jax.tree.map(upd, mu, rms, g), AdamState(count, mu, rms)

    return optax.GradientTransformation(init, update)


@attrs.define
class TrainResult:
    """Final metrics and the per-step training loss history."""

    model: str
    format: str
    mechanism: str
    steps: int
    seed: int
    init_scale: float
    train_loss: float
    val_loss: float
    val_accuracy: float | None
    time_s: float
    step_s: float = float("nan")  # mean seconds per step after the first (which compiles)
    history: list[float] = attrs.field(factory=list, repr=False)
    # traces of the step during the training loop: 1 when it compiled once (the first step), more
    # when a step returned its state in another layout than it was given
    step_traces: int = attrs.field(default=0, repr=False)

    def metrics(self) -> dict:
        d = attrs.asdict(self)
        d.pop("history")
        d.pop("step_traces")
        if d["val_accuracy"] is None:
            d.pop("val_accuracy")
        return d


def _finite_or_nan(v) -> float:
    v = float(v)
    return v if math.isfinite(v) else float("nan")


def _freeze(obj):
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, list):
        return tuple(_freeze(v) for v in obj)
    return obj


def _thaw(obj):
    if (
        isinstance(obj, tuple)
        and obj
        and all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) for e in obj)
    ):
        return {k: _thaw(v) for k, v in obj}
    return obj


class StepFunctions(NamedTuple):
    """The jitted step and evaluation of a model and mode, the optimizer, and a trace counter."""

    step: Callable  # (params, opt_state, x, y) -> (params, opt_state, loss)
    evaluate: Callable  # (params, x, y) -> (loss, number correct)
    optimizer: optax.GradientTransformation
    traces: list  # traces[0]: how many times the step has been traced (one per compilation)


def step_functions(model: str, fmt: str, hparams: dict) -> StepFunctions:
    """The :class:`StepFunctions` of ``model`` in mode ``fmt`` (cached: shared across seeds)."""
    return _step_functions(model, fmt, _freeze(hparams))


@functools.lru_cache(maxsize=64)
def _step_functions(model, fmt, hp_frozen):
    hp = _thaw(hp_frozen)
    mode = get_mode(fmt)
    if model == "mlp":
        n_classes = 10
        apply = models.mlp_apply
    else:
        cfg = models.GPTConfig(**hp.get("gpt", {}))
        n_classes = cfg.vocab

        def apply(p, x):
            return models.gpt_apply(p, x, cfg)

    apply = with_numerics(mode, apply)
    opt = _make_optimizer(hp["optimizer"], hp["lr"], fp32_update=fmt == SCALIFY_FP16)
    traces = [0]

    def loss_fn(p, x, y):
        return _cross_entropy(apply(p, x), y, n_classes)

    def step(p, s, x, y):
        traces[0] += 1  # Python runs only while jax traces the step
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        upd, s = opt.update(g, s, p)
        p = optax.apply_updates(p, upd)
        return p, s, loss

    def evaluate(p, x, y):
        logits = apply(p, x).astype(jnp.float32)
        loss = _cross_entropy(logits, y, n_classes)
        correct = jnp.sum(jnp.argmax(logits, axis=-1) == y)
        return loss, correct

    if mode.use_scalify:
        step, evaluate = scalify.scalify(step), scalify.scalify(evaluate)
    return StepFunctions(jax.jit(step), jax.jit(evaluate), opt, traces)


def _setup(model, hp, key, init_scale):
    """Float32 initial parameters, the training batches and the validation batches."""
    if model == "mlp":
        x_tr, y_tr, x_va, y_va = data.load_digits()
        params = models.mlp_init(key, init_scale, hp.get("mlp_sizes", models.MLP_SIZES), hp.get("init_std"))
        return params, data.digits_batches(x_tr, y_tr, hp["batch_size"], hp["seed"]), [(x_va, y_va)]
    cfg = models.GPTConfig(**hp.get("gpt", {}))
    tr_ids, va_ids = data.load_text()
    params = models.gpt_init(key, cfg, init_scale)
    batches = data.text_batches(tr_ids, hp["batch_size"], cfg.context, hp["seed"])
    return params, batches, data.text_eval_windows(va_ids, hp["batch_size"], cfg.context, hp["eval_batches"])


def train(
    model: str = "mlp",
    fmt: str = "fp32",
    steps: int = 200,
    seed: int = 0,
    init_scale: float = 1.0,
    *,
    progress: bool | Callable = False,
    hparams: dict | None = None,
) -> TrainResult:
    """Train ``model`` (``"mlp"`` on digits or ``"transformer"`` on stdlib source) in mode ``fmt``.

    ``progress``: True for a progress bar (tqdm if installed, else a line every 10% on stderr).
    ``hparams`` overrides the per-model defaults (``batch_size``, ``lr``, ``optimizer``, ...).
    """
    if model not in MODELS:
        raise ValueError(f"Unknown model {model!r}; choose one of {MODELS}")
    mode = get_mode(fmt)
    hp = {**(MLP_HPARAMS if model == "mlp" else GPT_HPARAMS), **(hparams or {})}
    params, batches, val_batches = _setup(model, {**hp, "seed": seed}, jax.random.key(seed), init_scale)
    fns = step_functions(model, fmt, hp)

    def to_input(x):
        return jnp.asarray(x, mode.dtype) if np.issubdtype(np.asarray(x).dtype, np.floating) else jnp.asarray(x)

    params = jax.tree.map(lambda a: a.astype(mode.dtype), params)
    if mode.use_scalify:
        params = scalify.as_scaled_array(params)
        opt_state = scalify.scalify(fns.optimizer.init)(params)
        first = next(batches)
        # the initial state in the layout the step returns, so that the step compiles once
        params, opt_state = scalify.tree.settle_state(
            fns.step, (params, opt_state), to_input(first[0]), jnp.asarray(first[1])
        )
        batches = itertools.chain([first], batches)
    else:
        opt_state = fns.optimizer.init(params)

    bar = _progress(progress, steps, f"{model}/{fmt}")
    history = []
    traces0 = fns.traces[0]
    t0 = time.perf_counter()
    t1 = t0
    for i in range(steps):
        x, y = next(batches)
        params, opt_state, loss = fns.step(params, opt_state, to_input(x), jnp.asarray(y))
        history.append(_plain(loss))
        if i == 0:  # the first step includes the compilation
            jax.block_until_ready(history[0])
            t1 = time.perf_counter()
        if bar is not None and (i % 10 == 9 or i == steps - 1):
            bar(i + 1, float(_plain(loss)))
    history = [_finite_or_nan(v) for v in jax.device_get(history)]
    step_s = (time.perf_counter() - t1) / (steps - 1) if steps > 1 else float("nan")
    traces = fns.traces[0] - traces0

    val_loss, val_acc = _evaluate(fns.evaluate, params, val_batches, to_input)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar(None, None)
    tail = history[-10:] if history else [float("nan")]
    return TrainResult(
        model=model,
        format=fmt,
        mechanism=mode.mechanism,
        steps=steps,
        seed=seed,
        init_scale=init_scale,
        train_loss=float(np.mean(tail)),
        val_loss=val_loss,
        val_accuracy=val_acc if model == "mlp" else None,
        time_s=round(elapsed, 3),
        step_s=round(step_s, 4),
        history=history,
        step_traces=traces,
    )


def _evaluate(eval_fn, params, val_batches, to_input):
    """(mean validation loss, accuracy) over the validation batches."""
    tot_loss, tot_correct, tot_n = 0.0, 0, 0
    for x, y in val_batches:
        loss, correct = eval_fn(params, to_input(x), jnp.asarray(y))
        n = int(np.size(y))
        tot_loss += float(_plain(loss)) * n
        tot_correct += int(_plain(correct))
        tot_n += n
    return _finite_or_nan(tot_loss / tot_n), tot_correct / tot_n


def _progress(progress, total, desc):
    """A callback ``(step, loss)``; ``(None, None)`` closes it. None when progress is off."""
    if callable(progress):
        return progress
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"next": 0}

        def simple(step, loss):
            if step is None:
                return
            if step >= state["next"] or step == total:
                print(f"[{desc}] step {step}/{total} loss {loss:.4f}", file=sys.stderr, flush=True)
                state["next"] = step + max(total // 10, 1)

        return simple
    bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)

    def cb(step, loss):
        if step is None:
            bar.close()
            return
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.4f}")

    return cb
