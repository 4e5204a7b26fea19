"""Run equinox's own example notebooks, unchanged, with their jitted steps under ``scalify``.

    python scripts/run_equinox_examples.py --source DIR       # an equinox git checkout (docs/examples/)
    python scripts/run_equinox_examples.py --source DIR --only mnist,stateful --formats all --markdown
    python scripts/run_equinox_examples.py --source DIR --recipes mxfp8,float8_rowwise,nvfp4  # training recipes

The programs are the notebooks of equinox's ``docs/examples/`` (``mnist``, ``train_rnn``,
``frozen_layer``, ``stateful``, ``score_based_diffusion``, ``vision_transformer``), read from a
checkout given with ``--source`` (equinox's sdist on PyPI does not ship them); nothing of them is
copied into this repository. ``vision_transformer`` imports ``einops``, ``score_based_diffusion``
``einops`` and ``diffrax`` (``pip install einops diffrax``).

Each notebook's code cells run in order in a fresh module, as Jupyter would run them. The one
change: while the notebook runs, ``eqx.filter_jit(f)`` is ``eqx.filter_jit(scalify.scalify(f))``,
and the arrays of the ``eqx.Module`` arguments of a jitted call that the format's layout accepts
(rank >= 2, blocks that fit) enter the first call that sees them as ``as_scaled_array(w,
fmt=...)``: the model the notebook built, with its weights in the format. What a jitted call
returns (the trained model, carriers included) is passed on as it is.

What the script supplies, and why
---------------------------------
* **Data.** A cell that downloads a dataset (``torchvision.datasets``, MNIST's ``urlretrieve``) is
  replaced by loaders of synthetic batches of the same shapes and types; ``torch``,
  ``torchvision`` and ``matplotlib`` are inert stand-ins when not installed (the notebooks use
  them for data, annotations and plots only).
* **Sizes.** The notebooks' own hyperparameters, made small where they are module constants or
  ``main()`` keyword arguments (widths 32-64, a few steps), so that a step compiles in seconds and
  MX / NVFP4 blocks fit.
* **Cells not run.** Plots, ``print(model)``, cells that demonstrate an error or show a batch, and
  the vision transformer's test-set accuracy (an eager ``jax.vmap(model)`` over the trained model).
* **Adam's eps** is raised to 1e-2 (``optax.adam``, ``adamw`` and ``adabelief`` while the notebook
  runs), as in the flax and Haiku scripts: with ``eps=1e-8`` the first step is ``lr * sign(g)``
  and a gradient entry that is zero up to float32 rounding would flip sign.

The check: the notebook runs twice, once with the steps under ``scalify`` and the weights in the
format, once in float32 with the same weights dequantized (the same calls, the same data and keys).
Every jitted call's outputs must agree leaf by leaf within the third-party harness's tolerance
(``tests/thirdparty/thirdparty_harness.py``), relaxed by a factor of ``1 + k`` for the ``k``-th call,
whose inputs carry the rounding differences of the calls before it. Three notebooks then compute
with a step's outputs in Python, outside any jitted function (mnist's ``avg_loss += loss(...)``,
train_rnn's eager accuracy, the diffusion example's plot): scalify has no arithmetic there (no
silent dequantization) and says so; the outcome is ``ok*`` when the calls made up to that error
agree.

With ``--recipes`` (built-in names, ``high`` or ``all``; ``--high-precision-scopes`` and
``--weights-only`` as in ``run_keras_hub_models.py``), ``eqx.filter_jit(f)`` is
``eqx.filter_jit(scalify.recipes.apply(f, recipe))`` on the float32 weights instead, and the check
follows that script's, with the step's update in place of the gradient: every call's outputs finite
where float32's are, and the first call's update of the model (the same inputs in both runs) at a
cosine with float32's above its floor (``high``: float32's values to rounding). ``refused`` is the
recipe's own error for a contraction whose widths its formats cannot block, which names the
contraction and the fixes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import linecache
import re
import sys
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
from run_flax_examples import failure, install_stand_ins, parse_cli, summary  # noqa: E402
from run_keras_hub_models import _recipes_arg, cosine, cosine_floor, recipe, recipe_outcome  # noqa: E402
from thirdparty_harness import accepts, array_leaves, assert_tree_close  # noqa: E402

import scalify  # noqa: E402

equinox = None  # imported in main(): equinox is an optional dependency (the test extra)

STAND_INS = ("torch", "torchvision", "matplotlib")


# -- synthetic data, in the loaders' own types ---------------------------------------------------------
class _Tensor:
    """What the notebooks read from a torch batch: ``.numpy()`` (and ``permute`` for a plot)."""

    def __init__(self, array):
        self.array = np.asarray(array)

    def numpy(self):
        return self.array


def _loader(n_batches, image_shape, n_classes, batch, seed):
    rng = np.random.default_rng(seed)
    return [
        (
            _Tensor(rng.standard_normal((batch, *image_shape)).astype(np.float32)),
            _Tensor(rng.integers(0, n_classes, size=batch)),
        )
        for _ in range(n_batches)
    ]


MNIST_DATA = """
trainloader = _loader(3, (1, 28, 28), 10, BATCH_SIZE, 0)
testloader = _loader(2, (1, 28, 28), 10, BATCH_SIZE, 1)
dummy_x, dummy_y = trainloader[0][0].numpy(), trainloader[0][1].numpy()
"""

VIT_DATA = """
trainloader = _loader(3, (3, 32, 32), num_classes, batch_size, 0)
"""

DIFFUSION_DATA = """
def mnist():
    return jnp.asarray(_np.random.default_rng(0).integers(0, 256, size=(64, 1, 28, 28), dtype=_np.uint8))
"""


@dataclasses.dataclass(frozen=True)
class Example:
    """A notebook: the code cells not run (regexes searched in each cell), the cell that loads the
    data and the script's code that runs in its place (``data``: regex and code), hyperparameters
    set after each cell, and the code that runs the training (``drive``, after the cells; empty:
    the cells do)."""

    notebook: str
    skip: tuple[str, ...] = ()
    data: tuple[str, str] | None = None
    after: tuple[str, str] | None = None  # (regex, code): the code runs after the matching cell
    sizes: dict = dataclasses.field(default_factory=dict)
    drive: str = ""
    # The error (regex) the scaled run stops at once it computes with a step's outputs outside any
    # jitted function (outcome "ok*": the calls made up to there agree).
    stops: str | None = None


EXAMPLES = {
    "mnist": Example(
        "mnist",
        skip=(
            r"next\(iter\(trainloader\)\)",
            r"^print\(model\)",
            r"This is an error",
            r"This will work",
            r"^evaluate\(model, testloader\)",
            r"^model = train\(",
        ),
        data=(r"torchvision\.datasets", MNIST_DATA),
        drive="model = train(model, trainloader, testloader, optim, 3, 1)",
        # evaluate() sums the jitted loss's outputs in Python (avg_loss += loss(model, x, y)).
        stops=r"no arithmetic outside scalify",
    ),
    "train_rnn": Example(
        "train_rnn",
        skip=(r"^main\(\)",),
        drive="main(dataset_size=64, batch_size=16, steps=3, hidden_size=32)",
        # main() ends with an accuracy of the trained model computed eagerly (jax.vmap(model)(xs)).
        stops=r"no arithmetic outside scalify",
    ),
    "frozen_layer": Example(
        "frozen_layer",
        skip=(r"^main\(\)",),
        drive="main(dataset_size=512, batch_size=64, steps=3, width_size=32, depth=2)",
    ),
    "stateful": Example("stateful", sizes={"steps": 3}),
    "score_based_diffusion": Example(
        "score_based_diffusion",
        skip=(r"^main\(\)",),
        after=(r"def mnist\(\)", DIFFUSION_DATA),
        drive=(
            "main(patch_size=4, hidden_size=32, mix_patch_size=32, mix_hidden_size=32, num_blocks=2, "
            "num_steps=3, batch_size=8, print_every=1, sample_size=2, dt0=1.0)"
        ),
        # main() ends with the samples' plot: data_mean + data_std * sample, in Python.
        stops=r"no arithmetic outside scalify",
    ),
    "vision_transformer": Example(
        "vision_transformer",
        skip=(r"accuracies = \[\]",),
        data=(r"torchvision\.datasets", VIT_DATA),
        sizes={"embedding_dim": 64, "hidden_dim": 64, "num_heads": 2, "num_layers": 2, "num_steps": 3, "batch_size": 8},
    ),
}


def code_cells(root: Path, notebook: str) -> list[str]:
    path = root / "docs" / "examples" / f"{notebook}.ipynb"
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass the root of the git checkout that holds docs/examples/ as --source")
    cells = json.loads(path.read_text())["cells"]
    # IPython magics and shell escapes are not Python.
    strip = lambda src: "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
    return [strip("".join(c["source"])) for c in cells if c["cell_type"] == "code"]


# -- the run -------------------------------------------------------------------------------------------
class Run:
    """One run of a notebook: ``eqx.filter_jit`` as the notebook uses it, with its function under
    ``scalify`` (``scaled``) or as it is (the float32 reference), the weights of the ``eqx.Module``
    arguments in ``fmt`` (dequantized for the reference) on first sight, every call's outputs kept.
    With a ``recipe``, the function runs under ``scalify.recipes.apply(f, recipe)`` instead, on the
    float32 weights."""

    def __init__(self, fmt, scaled: bool, recipe=None):
        self.fmt, self.scaled, self.recipe = fmt, scaled, recipe
        self.calls: list[tuple[str, object]] = []
        self.first_modules: list = []  # the eqx.Module arguments of the first call
        self.produced: dict[int, object] = {}  # leaves a jitted call returned (the ref keeps the id)
        self.n_scaled = 0

    def transform(self, fun):
        if self.recipe is not None:
            return scalify.recipes.apply(fun, self.recipe)
        return scalify.scalify(fun) if self.scaled else fun

    def weight(self, w):
        if self.fmt is None or isinstance(w, scalify.ScaledArray) or id(w) in self.produced or not accepts(self.fmt, w):
            return w
        self.n_scaled += 1
        q = scalify.as_scaled_array(w, fmt=self.fmt)
        return q if self.scaled else q.to_array(jnp.float32)

    def prepare(self, args, kwargs):
        """The arguments with the weights of each ``eqx.Module`` argument in the format (a module
        nested in another argument, such as Adam's moments ``eqx.filter(model, ...)``, is not)."""
        prepare = lambda x: jax.tree.map(self.weight, x, is_leaf=scalify.is_scaled_leaf)
        args = [prepare(x) if isinstance(x, equinox.Module) else x for x in args]
        return args, {k: prepare(x) if isinstance(x, equinox.Module) else x for k, x in kwargs.items()}

    def filter_jit(self, real):
        """The replacement of ``eqx.filter_jit`` (bare decorator, or called with options)."""

        def patched(fun=None, **options):
            if fun is None:
                return functools.partial(patched, **options)
            jitted = real(self.transform(fun), **options)

            @functools.wraps(fun)
            def call(*args, **kwargs):
                if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
                    # Called from inside another jitted function (mnist's make_step calls its
                    # jitted loss): part of that program, not a call of the notebook's own.
                    return jitted(*args, **kwargs)
                args, kwargs = self.prepare(args, kwargs)
                if not self.calls:
                    self.first_modules = [x for x in (*args, *kwargs.values()) if isinstance(x, equinox.Module)]
                out = jitted(*args, **kwargs)
                for leaf in jax.tree.leaves(out, is_leaf=scalify.is_scaled_leaf):
                    self.produced[id(leaf)] = leaf
                self.calls.append((getattr(fun, "__name__", repr(fun)), out))
                return out

            return call

        return patched


def _raised_eps(make):
    return functools.wraps(make)(lambda *a, **k: make(*a, **{**k, "eps": max(k.get("eps", 0.0), 1e-2)}))


@contextlib.contextmanager
def patched(run: Run):
    saved = equinox.filter_jit, optax.adam, optax.adamw, optax.adabelief
    equinox.filter_jit = run.filter_jit(saved[0])
    optax.adam, optax.adamw, optax.adabelief = map(_raised_eps, saved[1:])
    try:
        yield
    finally:
        equinox.filter_jit, optax.adam, optax.adamw, optax.adabelief = saved


@contextlib.contextmanager
def _registered(module):
    """``module`` in ``sys.modules`` while the notebook runs; dropped after, with the programs that
    its functions compiled (a run of every notebook in every format ran out of memory otherwise)."""
    sys.modules[module.__name__] = module
    try:
        yield
    finally:
        del sys.modules[module.__name__]
        jax.clear_caches()


def execute(example: Example, cells: list[str], run: Run) -> None:
    """Run the notebook's cells (the script's data in place of the data cell, then its drive) with
    ``run``'s patches."""
    np.random.seed(0)  # train_rnn's loader shuffles with NumPy's global generator
    # A module of its own, as a notebook's __main__ is (dataclasses look a class's module up).
    module = types.ModuleType(f"equinox_example_{example.notebook}")
    ns = module.__dict__
    ns.update(_loader=_loader, _Tensor=_Tensor, _np=np)
    sources = []
    for i, cell in enumerate(cells):
        if example.data and re.search(example.data[0], cell, re.M):
            sources.append((f"the script's data in place of cell {i}", example.data[1]))
        elif not any(re.search(p, cell, re.M) for p in example.skip):
            sources.append((f"cell {i}", cell))
            if example.after and re.search(example.after[0], cell, re.M):
                sources.append((f"the script's data after cell {i}", example.after[1]))
    sources.append(("drive", example.drive))
    with patched(run), contextlib.redirect_stdout(io.StringIO()), _registered(module):
        for where, source in sources:
            filename = f"{example.notebook}.ipynb [{where}]"
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
            exec(compile(source, filename, "exec"), ns)
            # A size applies once a cell has defined it.
            ns.update({k: v for k, v in example.sizes.items() if k in ns})


def _same_calls(got: Run, expected: Run, stopped: bool = False) -> None:
    """The two runs made the same jitted calls (a run that stopped as expected: the first ones)."""
    names, want = [n for n, _ in got.calls], [n for n, _ in expected.calls]
    if names != want[: len(names) if stopped else None]:
        raise AssertionError(f"the runs made different jitted calls: {names} and {want}")


def run_scaled(example: Example, cells: list[str], got: Run, expected: Run) -> TypeError | None:
    """Run the notebook under ``got`` (scaled) after ``expected``; the error it stops at as
    expected (``example.stops``), or ``None``. Checks that both made the same jitted calls."""
    stopped = None
    try:
        execute(example, cells, got)
    except TypeError as exc:
        if not (example.stops and re.search(example.stops, str(exc))):
            raise
        stopped = exc
    _same_calls(got, expected, stopped is not None)
    return stopped


def outcome(detail: str, stopped: TypeError | None) -> tuple[str, str]:
    """``ok``, or ``ok*`` with where the run stopped as expected."""
    if stopped:
        where = traceback.extract_tb(stopped.__traceback__)[-2]
        return "ok*", f"{detail}; then stops as expected at {where.filename}:{where.lineno} ({where.line})"
    return "ok", detail


def check(example: Example, cells: list[str], fmt) -> tuple[str, str]:
    """(outcome, detail) of the notebook with its steps under ``scalify`` against float32."""
    got, expected = Run(fmt, scaled=True), Run(fmt, scaled=False)
    try:
        execute(example, cells, expected)
        if expected.n_scaled == 0:
            return "n/a", f"no weight has a shape that {fmt.name} accepts"
        stopped = run_scaled(example, cells, got, expected)
        for k, ((name, g), (_, e)) in enumerate(zip(got.calls, expected.calls[: len(got.calls)], strict=True)):
            assert_tree_close(array_leaves(g), array_leaves(e), fmt, f"call {k} ({name})", rtol_factor=1 + k)
    except Exception as exc:  # reported per example and format (traceback on stderr), not raised
        return failure(exc)
    return outcome(f"{got.n_scaled} weights scaled, {len(got.calls)} jitted calls agree", stopped)


def _update(run: Run) -> np.ndarray:
    """What the first jitted call changed in its ``eqx.Module`` arguments: each module's arrays in
    the call's output (the element of the returned tuple with the module's structure) minus the
    module's, flattened."""
    out = run.calls[0][1]
    parts = out if isinstance(out, tuple | list) else (out,)
    deltas = []
    for m in run.first_modules:
        new = next((p for p in parts if jax.tree.structure(p) == jax.tree.structure(m)), None)
        if new is not None:
            deltas += [
                np.ravel(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                for a, b in zip(array_leaves(new), array_leaves(m), strict=True)
                if jnp.issubdtype(jnp.result_type(b), jnp.floating)
            ]
    if not deltas:
        raise AssertionError("the first jitted call returns none of its eqx.Module arguments: no update to compare")
    return np.concatenate(deltas)


def check_recipe(example: Example, cells: list[str], recipe) -> tuple[str, str]:
    """(outcome, detail) of the notebook with its jitted functions under ``recipes.apply(f, recipe)``
    against float32: every call's outputs finite where float32's are, and the first call's update
    of the model (same inputs in both runs) pointing the way float32's does (the KerasHub script's
    cosine floor for the recipe's narrowest element); the all-high-precision recipe must reproduce
    float32 to its rounding."""
    got, expected = Run(None, scaled=True, recipe=recipe), Run(None, scaled=False)

    def run():
        execute(example, cells, expected)
        execute(example, cells, got)
        _same_calls(got, expected)
        floor = cosine_floor(recipe)
        for k, ((name, g), (_, e)) in enumerate(zip(got.calls, expected.calls, strict=True)):
            for i, (a, b) in enumerate(zip(array_leaves(g), array_leaves(e), strict=True)):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                if (~np.isfinite(a) & np.isfinite(b)).any():
                    raise AssertionError(f"call {k} ({name}) output {i}: NaN/Inf where float32 is finite")
                if floor is None:
                    np.testing.assert_allclose(
                        a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.max(np.abs(b), initial=0)))
                    )
        c = cosine(_update(got), _update(expected))
        return c, f"{len(got.calls)} jitted calls finite; first update's cosine with float32's {c:.4f}", floor

    return recipe_outcome(run)


def main(argv=None) -> int:
    global equinox
    recipe_names, options, argv = _recipes_arg(argv)
    args, names, formats = parse_cli(__doc__, EXAMPLES, "equinox", argv)
    if args.source is None:
        raise SystemExit("equinox's sdist does not ship its example notebooks: pass --source DIR (a git checkout)")
    stand_ins = install_stand_ins(STAND_INS)
    if "torch" in stand_ins:
        import torch

        # einops (the vision transformer) tells backends apart with isinstance(x, torch.Tensor).
        torch.Tensor = type("Tensor", (), {})
    import equinox

    root = args.source.resolve()
    print(f"equinox {equinox.__version__} examples from {root}; stand-ins for {stand_ins or 'none'}")
    rows = []
    runs = [recipe(n, **options) for n in recipe_names] if recipe_names else formats
    for name in names:
        cells = code_cells(root, EXAMPLES[name].notebook)
        for run in runs:
            outcome, detail = (check_recipe if recipe_names else check)(EXAMPLES[name], cells, run)
            rows.append((name, run.name, outcome, detail))
            print(f"{name:22s} {run.name:18s} {outcome:5s} {detail}", flush=True)
    return summary(rows, names, runs, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
