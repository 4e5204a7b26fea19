"""flaxmodels' StyleGAN2, unchanged, trained under scalify with its second-order regularisers
(scripts/run_stylegan2.py).

The mapping, synthesis and discriminator networks of flaxmodels 0.1.3 (modulated convolutions,
FIR resampling as grouped convolutions, minibatch stddev), the discriminator's logistic loss, R1
(the discriminator's gradient at the data, squared: a gradient of a gradient), the generator's
non-saturating loss with mixed latents and the path-length penalty (the images differentiated by
the latent), each a value, gradient and Adam update against float32 on the dequantized weights (the
third-party harness's check and tolerance). The script runs in a subprocess: it lets
``jnp.reshape`` take the ``newshape`` keyword flaxmodels passes (removed in JAX 0.7), which no
other suite should see. The repository's own training steps need a clone (``--source``); their
table is in ``docs/examples.md``.

The fast lane runs R1 in MXFP8 (33 s in a process of its own on 2 cores; the path-length penalty
took 49 s); the slow lane the path-length penalty in MXFP8, two losses in each other family
(a second-order one in each, every loss in three families), and three recipes on the two penalties
(their gradient taken outside ``recipes.apply``: the recipe's quantizers are differentiated twice).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import thirdparty_harness

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import run_stylegan2 as runner

SCRIPT = Path(runner.__file__)

# (losses, format): one subprocess each; a second-order loss in every family, every loss twice.
ROTATION = [
    ("r1", "mxfp8"),
    ("pl", "mxfp8"),
    ("d_loss,r1", "fp16"),
    ("g_loss,pl", "fp8_e4m3"),
    ("d_loss,pl", "int8_per_channel"),
    ("g_loss,r1", "mxfp4"),
    ("d_loss,pl", "nvfp4"),
]
FAST = {ROTATION[0]}
SCOPES = "FromRGBLayer_0,ToRGBLayer_0,DiscriminatorLayer_0,LinearLayer_1"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    try:
        return runner.fetch(tmp_path_factory.mktemp("flaxmodels"))
    except SystemExit as exc:  # no route to PyPI: nothing to run the models from
        pytest.skip(f"the flaxmodels wheel could not be downloaded: {str(exc)[-500:]}")


def run_script(site, *args) -> str:
    return thirdparty_harness.run_script(SCRIPT, site, *args)


def test_rotation_covers_every_loss_and_family():
    from thirdparty_harness import FAMILY_REPRESENTATIVES

    assert {c for cs, _ in ROTATION for c in cs.split(",")} == set(runner.LOSSES)
    assert {f for _, f in ROTATION} == set(FAMILY_REPRESENTATIVES)
    for checks, _ in ROTATION:  # a gradient of a gradient in every family
        assert {"r1", "pl"} & set(checks.split(",")), checks


@pytest.mark.parametrize(
    ("checks", "fmt"),
    [pytest.param(c, f, marks=() if (c, f) in FAST else pytest.mark.slow, id=f"{f}-{c}") for c, f in ROTATION],
)
def test_stylegan2_unchanged(site, checks, fmt):
    out = run_script(site, "--only", checks, "--formats", fmt)
    n = len(checks.split(","))
    assert f"{n} of {n} (example, format) pairs ok or n/a; 0 failed" in out, out
    assert thirdparty_harness.ok_rows(out) == n, out  # every row ran: none is n/a


def test_the_repositorys_steps_need_a_clone(site):
    """Without a clone the four training steps are ``n/a``, said so, not skipped silently."""
    out = run_script(site, "--only", "regul_step_D", "--formats", "mxfp8")
    assert "n/a   the repository's steps: pass --source" in out, out


@pytest.mark.slow
def test_stylegan2_penalties_under_recipes(site):
    """R1 and the path-length penalty under ``jax.value_and_grad(recipes.apply(loss, r))``, the RGB
    and one-score layers in high precision: ``high`` reproduces float32, MXFP8 and NVFP4 give
    gradients above their cosine floors (before the recipe's quantizers had a straight-through
    derivative, the part of the penalties' gradients through the backward GEMMs' operands was lost:
    cosines 0.31 to 0.80 with float32's)."""
    out = run_script(site, "--only", "r1,pl", "--recipes", "high,mxfp8,nvfp4", "--high-precision-scopes", SCOPES)
    assert "6 of 6 (example, format) pairs ok or n/a; 0 failed" in out, out
    assert thirdparty_harness.ok_rows(out) == 6, out
