"""Harness for models written by other libraries (flax, equinox, keras, haiku, penzai, Gemma-style).

Every test module builds a tiny configuration of a real model with the library's own layers and
initialisers, then hands a :class:`Case` to the checks below, parametrized over every registered
format:

* ``jit(scalify(loss))(qparams, batch)`` against ``loss(dequantized params, batch)`` in float32;
* ``jit(scalify(grad(loss)))`` against ``grad(loss)`` on the dequantized parameters;
* one optax update (gradient, Adam moments, parameter update) against the float32 update.

Why one tolerance serves every format
-------------------------------------
The float32 reference runs on the *dequantized* parameters, so quantizing the parameters is not an
error being measured: both programs start from the same real numbers. Under ``scalify`` a formatted
operand is turned into its carrier (decoded elements in the logical dtype, float32, times a float32
power-of-two scale) and every rule returns a float32 carrier. Multiplying or dividing by a power of
two is exact, so the only differences left are float32 rounding (unit roundoff 2**-24 ~ 6e-8) and
the order of float32 sums (per-block partial sums, rescaled additions), amplified by the depth of a
tiny model and by cancellation in gradients. That is ``PROPAGATION_RTOL`` (relative to each leaf's
largest magnitude), whatever the format.

The tolerance is also a detector: it must stay below a quarter of the unit roundoff of the finest
registered element type (fp16: 2**-11 ~ 4.9e-4; bf16 2**-8; e4m3 2**-4; int8 per channel 1/254 of the
channel max; ...), so if any intermediate were silently rounded to the format's element type the
comparison would fail. ``format_unit_roundoff`` computes that bound per format and
``check_tolerance`` asserts it.

A leaf whose exact value is zero but whose float32 value is rounding noise (the gradient of an
attention *key* bias: softmax is invariant to a per-row shift, so it is 0 up to rounding) has no
relative scale of its own: each leaf's bound gets an absolute floor of ``ABS_FLOOR`` times the largest
magnitude in the whole tree (tens of float32 ulps of the tree's largest quantity).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

# keras 3 picks its backend at import time: make it JAX before any test module imports keras.
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qformats as qf
import scalify
from scalify import recipes

FORMAT_NAMES = tuple(qf.list_formats())

# The fast lane runs one format per family; the other built-ins share their family's code path in
# every rule (same layout, same carrier dtype, another element codec: that is tested in qformats'
# own suites) and run in the slow lane (``-m slow``). A format registered by a user or a plugin is
# not listed here, so it always runs in the fast lane.
FAMILY_REPRESENTATIVES = {
    "fp16": "per-tensor, narrow float carrier",
    "fp8_e4m3": "per-tensor 8-bit float",
    "int8_per_channel": "per-channel integer",
    "mxfp8": "MX blocks, 8-bit elements",
    "mxfp4": "MX blocks, packed 4-bit elements",
    "nvfp4": "two-level scales",
}
COVERED_BY_FAMILY = ("bf16", "fp8_e5m2", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxint8")
# The slow lane's step (gradient and Adam update) compiles one training step per (model, format):
# the representatives run in every suite, each covered built-in in two suites of this rotation
# (conftest.py deselects the rest; its loss runs in every suite). Measured: the step tests were 40%
# of the slow lane, almost all of it compilation.
STEP_ROTATION = {
    "test_flax": ("bf16", "mxfp6_e3m2"),
    "test_equinox": ("fp8_e5m2", "mxint8"),
    "test_gemma": ("mxfp8_e5m2", "mxfp6_e2m3"),
    "test_keras": ("fp8_e5m2", "mxfp6_e2m3", "mxint8"),
    "test_haiku": ("bf16", "mxfp8_e5m2", "mxfp6_e3m2"),
    "test_penzai": ("fp8_e5m2", "mxfp6_e3m2"),
    "test_haliax": ("bf16", "mxint8"),
}
# Suites whose step runs for these formats only: what they add to the suite is rules that dequantize
# or fold to per-tensor whatever the format (scatter-max, the factorizations); every family's path
# through the rest of a model's step is the other suites' (their compiles were 12-19 s each).
STEP_ONLY = {
    "test_graphs_and_gps": ("fp8_e4m3", "mxfp8", "nvfp4"),
    # diffrax's solvers meet the rules of a plain MLP's step; what they add is the loops, adjoints
    # and custom rules around them (each step compiles the solve and its adjoint: 17-27 s; all six
    # family formats passed when measured). The loss runs in every format.
    "test_diffrax": ("mxfp8",),
    # flowjax's flows and numpyro's ELBOs: what they add is the spline's bin search, scanned flow
    # layers, masked weights and numpyro's effect handlers around plain layers (all six family
    # formats passed the step when measured). The loss runs in every format.
    "test_flowjax": ("mxfp8",),
    "test_numpyro": ("mxfp8",),
    # e3nn's force-matching step is a second derivative through every tensor product (50-60 s a
    # step test on 2 cores; fp8_e4m3 and int8_per_channel passed it too, on a 24-atom variant of
    # the system). The loss, itself a gradient, runs in every format.
    "test_e3nn": ("mxfp8", "nvfp4"),
}
STEP_TESTS = ("test_grad", "test_adam_update")


def runs_step(module: str, test: str, fmt_name: str) -> bool:
    """Whether ``test`` of the suite ``module`` runs for ``fmt_name`` (see :data:`STEP_ROTATION`
    and :data:`STEP_ONLY`)."""
    if test in STEP_TESTS and module in STEP_ONLY:
        return fmt_name in STEP_ONLY[module]
    return not (test in STEP_TESTS and module in STEP_ROTATION and fmt_name in COVERED_BY_FAMILY) or (
        fmt_name in STEP_ROTATION[module]
    )


# Suites whose every case runs in every representative in the fast lane: regression tests of bugs
# found in models, a second or two each.
ROTATION_EXEMPT = ("test_known_bugs",)


def fast_lane_formats(case_index: int, n_cases: int, formats: tuple[str, ...]) -> tuple[str, ...]:
    """The family representatives among ``formats`` that the fast lane runs for the
    ``case_index``-th of a test's ``n_cases`` cases (conftest.py marks the others slow).

    Each case takes the next ``ceil(len(formats) / n_cases)`` of them, cyclically, so across the
    cases every representative meets at least one case and every case at least one
    representative: a two-case suite runs three formats each, a five-case suite two, where it ran
    all six. What the fast lane keeps is every case and every family; what it drops is the other
    (case, family) pairs, whose programs reach the same rules through the same layouts (measured on
    2 cores, 2026-12-07: the format-parametrized third-party tests were half the fast lane's time).
    A format registered by a user or a plugin is not a representative, so it still runs for every
    case.
    """
    reps = [f for f in formats if f in FAMILY_REPRESENTATIVES]
    per_case = -(-len(reps) // n_cases)  # all of them for one case, none offered: none
    return tuple(reps[(case_index * per_case + j) % len(reps)] for j in range(per_case))


def as_float64(v) -> np.ndarray:
    """A program's output (a ScaledArray's value, or a plain array) as a float64 array."""
    return np.asarray(v.to_array(jnp.float32) if isinstance(v, scalify.ScaledArray) else v, np.float64)


def relative_distance(got, ref) -> float:
    """``|got - ref| / |ref|`` (2-norms) over the elements where ``ref`` is not NaN."""
    keep = ~np.isnan(ref)
    return float(np.linalg.norm(got[keep] - ref[keep]) / np.linalg.norm(ref[keep]))


# Two block layouts and a per-channel one: the formats of the slow-lane programs that add loops or
# library code around rules the every-format tests already cover.
FEW_FORMATS = ("mxfp8", "nvfp4", "int8_per_channel")


# Differences between a float32 carrier program and the float32 program (see the module docstring).
PROPAGATION_RTOL = 5e-5
# Absolute floor per leaf, as a fraction of the tree's largest magnitude (see the module docstring).
ABS_FLOOR = 5e-6


def format_unit_roundoff(fmt) -> float:
    """Relative rounding error of one element of ``fmt`` (half the grid step at 1.0 or at the block max)."""
    element = fmt.element
    if isinstance(element, qf.IntElement):
        return 0.5 / element.qmax
    if isinstance(element, qf.FloatElement):
        return 2.0 ** -(element.mbits + 1)
    # An element codec of a user's own: fall back to the bits it spends.
    return 2.0 ** -(getattr(element, "bits", 8))


def check_tolerance(fmt) -> float:
    tol = PROPAGATION_RTOL
    assert tol <= format_unit_roundoff(fmt) / 4, (
        f"the propagation tolerance {tol} would not detect element rounding to {fmt.name} "
        f"(unit roundoff {format_unit_roundoff(fmt)})"
    )
    return tol


# -- parameters --------------------------------------------------------------------------------------
def accepts(fmt, leaf) -> bool:
    if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.ndim < 2:
        return False
    try:
        fmt.block_shape(tuple(leaf.shape))
    except ValueError:
        return False
    return True


def quantize_tree(params, fmt):
    """Floating leaves of rank >= 2 that ``fmt``'s layout accepts become ScaledArrays; others stay plain."""
    return jax.tree.map(lambda p: scalify.as_scaled_array(p, fmt=fmt) if accepts(fmt, p) else p, params)


def dequantize_tree(tree):
    return jax.tree.map(
        lambda v: v.to_array(jnp.float32) if isinstance(v, scalify.ScaledArray) else v,
        tree,
        is_leaf=scalify.is_scaled_leaf,
    )


def array_leaves(tree) -> list:
    """The array leaves of ``tree`` (a ScaledArray whole), without the Python objects an
    ``eqx.Module`` holds beside them (activation functions, names, flags)."""
    leaves = jax.tree.leaves(tree, is_leaf=scalify.is_scaled_leaf)
    return [x for x in leaves if isinstance(x, (scalify.ScaledArray, jax.Array, np.ndarray, np.generic))]


def n_scaled(tree) -> int:
    return sum(isinstance(v, scalify.ScaledArray) for v in jax.tree.leaves(tree, is_leaf=scalify.is_scaled_leaf))


def _number(v):
    """A leaf as float64 values; a PRNG key (an NNX ``Rngs`` stream) as its raw bits."""
    if isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
        v = jax.random.key_data(v)
    return np.asarray(v, np.float64)


def _values(tree):
    return [_number(v) for v in jax.tree.leaves(dequantize_tree(tree))]


def assert_tree_close(got, expected, fmt, what: str, rtol_factor: float = 1.0):
    """Leafwise: same NaN pattern as float32 (no new NaN/Inf), and |got - expected| <= rtol * max|expected|
    (the harness's rtol and floor times ``rtol_factor``, for a program whose inputs already differ)."""
    rtol = check_tolerance(fmt) * rtol_factor
    got_leaves, exp_leaves = _values(got), _values(expected)
    assert len(got_leaves) == len(exp_leaves), f"{what}: {len(got_leaves)} leaves, expected {len(exp_leaves)}"
    tree_max = max((float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)) for e in exp_leaves), default=0.0)
    floor = ABS_FLOOR * tree_max * rtol_factor
    for i, (g, e) in enumerate(zip(got_leaves, exp_leaves, strict=True)):
        assert g.shape == e.shape, f"{what}[{i}]: shape {g.shape}, expected {e.shape}"
        bad = ~np.isfinite(g) & np.isfinite(e)
        if bad.any():
            raise AssertionError(
                f"{what}[{i}] under {fmt.name}: {int(bad.sum())} of {g.size} values are NaN/Inf where float32 is finite"
            )
        finite = np.isfinite(e)
        scale = max(float(np.max(np.abs(e[finite]), initial=0.0)), 1e-30)
        err = float(np.max(np.abs(g[finite] - e[finite]), initial=0.0))
        if not err <= rtol * scale + floor:
            raise AssertionError(
                f"{what}[{i}] (shape {e.shape}) under {fmt.name}: max |diff| {err:.3g} > {rtol:g} * max |float32| "
                f"{scale:.3g} + {floor:.3g} (relative {err / scale:.3g})"
            )


# -- the checks ----------------------------------------------------------------------------------------
def run_script(script, site, *args) -> str:
    """stdout of ``python script --source site *args`` on the CPU, asserting it exits 0: the scripts
    whose wheels pin packages that must not meet another suite's imports run in a process of their own."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(script), "--source", str(site), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def ok_rows(out: str) -> int:
    """The rows of a script's table (check, format or recipe, outcome, detail) whose outcome is ok."""
    return len(re.findall(r"^\S+ +\S+ +ok ", out, flags=re.MULTILINE))


def make_optimizer():
    """Adam with an eps large enough that the first step is Lipschitz in the gradient.

    (With eps ~ 1e-8 the first Adam step is lr * sign(g): a gradient entry that is zero up to float32
    rounding would flip sign and the comparison would measure noise, not scalify.)
    """
    return optax.adam(1e-2, eps=1e-2)


@dataclasses.dataclass
class Case:
    """A model under test: ``loss(params, batch) -> scalar`` plus float32 params and one batch."""

    name: str
    loss: Callable[[Any, Any], jax.Array]
    params: Any
    batch: Any
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def quantized(self, fmt_name):
        """(fmt, qparams, float32 params equal to the dequantized qparams); skip if no leaf fits the layout."""
        if fmt_name not in self._memo:
            fmt = qf.get_format(fmt_name)
            qparams = quantize_tree(self.params, fmt)
            self._memo[fmt_name] = (fmt, qparams, dequantize_tree(qparams))
        fmt, qparams, dparams = self._memo[fmt_name]
        if n_scaled(qparams) == 0:
            pytest.skip(
                f"no parameter of {self.name} has a shape that {fmt_name} accepts ({fmt.layout.describe()}): "
                "nothing to scale"
            )
        return fmt, qparams, dparams

    def step_fn(self):
        opt = make_optimizer()
        loss = self.loss

        def step(params, opt_state, batch):
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return value, grads, optax.apply_updates(params, updates), opt_state

        return opt, step


def run_loss(case: Case, fmt_name: str):
    fmt, qparams, dparams = case.quantized(fmt_name)
    expected = jax.jit(case.loss)(dparams, case.batch)
    assert np.isfinite(float(expected)), f"{case.name}: float32 loss is not finite"
    got = jax.jit(scalify.scalify(case.loss))(qparams, case.batch)
    assert_tree_close(got, expected, fmt, f"{case.name} loss")


def run_step(case: Case, fmt_name: str):
    """One jit(scalify(step)) per format: value_and_grad, then an Adam update. Returns got and expected."""
    fmt, qparams, dparams = case.quantized(fmt_name)
    opt, step = case.step_fn()
    state = opt.init(dparams)
    # The reference is jitted too: op-by-op dispatch of a model step cost more than its compile
    # (KerasHub's gpt-oss: 25 s eager, 6 s jitted), and XLA's float32 program is the same math.
    expected = jax.jit(step)(dparams, state, case.batch)
    got = jax.jit(scalify.scalify(step))(qparams, state, case.batch)
    return fmt, got, expected


class StepResults:
    """Memoises run_step per (case, format), so the grad and update tests share one compilation."""

    def __init__(self):
        self._results: dict = {}

    def get(self, case: Case, fmt_name: str):
        key = (case.name, fmt_name)
        if key not in self._results:
            try:
                self._results[key] = ("ok", run_step(case, fmt_name))
            except pytest.skip.Exception:
                raise
            except Exception as exc:  # re-raised by each test that needs the result
                self._results[key] = ("error", exc)
        status, value = self._results[key]
        if status == "error":
            raise value
        return value


def check_grad(results: StepResults, case: Case, fmt_name: str):
    fmt, got, expected = results.get(case, fmt_name)
    assert_tree_close(got[0], expected[0], fmt, f"{case.name} value in value_and_grad")
    assert_tree_close(got[1], expected[1], fmt, f"{case.name} grad")


def check_update(results: StepResults, case: Case, fmt_name: str):
    fmt, got, expected = results.get(case, fmt_name)
    assert_tree_close(got[2], expected[2], fmt, f"{case.name} adam-updated params")
    assert_tree_close(got[3], expected[3], fmt, f"{case.name} adam state")


def keras_step_with_the_recipe_on_the_loss(model, recipe):
    """keras's JAX ``train_step(state, data)`` (keras/src/backend/jax/trainer.py) written with the
    recipe around the loss, ``jax.value_and_grad(recipes.apply(loss, recipe))``, so the recipe's
    custom VJP runs the backward GEMMs: the reference for ``recipes.apply(model.train_step, recipe)``,
    which meets the gradient keras takes inside its step (``x, y`` batches, no sample weights)."""

    def train_step(state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data
        loss_fn = recipes.apply(model.compute_loss_and_updates, recipe)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, aux), grads = grad_fn(
            trainable, non_trainable, metrics_vars, x, y, None, training=True, optimizer_variables=optimizer_vars
        )
        unscaled_loss, y_pred, non_trainable, metrics_vars = aux
        trainable, optimizer_vars = model.optimizer.stateless_apply(optimizer_vars, grads, trainable)
        logs, metrics_vars = model._update_metrics_variables(metrics_vars, unscaled_loss, x, y, y_pred, None)
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)

    return train_step


# -- recipes on a case ---------------------------------------------------------------------------------
def flat_values(tree) -> np.ndarray:
    """Every floating leaf of ``tree`` as one float64 vector."""
    return np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(tree)])


def cosine(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def balanced_cosine(tree, reference) -> float:
    """The cosine between two gradients whose leaves are each divided by the norm of the
    reference's leaf, so that every parameter counts alike: a Gaussian likelihood's noise scale,
    one scalar, can carry most of a gradient's norm and hide the weights'."""
    got, want = [], []
    for g, r in zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True):
        g, r = np.ravel(np.asarray(g, np.float64)), np.ravel(np.asarray(r, np.float64))
        norm = np.linalg.norm(r)
        if norm > 0:
            got.append(g / norm)
            want.append(r / norm)
    return cosine(np.concatenate(got), np.concatenate(want))


def perturbed_gradient_cosines(case: Case, relative: float, seeds=(0, 1, 2)) -> list[float]:
    """The program's own sensitivity at a recipe's rounding: :func:`balanced_cosine` of float32's
    gradient and float32's gradient after each floating leaf of the parameters is multiplied by
    ``1 + u``, ``u`` uniform in ``[-relative, relative]`` (one draw per seed). Rounding to an element
    with unit roundoff ``relative`` moves each value by at most that much. The batch is left as it
    is: a likelihood reads its observations whole (a VAE's binary pixels, exact in every format)."""
    grad = jax.jit(jax.grad(case.loss))
    reference = grad(case.params, case.batch)

    def perturb(tree, key):
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten(
            [
                x * (1 + jax.random.uniform(k, x.shape, x.dtype, -relative, relative))
                if jnp.issubdtype(jnp.result_type(x), jnp.floating)
                else x
                for x, k in zip(leaves, keys, strict=True)
            ]
        )

    out = []
    for seed in seeds:
        kp = jax.random.key(seed)
        out.append(balanced_cosine(grad(perturb(case.params, kp), case.batch), reference))
    return out


def recipe_rounding(recipe) -> float:
    """A recipe's coarsest rounding: the largest unit roundoff of its roles' elements
    (FLOAT8_TENSORWISE's E5M2 gradients, 2**-3)."""
    return max(format_unit_roundoff(recipe.format_of(role)) for role in recipes.ROLES if recipe.format_of(role))


def assert_recipe_distance(what: str, got, reference, probes) -> tuple[float, float]:
    """``(cosine, ratio)``: :func:`balanced_cosine` of the gradient ``got`` under a recipe with
    float32's ``reference``, and its distance (1 - cosine) over the median probe's (``probes``: the
    cosines random noise at the recipe's rounding gives); asserts the ratio is at most
    :data:`RECIPE_NOISE_FACTOR`."""
    cos = balanced_cosine(got, reference)
    ratio = (1 - cos) / (1 - float(np.median(probes)))
    assert ratio <= RECIPE_NOISE_FACTOR, (
        f"{what}: gradient cosine {cos:.4f} with float32's; probes {', '.join(f'{c:.4f}' for c in probes)}: "
        f"{ratio:.2f}x the median's distance, above {RECIPE_NOISE_FACTOR}x"
    )
    return cos, ratio


# The recipe rounds the operands of three GEMMs per layer (forward, input and weight gradients),
# activations and gradients included; the probes perturb the parameters once. Its gradient's distance from float32's
# (1 - cosine) may be this many times the median probe's.
RECIPE_NOISE_FACTOR = 2.0


# E4M3 row-wise operands and a float32 weight gradient: a weight and an activation take different
# roles (the weight's gradient GEMM stays in float32, the activation's is quantized), so a step that
# mistakes one for the other does not equal the reference below.
SAM_RECIPE = recipes.FLOAT8_ROWWISE.replace(wgrad_lhs=None, wgrad_rhs=None)


def sharpness_aware_gradient(loss: Callable, rho: float = 0.05) -> Callable:
    """A sharpness-aware minimisation step's gradient (Foret et al., 2021): the gradient of ``loss``
    at the parameters moved along their gradient by ``rho`` over its global norm. The second
    gradient is taken at a point computed from the first."""

    def gradient(params, batch):
        g = jax.grad(loss)(params, batch)
        norm = optax.global_norm(g)
        return jax.grad(loss)(jax.tree.map(lambda w, d: w + rho * d / norm, params, g), batch)

    return gradient


def check_sharpness_aware_step(case: Case, recipe=SAM_RECIPE) -> None:
    """``recipes.apply`` on a sharpness-aware step (both gradients taken inside) equals the same
    step around the applied loss's gradient (``jax.grad(recipes.apply(loss))``, whose custom VJP
    assigns the roles) bit for bit, and is not float32's (the recipe ran)."""
    step = sharpness_aware_gradient(case.loss)
    inside = flat_values(jax.jit(recipes.apply(step, recipe))(case.params, case.batch))
    outside = flat_values(jax.jit(sharpness_aware_gradient(recipes.apply(case.loss, recipe)))(case.params, case.batch))
    np.testing.assert_array_equal(inside, outside, err_msg=f"{case.name} under {recipe.name}: inside != outside")
    expected = flat_values(jax.jit(step)(case.params, case.batch))
    assert not np.allclose(inside, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max()), (
        f"{case.name} under {recipe.name}: the gradient is float32's (nothing quantized)"
    )


def check_gradient_under_recipe(case: Case, recipe) -> dict:
    """``recipes.apply`` on a case's gradient, taken inside (a training step's form) and outside
    (``jax.grad(recipes.apply(loss))``): the two are equal bit for bit (a backward rule JAX calls
    after the walk is walked then); finite; not float32's (the recipe ran); and its distance from
    float32's gradient, ``1 - cosine`` (:func:`balanced_cosine`), at most
    :data:`RECIPE_NOISE_FACTOR` times the median of :func:`perturbed_gradient_cosines`'s at the
    recipe's coarsest rounding (the largest unit roundoff of its six roles' elements:
    FLOAT8_TENSORWISE's E5M2 gradients, 2**-3). The bar is the program's own sensitivity: random
    noise of 2**-4 on a spline coupling flow's weights moves its gradient to a cosine of
    0.973-0.980 with float32's, on a block autoregressive flow's to 0.9985-0.9986 (measured over
    flowjax's and numpyro's 18 pairs: the recipes' distances are 0.22-1.32 times the median's).
    Returns the measured cosines."""
    inside_tree = jax.jit(recipes.apply(jax.grad(case.loss), recipe))(case.params, case.batch)
    expected_tree = jax.jit(jax.grad(case.loss))(case.params, case.batch)
    inside, expected = flat_values(inside_tree), flat_values(expected_tree)
    outside = flat_values(jax.jit(jax.grad(recipes.apply(case.loss, recipe)))(case.params, case.batch))
    assert np.isfinite(inside).all(), f"{case.name} under {recipe.name}: NaN/Inf in the gradient"
    np.testing.assert_array_equal(outside, inside, err_msg=f"{case.name} under {recipe.name}: outside != inside")
    assert not np.allclose(inside, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max()), (
        f"{case.name} under {recipe.name}: the gradient is float32's (nothing quantized)"
    )
    noise = perturbed_gradient_cosines(case, recipe_rounding(recipe))
    got, ratio = assert_recipe_distance(f"{case.name} under {recipe.name}", inside_tree, expected_tree, noise)
    return {"cosine": got, "noise": noise, "ratio": ratio}
