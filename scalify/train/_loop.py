"""Training modes and the training loop.

Mechanisms (:func:`describe_mode`):

* ``fp32`` / ``bf16`` / ``fp16``: plain ``jax.jit`` step. Parameters, activations, gradients and the
  optimizer state are stored and computed in that dtype; no scaling of any kind, no float32 master
  weights. The loss (log-softmax and cross-entropy) is computed in float32 in every mode.
* ``fp16-scalify``: parameters are float16 :class:`scalify.ScaledArray` s (data float16, float32
  scale) and the whole step (forward, backward, optax update) runs under ``jax.jit(scalify.scalify(step))``.
  The gradient of every matmul output is rescaled dynamically (``scalify.ops.dynamic_rescale_l2_grad``)
  and the parameter gradients are rescaled (``dynamic_rescale_l2``) before the optimizer, as in
  jax-scalify's examples. The optimizer state (SGD: none; Adam: both moments) is float16 ScaledArrays;
  Adam's arithmetic (moment recurrences, bias correction, ``mu / (sqrt(nu) + eps)``) runs on a float32
  carrier and its second moment is stored as ``sqrt(nu)`` (:func:`adam_fp32_update`: ``nu = g**2``
  spans more than float16's range within one tensor), and the transformer's LayerNorm runs on a
  float32 carrier (``Numerics.norm_dtype``).
* any registered qformats format ``F`` (except ``fp16`` and ``bf16``, whose names the plain modes
  take): parameters are float32 carrier ScaledArrays and the whole step runs under
  ``jax.jit(scalify.scalify(step))``. Both operands of every matmul are quantized into ``F`` with
  ``scalify.ops.quantize`` (block formats block along the contracted axis, per-channel formats put
  their channels on a free axis), so the forward matmuls see ``F`` values; the gradient of
  ``ops.quantize`` is straight-through, so backward matmuls run on float32 values, except for
  ``fp8_e4m3``, where the gradient of every matmul output is also quantized to per-tensor
  ``fp8_e5m2`` (E4M3 forward, E5M2 backward). Weights and optimizer state stay float32 (master weights).
  Matmul-output and parameter gradients are rescaled dynamically as under ``fp16-scalify`` (powers of
  two: exact on a float32 carrier). Without it, per-tensor formats drift: scalify's per-tensor
  ``dot_general`` rule multiplies the scales and never renormalises the data, so through the backward
  pass a gradient's data shrinks to ~1e-25 while its scale grows to ~1e20, and Adam's ``g * g`` then
  underflows the data and overflows the scale in float32 (``fp8_e5m2``: NaN from the second step).

Under scalify the initial optimizer state is built directly in the structure the step returns (zero
ScaledArrays, parameters on the returned scale grids; :func:`_settle`), so the step compiles once.
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
from scalify import ops, recipes
from scalify.train import _data, _models

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
    name: str
    numerics: _models.Numerics
    use_scalify: bool
    mechanism: str
    recipe: object = None  # a scalify.recipes.Recipe applied to the unchanged float32 loss


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
        return Mode(name, _models.Numerics(dtype=jnp.float32), False, mech, recipe)
    if name in PLAIN_DTYPES:
        dt = PLAIN_DTYPES[name]
        return Mode(name, _models.Numerics(dtype=dt), False, f"plain jit, everything in {jnp.dtype(dt).name}")
    if name == SCALIFY_FP16:
        return Mode(
            name,
            _models.Numerics(dtype=jnp.float16, rescale_grads=True, norm_dtype=jnp.float32),
            True,
            "scalify: float16 ScaledArray params/activations/grads/optimizer state, dynamic grad rescaling "
            "(LayerNorm and the Adam update on a float32 carrier, Adam's second moment stored as sqrt(nu))",
        )
    try:
        fmt = qf.get_format(name)
    except Exception as e:
        raise ValueError(f"Unknown --format {name!r}; choose one of: {', '.join(list_modes())}") from e
    grad = GRAD_FORMATS.get(fmt.name)
    grad_fmt = qf.get_format(grad) if grad else None
    mech = f"scalify + ops.quantize of matmul operands to {fmt.name} (straight-through backward"
    mech += f", output grads in {grad})" if grad else ")"
    mech += ", dynamic grad rescaling"
    return Mode(name, _models.Numerics(dtype=jnp.float32, fmt=fmt, grad_fmt=grad_fmt, rescale_grads=True), True, mech)


def describe_mode(name: str) -> str:
    return get_mode(name).mechanism


def _cross_entropy(logits, labels, n_classes):
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, n_classes, dtype=jnp.float32)
    return -jnp.mean(jnp.sum(onehot * logp, axis=-1))


def _plain(x):
    return x.to_array() if isinstance(x, scalify.ScaledArray) else x


def _make_optimizer(kind, lr, fp32_update=False):
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

    def metrics(self) -> dict:
        d = attrs.asdict(self)
        d.pop("history")
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


@functools.lru_cache(maxsize=64)
def _compiled(model, fmt, hp_frozen):
    """Jitted (step, eval, optimizer) for a model, mode and hyperparameters (shared across seeds)."""
    hp = _thaw(hp_frozen)
    mode = get_mode(fmt)
    num = mode.numerics
    if model == "mlp":
        n_classes = 10
        apply = _models.mlp_apply
    else:
        cfg = _models.GPTConfig(**hp.get("gpt", {}))
        n_classes = cfg.vocab

        def apply(p, x, n):
            return _models.gpt_apply(p, x, n, cfg)

    opt = _make_optimizer(hp["optimizer"], hp["lr"], fp32_update=fmt == SCALIFY_FP16)

    if mode.recipe is not None:
        apply = recipes.apply(apply, mode.recipe)

    def loss_fn(p, x, y):
        return _cross_entropy(apply(p, x, num), y, n_classes)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        if num.rescale_grads:
            # Unit-norm data for every parameter gradient before the optimizer squares it.
            g = jax.tree.map(ops.dynamic_rescale_l2, g)
        upd, s = opt.update(g, s, p)
        p = optax.apply_updates(p, upd)
        return p, s, loss

    def evaluate(p, x, y):
        logits = apply(p, x, num).astype(jnp.float32)
        loss = _cross_entropy(logits, y, n_classes)
        correct = jnp.sum(jnp.argmax(logits, axis=-1) == y)
        return loss, correct

    if mode.use_scalify:
        return jax.jit(scalify.scalify(step)), jax.jit(scalify.scalify(evaluate)), opt
    return jax.jit(step), jax.jit(evaluate), opt


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
    num = mode.numerics
    key = jax.random.key(seed)
    if model == "mlp":
        hp = {**MLP_HPARAMS, **(hparams or {})}
        x_tr, y_tr, x_va, y_va = _data.load_digits()
        params = _models.mlp_init(key, init_scale, hp.get("mlp_sizes", _models.MLP_SIZES), hp.get("init_std"))
        batches = _data.digits_batches(x_tr, y_tr, hp["batch_size"], seed)
        val_batches = [(x_va, y_va)]
    else:
        hp = {**GPT_HPARAMS, **(hparams or {})}
        cfg = _models.GPTConfig(**hp.get("gpt", {}))
        tr_ids, va_ids = _data.load_text()
        params = _models.gpt_init(key, cfg, init_scale)
        batches = _data.text_batches(tr_ids, hp["batch_size"], cfg.context, seed)
        val_batches = _data.text_eval_windows(va_ids, hp["batch_size"], cfg.context, hp["eval_batches"])

    step_fn, eval_fn, opt = _compiled(model, fmt, _freeze(hp))
    dtype = num.dtype

    def to_input(x):
        return jnp.asarray(x, dtype) if np.issubdtype(np.asarray(x).dtype, np.floating) else jnp.asarray(x)

    params = jax.tree.map(lambda a: a.astype(dtype), params)
    if mode.use_scalify:
        params = scalify.as_scaled_array(params)
        opt_state = scalify.scalify(opt.init)(params)
        first = next(batches)
        params, opt_state = _settle(step_fn, params, opt_state, to_input(first[0]), jnp.asarray(first[1]))
        batches = itertools.chain([first], batches)
    else:
        opt_state = opt.init(params)

    bar = _progress(progress, steps, f"{model}/{fmt}")
    history = []
    t0 = time.perf_counter()
    t1 = t0
    for i in range(steps):
        x, y = next(batches)
        params, opt_state, loss = step_fn(params, opt_state, to_input(x), jnp.asarray(y))
        history.append(_plain(loss))
        if i == 0:  # the first step includes the compilation
            jax.block_until_ready(history[0])
            t1 = time.perf_counter()
        if bar is not None and (i % 10 == 9 or i == steps - 1):
            bar(i + 1, float(_plain(loss)))
    history = [_finite_or_nan(v) for v in jax.device_get(history)]
    step_s = (time.perf_counter() - t1) / (steps - 1) if steps > 1 else float("nan")

    tot_loss, tot_correct, tot_n = 0.0, 0, 0
    for x, y in val_batches:
        loss, correct = eval_fn(params, to_input(x), jnp.asarray(y))
        n = int(np.size(y))
        tot_loss += float(_plain(loss)) * n
        tot_correct += int(_plain(correct))
        tot_n += n
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
        val_loss=_finite_or_nan(tot_loss / tot_n),
        val_accuracy=(tot_correct / tot_n) if model == "mlp" else None,
        time_s=round(elapsed, 3),
        step_s=round(step_s, 4),
        history=history,
    )


_ZERO_STATE_SCALE = 2.0**-100


def _is_scaled(x) -> bool:
    return isinstance(x, scalify.ScaledArray)


def _same_layout(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        (u.shape, u.dtype) == (v.shape, v.dtype) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _settle(step_fn, params, opt_state, x, y, max_rounds=3):
    """``(params, opt_state)`` with the same values, in the pytree layout the step returns.

    Under scalify the step can return other scale grids than it was given (a moment takes the block
    grid of its gradient's scale, an updated parameter the grid of its update), and every new layout
    makes ``jax.jit`` compile the step again (tens of seconds each). The layout is found with
    ``jax.eval_shape`` (no compilation) until it is a fixed point:

    * a parameter is re-expressed on the returned grid with scale 1 (``data = value``, as
      ``scalify.as_scaled_array`` makes it);
    * an optimizer state that is entirely zero (every optimizer here at step 0) is rebuilt as zero
      ScaledArrays of the returned layout, with a tiny scale (2^-100), so that adding the first
      gradient keeps the gradient's scale (scale 1 would push a small float16 gradient's data towards
      underflow). A non-zero state is left as it is.

    Formatted (``fmt``) leaves are left as they are.
    """
    for _ in range(max_rounds):
        out_p, out_s = jax.eval_shape(step_fn, params, opt_state, x, y)[:2]
        same_p, same_s = _same_layout(out_p, params), _same_layout(out_s, opt_state)
        if same_p and same_s:
            break
        formatted = any(
            _is_scaled(v) and v.fmt is not None for v in jax.tree.leaves((out_p, out_s), is_leaf=_is_scaled)
        )
        if formatted or not (same_p or jax.tree.structure(out_p) == jax.tree.structure(params)):
            break
        if not same_p:
            params = jax.tree.map(_on_grid, params, out_p, is_leaf=_is_scaled)
        if not same_s:
            zero = all(not np.any(np.asarray(_plain(v))) for v in jax.tree.leaves(opt_state, is_leaf=_is_scaled))
            if not zero:
                break
            opt_state = jax.tree.map(_zeros_like_layout, out_s, is_leaf=_is_scaled)
    return params, opt_state


def _on_grid(p, sds):
    if not _is_scaled(p) or tuple(p.scale.shape) == tuple(sds.scale.shape):
        return p
    return scalify.ScaledArray(p.to_array(sds.data.dtype), jnp.ones(sds.scale.shape, sds.scale.dtype))


def _zeros_like_layout(sds):
    if _is_scaled(sds):
        scale = jnp.full(sds.scale.shape, _ZERO_STATE_SCALE, sds.scale.dtype)
        return scalify.ScaledArray(jnp.zeros(sds.data.shape, sds.data.dtype), scale)
    return jnp.zeros(sds.shape, sds.dtype)


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
