"""Google DeepMind's ``gemma`` library (Gemma 3's ``gm.nn.Transformer``), unchanged, under scalify.

Each case runs ``scripts/run_gemma_library.py`` in a subprocess on wheels fetched once per module:
the library's modules import kauldron, whose typeguard 4 cannot share a process with
recurrentgemma's typeguard 2 (``test_recurrentgemma.py``), and the script stands in for the one
TensorFlow name kauldron reads at import, which must not leak into the other suites' processes.
The checks and their tolerance are the third-party harness's (see the script's docstring).

The fast lane runs KV-cache decoding in MXFP8 and QLoRA (a training step of the library's LoRA
adapters over NVFP4 base weights); the slow lane the full training step in MXFP4 (40 s on 2
workers), the other families and three recipes.
``docs/examples.md`` has the script's full tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import thirdparty_harness

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import run_gemma_library as runner

SCRIPTS = Path(runner.__file__).parent

# (check, formats): each family meets the training step and the decoding once.
ROTATION = [
    ("gemma3", "mxfp4"),
    ("gemma3_decode", "mxfp8"),
    ("gemma3", "fp16,int8_per_channel,nvfp4"),
    ("gemma3", "fp8_e4m3,mxfp8"),
    ("gemma3_decode", "fp16,fp8_e4m3,int8_per_channel"),
    ("gemma3_decode", "mxfp4,nvfp4"),
    ("gemma3_qlora", "nvfp4"),
    ("gemma3_qlora", "fp16,fp8_e4m3,int8_per_channel,mxfp8,mxfp4"),
]
FAST = {("gemma3_decode", "mxfp8"), ("gemma3_qlora", "nvfp4")}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        return runner.fetch(tmp_path_factory.mktemp("gemma_library"))
    except SystemExit as exc:  # no route to PyPI: nothing to run the model from
        pytest.skip(f"the gemma wheels could not be downloaded: {str(exc)[-500:]}")


def run_script(site, *args) -> str:
    return thirdparty_harness.run_script(SCRIPTS / "run_gemma_library.py", site, *args)


def test_rotation_covers_every_check_and_family():
    from thirdparty_harness import FAMILY_REPRESENTATIVES

    assert {c for c, _ in ROTATION} == set(runner.CHECKS)
    for check in runner.CHECKS:
        covered = {f for c, fs in ROTATION if c == check for f in fs.split(",")}
        assert set(FAMILY_REPRESENTATIVES) <= covered, check


@pytest.mark.parametrize(
    ("check", "formats"),
    [pytest.param(c, f, marks=() if (c, f) in FAST else pytest.mark.slow, id=f"{c}-{f}") for c, f in ROTATION],
)
def test_gemma_library_unchanged(site, check, formats):
    out = run_script(site, "--only", check, "--formats", formats)
    n = len(formats.split(","))
    assert f"{n} of {n} (example, format) pairs ok or n/a; 0 failed" in out, out


@pytest.mark.slow
def test_gemma_library_under_recipes(site):
    """``recipes.apply`` on the unchanged loss at 32 tokens: ``high`` reproduces float32, MXFP8
    and tensor-wise FP8 give a gradient above the 8-bit cosine floor (the 4-bit recipes are near
    their floor on this model: docs/examples.md)."""
    out = run_script(site, "--only", "gemma3", "--recipes", "high,mxfp8,float8_tensorwise")
    assert "3 of 3 (example, format) pairs ok or n/a; 0 failed" in out, out
