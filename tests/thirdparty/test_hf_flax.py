"""Hugging Face transformers' Flax models, unchanged, under scalify (scripts/run_hf_flax_models.py).

Decoders, encoders with a padding mask, encoder-decoders, vision models (BatchNorm in training
mode), CLIP, wav2vec 2.0 with a CTC loss, and the library's own ``generate`` (greedy, beam search,
top-k sampling), each called as its documentation shows with ``params=`` a tree of ScaledArrays,
against the same program in float32 on the dequantized weights (the third-party harness's check
and tolerance; generated tokens equal). Each case runs the script in a subprocess on wheels fetched
once per module: transformers 4.57 (the last line with Flax models) checks at import for the
``tokenizers`` and ``huggingface_hub`` of its pins, which the script puts first on ``sys.path``,
where they must not meet another suite's imports.

The fast lane runs Llama's training loss in MXFP8; the slow lane an encoder and sampling from an
encoder-decoder in MXFP8, every other check once, each family over several kinds of model, and
three recipes.
``docs/examples.md`` has the script's full tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import thirdparty_harness

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import run_hf_flax_models as runner

SCRIPT = Path(runner.__file__)

# (checks, format): one subprocess each; every check once, every family over several kinds of model.
ROTATION = [
    ("llama", "mxfp8"),
    ("bert,bart_sample", "mxfp8"),
    ("mistral,roformer,vit,clip", "fp16"),
    ("gemma,opt,albert,beit,llama_greedy", "fp8_e4m3"),
    ("gpt2,electra,dinov2,whisper", "int8_per_channel"),
    ("gptj,big_bird,regnet,resnet,gpt2_beam", "mxfp4"),
    ("gpt_neo,bloom,roberta,bart,wav2vec2", "nvfp4"),
]
FAST = {ROTATION[0]}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        return runner.fetch(tmp_path_factory.mktemp("hf_flax"))
    except SystemExit as exc:  # no route to PyPI: nothing to run the models from
        pytest.skip(f"the transformers wheels could not be downloaded: {str(exc)[-500:]}")


def run_script(site, *args) -> str:
    return thirdparty_harness.run_script(SCRIPT, site, *args)


def test_rotation_covers_every_check_and_family():
    from thirdparty_harness import FAMILY_REPRESENTATIVES

    checks = {c for cs, _ in ROTATION for c in cs.split(",")}
    assert checks == set(runner.CHECKS)
    assert {f for _, f in ROTATION} == set(FAMILY_REPRESENTATIVES)


@pytest.mark.parametrize(
    ("checks", "fmt"),
    [pytest.param(c, f, marks=() if (c, f) in FAST else pytest.mark.slow, id=f"{f}-{c}") for c, f in ROTATION],
)
def test_hf_flax_models_unchanged(site, checks, fmt):
    out = run_script(site, "--only", checks, "--formats", fmt)
    n = len(checks.split(","))
    assert f"{n} of {n} (example, format) pairs ok or n/a; 0 failed" in out, out
    assert thirdparty_harness.ok_rows(out) == n, out  # every row ran: none is n/a


@pytest.mark.slow
def test_hf_flax_models_under_recipes(site):
    """``recipes.apply`` on the unchanged losses at 32 tokens: ``high`` reproduces float32, MXFP8 and
    NVFP4 give gradients above their cosine floors (docs/examples.md has every built-in)."""
    out = run_script(site, "--only", "llama,bert,bart", "--recipes", "high,mxfp8,nvfp4")
    assert "9 of 9 (example, format) pairs ok or n/a; 0 failed" in out, out
    assert thirdparty_harness.ok_rows(out) == 9, out
