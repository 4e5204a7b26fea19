"""flax's own example train steps, unchanged, under scalify (scripts/run_flax_examples.py).

The script downloads flax's sdist (the installed version) and imports the examples from it, so this
test needs PyPI, as the install that CI runs first does. It runs in a subprocess: the script serves
stand-ins for tensorflow and friends through an import hook that must not reach other tests.

Six of the examples: ``jax.jit`` with an LSTM under ``nn.scan`` (seq2seq) and with a static
argument (vae), ``pmap`` + ``lax.pmean`` with a Transformer (nlp_seq), ``pmap`` with BatchNorm
state and flax's ``DynamicScale`` (imagenet), and the NNX steps that update their modules in place
under ``nnx.jit`` (mnist's CNN, the gemma transformer), each in an MX or the per-channel integer format.
``docs/examples.md`` has the full table from the script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax", reason="flax is not installed (pip install -e '.[test]')")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_flax_examples.py"
# Each example in one format (the script runs the full cross product for docs/examples.md): MX blocks
# for the LSTM scan, pmap's Transformer and NNX's in-place CNN; the per-channel integer format for
# vae (widths 784, 500, 20 leave MXFP8 nothing to scale), BatchNorm with DynamicScale and gemma.
RUNS = {
    "mxfp8": ("seq2seq", "nlp_seq", "mnist"),
    "int8_per_channel": ("vae", "imagenet+DynamicScale", "gemma"),
}


def _run_script(examples, column, *options) -> list[str]:
    """The script's lines for ``examples`` run with ``options``, each example's outcome in ``column``
    (a format's or a recipe's name) asserted ``ok``."""
    cmd = [sys.executable, str(SCRIPT), "--only", ",".join(examples), *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    if "could not download flax" in proc.stderr:  # no route to PyPI: nothing to run the examples from
        pytest.skip(f"flax's sdist could not be downloaded: {proc.stderr.strip()[-500:]}")
    lines = [line.split() for line in proc.stdout.splitlines()]
    outcomes = {w[0]: w[2] for w in lines if len(w) >= 3 and w[0] in examples and w[1] == column}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert outcomes == dict.fromkeys(examples, "ok"), proc.stdout[-3000:]
    return [line for line in proc.stdout.splitlines() if column in line]


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", list(RUNS))
def test_flax_examples_train_unchanged(fmt_name):
    _run_script(RUNS[fmt_name], fmt_name, "--formats", fmt_name)


@pytest.mark.slow
def test_flax_examples_train_under_a_recipe():
    """``recipes.apply(train_step, recipe)`` on wmt's pmapped Transformer step and the NNX gemma step,
    both of which take their gradient inside: every backward GEMM paired with its forward one,
    outputs finite, the update above the recipe's cosine floor against float32's."""
    lines = _run_script(("wmt", "gemma"), "float8_tensorwise", "--recipes", "float8_tensorwise")
    assert len(lines) == 2 and all("backward GEMMs paired" in line for line in lines), lines
