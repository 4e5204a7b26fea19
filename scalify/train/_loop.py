"""Training modes and the training loop.

Mechanisms (``MODE_MECHANISMS`` / :func:`describe_mode`):

* ``fp32`` / ``bf16`` / ``fp16``: plain ``jax.jit`` step. Parameters, activations, gradients and the
  optimizer state are stored and computed in that dtype; no scaling of any kind, no float32 master
  weights. The loss (log-softmax and cross-entropy) is computed in float32 in every mode.
* ``fp16-scalify``: parameters are float16 :class:`scalify.ScaledArray` s (data float16, float32
  scale) and the whole step (forward, backward, optax update) runs under ``jax.jit(scalify.scalify(step))``.
  The gradient of every matmul output is rescaled dynamically (``scalify.ops.dynamic_rescale_l2_grad``)
  and the parameter gradients are rescaled (``dynamic_rescale_l2``) before the optimizer, as in
  jax-scalify's examples. The optimizer state (SGD: none; Adam: both moments) is float16 ScaledArrays;
  Adam's update arithmetic (bias correction, ``mu / (sqrt(nu) + eps)``) runs on a float32 carrier
  (:func:`adam_fp32_update`) because float16 data divided by small float16 data overflows, and the
  transformer's LayerNorm runs on a float32 carrier (``Numerics.norm_dtype``) for the same reason.
* any registered qformats format ``F`` (except ``fp16`` and ``bf16``, whose names the plain modes
  take): parameters are float32 carrier ScaledArrays and the whole step runs under
  ``jax.jit(scalify.scalify(step))``. Both operands of every matmul are quantized into ``F`` with
  ``scalify.ops.quantize`` (block formats block along the contracted axis, per-channel formats put
  their channels on a free axis), so the forward matmuls see ``F`` values; the gradient of
  ``ops.quantize`` is straight-through, so backward matmuls run on float32 values, except for
  ``fp8_e4m3``, where the gradient of every matmul output is also quantized to per-tensor
  ``fp8_e5m2`` (E4M3 forward, E5M2 backward). Weights and optimizer state stay float32 (master weights).
"""

from __future__ import annotations

import functools
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
from scalify import ops
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


def get_mode(name: str) -> Mode:
    """The :class:`Mode` of a ``--format`` value (raises ``ValueError`` naming the valid values)."""
    if name in PLAIN_DTYPES:
        dt = PLAIN_DTYPES[name]
        return Mode(name, _models.Numerics(dtype=dt), False, f"plain jit, everything in {jnp.dtype(dt).name}")
    if name == SCALIFY_FP16:
        return Mode(
            name,
            _models.Numerics(dtype=jnp.float16, rescale_grads=True, norm_dtype=jnp.float32),
            True,
            "scalify: float16 ScaledArray params/activations/grads/optimizer state, dynamic grad rescaling "
            "(LayerNorm and the Adam update on a float32 carrier)",
        )
    try:
        fmt = qf.get_format(name)
    except Exception as e:
        raise ValueError(f"Unknown --format {name!r}; choose one of: {', '.join(list_modes())}") from e
    grad = GRAD_FORMATS.get(fmt.name)
    grad_fmt = qf.get_format(grad) if grad else None
    mech = f"scalify + ops.quantize of matmul operands to {fmt.name} (straight-through backward"
    mech += f", output grads in {grad})" if grad else ")"
    return Mode(name, _models.Numerics(dtype=jnp.float32, fmt=fmt, grad_fmt=grad_fmt), True, mech)


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
    nu: object


def adam_fp32_update(lr, b1=0.9, b2=0.999, eps=1e-8) -> optax.GradientTransformation:
    """Adam whose moments are stored like the parameters (float16 ScaledArrays under fp16-scalify) but
    whose bias correction and ``mu / (sqrt(nu) + eps)`` run in float32 (a float32 carrier under
    scalify), then cast back to the gradient's dtype. Plain ``optax.adam`` on float16 ScaledArrays
    overflows: scalify's ``div`` rule divides float16 data by small float16 data."""

    def init(params):
        z = jax.tree.map(jnp.zeros_like, params)
        return AdamState(jnp.zeros((), jnp.int32), z, jax.tree.map(jnp.zeros_like, params))

    def update(g, state, params=None):
        del params
        count = state.count + 1
        mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
        nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * (x * x), state.nu, g)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)

        def upd(m, v, x):
            m32 = m.astype(jnp.float32) / c1
            v32 = v.astype(jnp.float32) / c2
            return ops.dynamic_rescale_max(-lr * m32 / (jnp.sqrt(v32) + eps)).astype(x.dtype)

        return jax.tree.map(upd, mu, nu, g), AdamState(count, mu, nu)

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

    def loss_fn(p, x, y):
        return _cross_entropy(apply(p, x, num), y, n_classes)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        if num.rescale_grads:
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
    else:
        opt_state = opt.init(params)

    bar = _progress(progress, steps, f"{model}/{fmt}")
    history = []
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = next(batches)
        params, opt_state, loss = step_fn(params, opt_state, to_input(x), jnp.asarray(y))
        history.append(_plain(loss))
        if bar is not None and (i % 10 == 9 or i == steps - 1):
            bar(i + 1, float(_plain(loss)))
    history = [_finite_or_nan(v) for v in jax.device_get(history)]

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
        history=history,
    )


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
