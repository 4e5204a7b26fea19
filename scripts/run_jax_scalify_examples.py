"""Train jax-scalify's three MNIST examples with ``scalify`` and with jax-scalify itself, on the digits data.

    python scripts/run_jax_scalify_examples.py                 # pip download jax-scalify's sdist (ships them)
    python scripts/run_jax_scalify_examples.py --source DIR    # a checkout: git clone
                                                               #   https://github.com/graphcore-research/jax-scalify
    python scripts/run_jax_scalify_examples.py --only fp8 --markdown

The examples are ``examples/mnist/mnist_classifier_from_scratch.py`` (SGD, float16),
``mnist_classifier_from_scratch_fp8.py`` (SGD, float16 + simulated FP8 matmuls) and
``mnist_classifier_mlp_flax.py`` (flax + optax Adam, float16), read from jax-scalify's sdist (or
``--source DIR``); nothing of them is copied into this repository. Each runs twice, as a script,
unchanged but for what is said here:

* **ours**: ``import jax_scalify as jsa`` becomes ``import scalify as jsa``, run by this Python;
* **seed**: the file as it is, run by jax-scalify 0.1.1 on JAX 0.4.30 in its own virtualenv
  (created on first use under ``~/.cache/qformats-peers``, see ``_jax_scalify_source.SEED_REQUIREMENTS``).

Data: MNIST cannot be downloaded everywhere, so both runs read scikit-learn's digits data set
(1,797 8x8 images, 10 classes) through an injected ``datasets`` module that stands in for the
examples' own ``datasets.py`` (the examples do ``import datasets; datasets.mnist()``). So that the
examples' hard-coded 784 inputs fit, each 8x8 image (0..16, divided by 16 to unit range) is
upsampled 3x to 24x24 (each pixel a 3x3 block) and zero-padded by 2 to 28x28, then flattened, as
MNIST's ``datasets.mnist()`` returns it; labels are one-hot float32. Split: a fixed permutation
(``RandomState(0)``), the first 1,280 images for training (10 batches of 128, no leftover batch),
the other 517 for test. Everything else (model, initialisation, optimiser, steps: 10 epochs of
10 batches, batch size 128, seeds) is the example's own, identical in both environments; both run
with ``JAX_THREEFRY_PARTITIONABLE=0``, JAX 0.4's random stream (JAX 0.5 changed the default), so
that ``PRNGKey(42)`` gives the flax example the same initial weights on both sides. The figure is
the example's last printed ``Test set accuracy``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = {
    "from scratch": "mnist_classifier_from_scratch.py",
    "fp8": "mnist_classifier_from_scratch_fp8.py",
    "flax + Adam": "mnist_classifier_mlp_flax.py",
}
IMPORT_SEED = re.compile(r"^(\s*)import jax_scalify as jsa\s*$", re.M)
ACCURACY = re.compile(r"Test set accuracy ([0-9.naif]+)", re.I)
N_TRAIN = 1280

DATASETS_MODULE = '''"""Stand-in for jax-scalify's examples/mnist/datasets.py: the digits data, laid out as MNIST."""
import os

import numpy as np


def mnist(permute_train=False):
    d = np.load(os.environ["DIGITS_AS_MNIST"])
    train_images, train_labels, test_images, test_labels = (d[k] for k in ("xtr", "ytr", "xte", "yte"))
    if permute_train:
        perm = np.random.RandomState(0).permutation(train_images.shape[0])
        train_images, train_labels = train_images[perm], train_labels[perm]
    return train_images, train_labels, test_images, test_labels
'''


def digits_as_mnist(path: Path) -> None:
    """Write the digits data laid out as ``datasets.mnist()`` returns MNIST (784 float32 in [0, 1], one-hot)."""
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    images = d.images.astype(np.float32) / np.float32(16.0)  # (n, 8, 8), 0..1
    images = np.kron(images, np.ones((1, 3, 3), np.float32))  # (n, 24, 24)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).reshape(len(images), 784)
    labels = np.array(d.target[:, None] == np.arange(10), np.float32)
    perm = np.random.RandomState(0).permutation(len(images))
    tr, te = perm[:N_TRAIN], perm[N_TRAIN:]
    np.savez(path, xtr=images[tr], ytr=labels[tr], xte=images[te], yte=labels[te])


def run_example(python: str, src: Path, dest: Path, rewrite: bool, data: Path, timeout: int) -> dict:
    dest.mkdir(parents=True, exist_ok=True)
    text = src.read_text()
    if rewrite:
        text, n = IMPORT_SEED.subn(r"\1import scalify as jsa", text)
        if n != 1:
            raise SystemExit(f"{src.name}: expected one `import jax_scalify as jsa`, found {n}")
    script = dest / src.name
    script.write_text(text)
    (dest / "datasets.py").write_text(DATASETS_MODULE)
    env = {**os.environ, "DIGITS_AS_MNIST": str(data), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(dest)}
    # JAX 0.5 made the partitionable threefry the default, which changes every `jax.random` draw (the flax
    # example's initial weights); the JAX 0.4 stream keeps one seed giving one initialisation on both sides.
    env["JAX_THREEFRY_PARTITIONABLE"] = "0"
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, script.name], cwd=dest, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    wall = time.perf_counter() - start
    accs = [float(a) for a in ACCURACY.findall(out)]
    (dest / "log.txt").write_text(out)
    return {"rc": rc, "wall_s": wall, "accuracies": accs, "final": accs[-1] if accs else None, "tail": out[-2000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="a jax-scalify checkout or unpacked sdist (default: pip download)")
    ap.add_argument("--only", choices=["scratch", "fp8", "flax"], action="append", help="run only these examples")
    ap.add_argument("--side", choices=["ours", "seed", "both"], default="both")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--json", type=Path, help="write the results (with per-epoch accuracies) to this file")
    ap.add_argument("--keep", type=Path, help="keep the run directories (scripts, logs) under this directory")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _jax_scalify_source import SEED_REQUIREMENTS, fetch_sdist, seed_python

    wanted = {k: v for k, v in EXAMPLES.items() if not args.only or any(o in k for o in args.only)}
    sides = ["ours", "seed"] if args.side == "both" else [args.side]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="jax-scalify-examples-") as tmp:
        work = args.keep.resolve() if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        source = args.source.resolve() if args.source else fetch_sdist(work)
        mnist = source / "examples" / "mnist"
        if not mnist.is_dir():
            raise SystemExit(f"{mnist} not found: pass --source DIR, a clone of the jax-scalify repository.")
        data = work / "digits_as_mnist.npz"
        digits_as_mnist(data)
        pythons = {"ours": sys.executable}
        if "seed" in sides:
            pythons["seed"] = str(seed_python())
        for name, fname in wanted.items():
            for side in sides:
                print(f"running {name} ({side}) ...", file=sys.stderr, flush=True)
                r = run_example(
                    pythons[side], mnist / fname, work / side / fname[:-3], side == "ours", data, args.timeout
                )
                results.setdefault(name, {})[side] = r
                if r["final"] is None or r["rc"] != 0:
                    print(f"  {name} ({side}) failed (rc {r['rc']}):\n{r['tail']}", file=sys.stderr)
    print_table(results, sides, args.markdown)
    print(f"\nseed environment: {', '.join(SEED_REQUIREMENTS)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _pct(x):
    return "—" if x is None else f"{100 * x:.2f}"


def print_table(results: dict, sides: list[str], markdown: bool) -> None:
    head = ["example"]
    for s in sides:
        head += [f"{s} test acc (%)", f"{s} wall (s)"]
    if len(sides) == 2:
        head += ["ours - seed (points)", "within 0.5"]
    rows = []
    for name, r in results.items():
        row = [name]
        for s in sides:
            row += [_pct(r[s]["final"]), f"{r[s]['wall_s']:.0f}"]
        if len(sides) == 2:
            a, b = r["ours"]["final"], r["seed"]["final"]
            diff = None if a is None or b is None else 100 * (a - b)
            row += [
                "—" if diff is None else f"{diff:+.2f}",
                "—" if diff is None else ("yes" if abs(diff) <= 0.5 else "NO"),
            ]
        rows.append(row)
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        for row in [head, *rows]:
            print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
