"""Hugging Face diffusers' Flax models and Stable Diffusion pipelines, unchanged, under scalify
(scripts/run_diffusers_flax.py).

UNets of Stable Diffusion 1.x, 2.x (v-prediction) and XL, memory-efficient attention, a ControlNet
feeding a UNet and the KL autoencoder, each trained one step as diffusers' training scripts do;
and five pipelines' own ``_generate`` (DDIM, DPM-Solver++, image-to-image, ControlNet, SDXL with
two text encoders), the weights a tree of ScaledArrays, against the same program in float32 on the
dequantized weights (the third-party harness's check and tolerance; for the pipelines that
tolerance times the guidance scale, which multiplies float32's own rounding as much). Each case runs
the script in a subprocess on wheels fetched once per module: the pipelines import transformers
4.57, which checks at import for the ``tokenizers`` and ``huggingface_hub`` of its pins.

The fast lane runs the DPM-Solver pipeline in MXFP8 (text encoder, UNet and VAE decoder, 85 s in a
process of its own on 2 cores); the slow lane the UNet's training step in MXFP8 (130 s), every other
check once, across the other families, and three recipes. ``docs/examples.md`` has the
script's full tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import thirdparty_harness

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import run_diffusers_flax as runner

SCRIPT = Path(runner.__file__)

# (checks, format): one subprocess each; every check once, every family over a training step and a
# pipeline.
ROTATION = [
    ("sd_dpm", "mxfp8"),
    ("unet_sd", "mxfp8"),
    ("unet_v,sd_ddim", "fp16"),
    ("unet_memeff,sd_controlnet", "fp8_e4m3"),
    ("unet_sdxl,sd_img2img", "int8_per_channel"),
    ("controlnet,sdxl", "mxfp4"),
    ("vae,sd_ddim", "nvfp4"),
]
FAST = {ROTATION[0]}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        return runner.fetch(tmp_path_factory.mktemp("diffusers_flax"))
    except SystemExit as exc:  # no route to PyPI: nothing to run the models from
        pytest.skip(f"the diffusers wheels could not be downloaded: {str(exc)[-500:]}")


def run_script(site, *args) -> str:
    return thirdparty_harness.run_script(SCRIPT, site, *args)


def test_rotation_covers_every_check_and_family():
    from thirdparty_harness import FAMILY_REPRESENTATIVES

    checks = {c for cs, _ in ROTATION for c in cs.split(",")}
    assert checks == set(runner.CHECKS)
    assert {f for _, f in ROTATION} == set(FAMILY_REPRESENTATIVES)
    for fmt in FAMILY_REPRESENTATIVES:  # a training step and a pipeline in every family
        kinds = {c in runner.GENERATE for cs, f in ROTATION if f == fmt for c in cs.split(",")}
        assert kinds == {True, False}, fmt


@pytest.mark.parametrize(
    ("checks", "fmt"),
    [pytest.param(c, f, marks=() if (c, f) in FAST else pytest.mark.slow, id=f"{f}-{c}") for c, f in ROTATION],
)
def test_diffusers_flax_unchanged(site, checks, fmt):
    out = run_script(site, "--only", checks, "--formats", fmt)
    n = len(checks.split(","))
    assert f"{n} of {n} (example, format) pairs ok or n/a; 0 failed" in out, out
    assert thirdparty_harness.ok_rows(out) == n, out  # every row ran: none is n/a


@pytest.mark.slow
def test_diffusers_flax_under_recipes(site):
    """``recipes.apply`` on the unchanged UNet and VAE losses, the convolutions over 3, 4 or 8
    channels in high precision: ``high`` reproduces float32, MXFP8 and NVFP4 give gradients above
    their cosine floors (docs/examples.md has every built-in)."""
    scopes = "conv_in,conv_out,quant_conv,post_quant_conv"
    out = run_script(site, "--only", "unet_sd,vae", "--recipes", "high,mxfp8,nvfp4", "--high-precision-scopes", scopes)
    assert "6 of 6 (example, format) pairs ok or n/a; 0 failed" in out, out
    assert thirdparty_harness.ok_rows(out) == 6, out
