"""Run diffrax's own example notebooks, unchanged, with their jitted steps under ``scalify``.

    python scripts/run_diffrax_examples.py --source DIR       # a diffrax git checkout (docs/examples/)
    python scripts/run_diffrax_examples.py --source DIR --only neural_ode --formats all --markdown
    python scripts/run_diffrax_examples.py --source DIR --recipes mxfp8,nvfp4   # training recipes

The programs are the notebooks of diffrax's ``docs/examples/`` that train a network: ``neural_ode``
(an MLP vector field, Tsit5 with an adaptive PID step-size controller, AdaBelief),
``neural_cde`` (a controlled differential equation over a cubic interpolation, a classifier),
``latent_ode`` (a GRU encoder unrolled over the series, an ODE decoder, a VAE loss),
``continuous_normalising_flow`` (FFJORD: each vector field's exact Jacobian trace from
``jax.vmap(vjp)`` inside the ODE, so the training gradient is a second-order one, accumulated over
virtual batches in a ``fori_loop``) and ``neural_sde`` (an SDE generator against a neural-CDE
discriminator, a Wasserstein GAN trained with RMSProp, weights clipped in a jitted method). They
are read from a checkout given with ``--source`` (diffrax's sdist on PyPI does not ship them);
nothing of them is copied into this repository. ``pip install diffrax``.

What runs them is ``run_equinox_examples.py``'s machinery, unchanged: each notebook's code cells
run in order in a fresh module; ``eqx.filter_jit(f)`` is ``eqx.filter_jit(scalify.scalify(f))``
and the arrays of the ``eqx.Module`` arguments of a jitted call that the format's layout accepts
enter the first call that sees them as ``as_scaled_array(w, fmt=...)``. The check is that script's
(every jitted call's outputs against the same notebook in float32 on the dequantized weights,
within the third-party harness's tolerance, relaxed by ``1 + k`` for the ``k``-th call); with
``--recipes`` each jitted function runs under ``scalify.recipes.apply(f, recipe)`` and the first
step's update of the model is compared by cosine.

What the script supplies
------------------------
* **Sizes.** The notebooks' ``main()`` keyword arguments, made small (a few steps, datasets of 64
  series, batches of 16 or 32) and, where a notebook's widths are 16, 32 (``latent_ode``,
  ``neural_sde``) so that MX blocks fit somewhere.
* **Data.** ``continuous_normalising_flow`` reads an image with ``imageio``: a synthetic
  greyscale disc of the same type stands in (``imageio`` is an inert stand-in when not installed).
  The other notebooks generate their data with diffrax itself, as they do.
* **Plots.** ``plot=False`` where ``main()`` has it; ``matplotlib`` is an inert stand-in.
* **Adam's eps** raised to 1e-2, as in the equinox script.

Where a notebook then computes with the trained model eagerly, outside any jitted function
(``neural_cde``'s, ``latent_ode``'s and the flow's samples for their plots, ``neural_sde``'s
generated paths), scalify has no arithmetic there and says so: the outcome is ``ok*`` when the
calls made up to that error agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import run_equinox_examples as eqx_examples  # noqa: E402
from run_equinox_examples import (  # noqa: E402
    Example,
    Run,
    _same_calls,
    check,
    check_recipe,
    code_cells,
    execute,
    outcome,
    run_scaled,
)
from run_flax_examples import failure, install_stand_ins, parse_cli, summary  # noqa: E402
from run_keras_hub_models import _recipes_arg, recipe  # noqa: E402
from thirdparty_harness import ABS_FLOOR, array_leaves, check_tolerance  # noqa: E402

import scalify  # noqa: E402

STAND_INS = ("matplotlib", "imageio")

# A greyscale disc in place of the flow's image (imageio.imread's uint8 (height, width, 3) array):
# the data cell keeps the pixels darker than 254, about 30% of them here.
CNF_DATA = """
import types as _types
imageio = _types.SimpleNamespace(imread=lambda path: _np.broadcast_to(
    _np.where(_np.hypot(*_np.mgrid[-12:12, -16:16]) < 8, 0, 255).astype(_np.uint8)[..., None], (24, 32, 3)))
"""

EAGER = r"no arithmetic outside scalify"

EXAMPLES = {
    "neural_ode": Example(
        "neural_ode",
        skip=(r"^ts, ys, model = main\(\)",),
        drive=(
            "main(dataset_size=64, batch_size=16, steps_strategy=(2, 1), length_strategy=(0.1, 1), "
            "plot=False, print_every=1)"
        ),
    ),
    "neural_cde": Example(
        "neural_cde",
        skip=(r"^main\(\)",),
        drive="main(dataset_size=64, batch_size=16, steps=3, width_size=64)",
        # main() ends with a plot of the trained model's prediction, called eagerly.
        stops=EAGER,
    ),
    "latent_ode": Example(
        "latent_ode",
        skip=(r"^main\(\)",),
        drive=(
            "main(dataset_size=64, batch_size=16, steps=3, save_every=50, hidden_size=32, latent_size=32, "
            "width_size=32)"
        ),
        # The training loop samples the model eagerly for its plot after the first step.
        stops=EAGER,
    ),
    "continuous_normalising_flow": Example(
        "continuous_normalising_flow",
        skip=(r"^main\(in_path",),
        after=(r"def get_data\(path\)", CNF_DATA),
        drive=(
            "main(in_path='disc.png', out_path='disc_flow.png', batch_size=32, virtual_batches=2, steps=3, "
            "width_size=64, depth=3, num_blocks=2, print_every=1)"
        ),
        # main() ends with samples of the trained flow, drawn eagerly (jax.vmap(model.sample)).
        stops=EAGER,
    ),
    "neural_sde": Example(
        "neural_sde",
        skip=(r"^main\(\)",),
        drive=("main(hidden_size=32, width_size=32, batch_size=16, steps=2, steps_per_print=1, dataset_size=64)"),
        # main() ends with generated paths for its plot, the generator called eagerly.
        stops=EAGER,
    ),
}


# Notebooks whose step sizes an adaptive controller (diffrax.PIDController) picks from the solution's
# own error estimates: a step accepted in one run and rejected in the other changes the solution by
# up to the controller's tolerance, so their outputs are discontinuous in the weights at float32
# rounding (measured: neural_cde's predicted probabilities, about 0.4, move by up to 0.011 when its
# weights move by one float32 ulp).
ADAPTIVE = {"neural_ode", "neural_cde"}
# How far scalify may be from float32, in units of how far apart float32 runs land when the
# scaled weights move by one ulp: the largest distance between any two of the float32 run and its
# PROBES seeded moves (see check_adaptive). scalify's run is one more program that rounds
# differently from float32; the distances are heavy-tailed (a step accepted in one run and rejected
# in another moves the solution by up to the controller's tolerance), hence a spread over several
# runs and a factor of PROBE_FACTOR.
PROBES = 3
PROBE_FACTOR = 4.0


class _ProbeRun(Run):
    """The float32 reference with every weight the format scales moved by one float32 ulp (each
    element up or down at random, seeded): how far the notebook's outputs move from rounding alone."""

    def __init__(self, fmt, seed: int):
        super().__init__(fmt, scaled=False)
        self.rng = np.random.default_rng(seed)

    def weight(self, w):
        n = self.n_scaled
        w = super().weight(w)
        if self.n_scaled == n:
            return w
        sign = self.rng.choice(np.array([-1.0, 1.0], np.float32), size=w.shape)
        return w * jnp.asarray(1 + sign * np.float32(2.0**-23))


def check_adaptive(example: Example, cells: list[str], fmt) -> tuple[str, str]:
    """(outcome, detail) for a notebook with adaptive steps: every jitted call's outputs, leaf by
    leaf, within the harness's bound plus ``PROBE_FACTOR`` times the spread of the float32 program
    under one-ulp changes of the weights (the largest distance between any two of the float32 run
    and ``PROBES`` seeded probe runs); no NaN/Inf where float32 is finite. The detail reports the
    largest ratio of scalify's difference to that spread."""
    got, expected = Run(fmt, scaled=True), Run(fmt, scaled=False)
    probes = [_ProbeRun(fmt, seed) for seed in range(PROBES)]
    worst = 0.0
    try:
        execute(example, cells, expected)
        if expected.n_scaled == 0:
            return "n/a", f"no weight has a shape that {fmt.name} accepts"
        for probe in probes:
            execute(example, cells, probe)
            _same_calls(probe, expected)
        stopped = run_scaled(example, cells, got, expected)
        for k, (name, g) in enumerate(got.calls):
            exps, gots = array_leaves(expected.calls[k][1]), array_leaves(g)
            moves = zip(*(array_leaves(p.calls[k][1]) for p in probes), strict=True)  # per leaf
            exp_values = [np.asarray(e, np.float64) for e in exps]
            tree_max = max((float(np.max(np.abs(e), initial=0.0)) for e in exp_values), default=0.0)
            for i, (a, e, ps) in enumerate(zip(gots, exp_values, moves, strict=True)):
                a = np.asarray(a.to_array(jnp.float32) if isinstance(a, scalify.ScaledArray) else a, np.float64)
                if (~np.isfinite(a) & np.isfinite(e)).any():
                    raise AssertionError(f"call {k} ({name})[{i}]: NaN/Inf where float32 is finite")
                ok = np.isfinite(e)
                err = float(np.max(np.abs(a[ok] - e[ok]), initial=0.0))
                runs = [e[ok], *(np.asarray(p, np.float64)[ok] for p in ps)]
                moved = max(
                    float(np.max(np.abs(x - y), initial=0.0)) for j, x in enumerate(runs) for y in runs[j + 1 :]
                )
                rounding = check_tolerance(fmt) * (1 + k) * float(np.max(np.abs(e[ok]), initial=0.0))
                bound = rounding + ABS_FLOOR * (1 + k) * tree_max + PROBE_FACTOR * moved
                if not err <= bound:
                    raise AssertionError(
                        f"call {k} ({name})[{i}] (shape {e.shape}) under {fmt.name}: max |diff| {err:.3g} > "
                        f"{bound:.3g} (float32 runs land up to {moved:.3g} apart under one-ulp changes of the weights)"
                    )
                if moved > 0:
                    worst = max(worst, err / moved)
    except Exception as exc:  # reported per example and format (traceback on stderr), not raised
        return failure(exc)
    detail = (
        f"{got.n_scaled} weights scaled, {len(got.calls)} jitted calls agree within float32's own spread "
        f"(largest ratio {worst:.2f})"
    )
    return outcome(detail, stopped)


def main(argv=None) -> int:
    recipe_names, options, argv = _recipes_arg(argv)
    args, names, formats = parse_cli(__doc__, EXAMPLES, "diffrax", argv)
    if args.source is None:
        raise SystemExit("diffrax's sdist does not ship its example notebooks: pass --source DIR (a git checkout)")
    stand_ins = install_stand_ins(STAND_INS)
    import diffrax
    import equinox

    eqx_examples.equinox = equinox
    root = args.source.resolve()
    print(f"diffrax {diffrax.__version__} examples from {root}; stand-ins for {stand_ins or 'none'}")
    rows = []
    runs = [recipe(n, **options) for n in recipe_names] if recipe_names else formats
    for name in names:
        cells = code_cells(root, EXAMPLES[name].notebook)
        for run in runs:
            checker = check_recipe if recipe_names else check_adaptive if name in ADAPTIVE else check
            outcome, detail = checker(EXAMPLES[name], cells, run)
            rows.append((name, run.name, outcome, detail))
            print(f"{name:28s} {run.name:18s} {outcome:5s} {detail}", flush=True)
    return summary(rows, names, runs, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
