"""Haiku's own example training steps, unchanged, under scalify (scripts/run_haiku_examples.py).

The script downloads dm-haiku's sdist (the installed version) and imports the examples from it, so
this test needs PyPI, as the install that CI runs first does. It runs in a subprocess: the script
serves stand-ins for tensorflow through an import hook that must not reach other tests.

The three examples: the Transformer LM (dropout, ``clip_by_global_norm`` + Adam), the LSTM
character LM (``hk.dynamic_unroll``), and the ResNet v2 with BatchNorm state, jmp's dynamic loss
scale and ``pmap``; the Transformer in MXFP8, the LSTM and the ResNet in the per-channel integer
format (the script runs every pair). ``docs/examples.md`` has the full table from the script, at
ResNet-50's depth.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("haiku", reason="dm-haiku is not installed (pip install -e '.[test]')")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_haiku_examples.py"
# At ResNet-50's depth (16 bottleneck blocks) the ResNet compiled for minutes on two cores; here it
# has one block per group: the example's step (BatchNorm state, projections, weight decay by name,
# jmp's loss scale, pmap) is the same. The exactly-zero BatchNorm gradients whose scale drifted to Inf
# over 16 blocks (docs/examples.md) are held by the fast lane's
# tests/scalify/test_regressions.py::test_zeros_along_a_chain_keep_a_finite_scale (a chain of 20).
RUNS = (
    (("transformer",), ("mxfp8",), ()),
    (("rnn",), ("int8_per_channel",), ()),
    (("imagenet",), ("int8_per_channel",), ("--resnet-blocks", "1,1,1,1")),
)


def _run(examples, formats, extra):
    cmd = [sys.executable, str(SCRIPT), "--only", ",".join(examples), "--formats", ",".join(formats), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    if "could not download dm-haiku" in proc.stderr:  # no route to PyPI: nothing to run the examples from
        pytest.skip(f"dm-haiku's sdist could not be downloaded: {proc.stderr.strip()[-500:]}")
    lines = [line.split() for line in proc.stdout.splitlines()]
    outcomes = {(w[0], w[1]): w[2] for w in lines if len(w) >= 3 and w[0] in examples and w[1] in formats}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert outcomes == {(e, f): "ok" for e in examples for f in formats}, proc.stdout[-3000:]


@pytest.mark.slow
def test_haiku_examples_train_unchanged():
    for examples, formats, extra in RUNS:
        _run(examples, formats, extra)
