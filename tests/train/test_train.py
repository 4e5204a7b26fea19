"""Smoke tests of scalify.train: every mode for a few steps, the CLI, and the float16 collapse."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from scalify.train import _loop, list_modes, train

try:
    import sklearn  # noqa: F401

    HAVE_SKLEARN = True
except ImportError:
    HAVE_SKLEARN = False


@pytest.fixture(autouse=True)
def _standard_promotion():
    # tests/conftest.py makes dtype promotion strict; optax's Adam bias correction mixes a Python
    # float with its int32 step count, which strict promotion rejects (optax, not scalify.train).
    with jax.numpy_dtype_promotion("standard"):
        yield


needs_sklearn = pytest.mark.skipif(not HAVE_SKLEARN, reason="digits data needs scikit-learn (the `train` extra)")
TINY_GPT = {
    "batch_size": 2,
    "eval_batches": 1,
    "gpt": {"context": 32, "n_layers": 1, "d_model": 32, "n_heads": 1, "d_ff": 64},
}
TINY_MLP = {"batch_size": 32, "mlp_sizes": (64, 32, 32, 10)}


def test_modes_cover_plain_scalify_and_every_format():
    import qformats as qf

    modes = list_modes()
    assert modes[:4] == ["fp32", "bf16", "fp16", "fp16-scalify"]
    for f in qf.list_formats():
        assert f in modes  # fp16 / bf16 are the plain modes
    with pytest.raises(ValueError, match="Unknown --format"):
        _loop.get_mode("nope")


FAST_MODES = ("fp32", "fp16", "fp16-scalify", "mxfp8", "fp8_e4m3")


@needs_sklearn
@pytest.mark.parametrize(
    "mode", [m if m in FAST_MODES else pytest.param(m, marks=pytest.mark.slow) for m in list_modes()]
)
def test_mlp_every_mode_smoke(mode):
    try:
        r = train("mlp", mode, steps=3, seed=0, hparams=TINY_MLP)
    except ValueError as e:  # a user-registered format whose blocks do not fit the 32/64-wide matmuls
        assert "multiple of" in str(e)
        pytest.skip(f"{mode}: block size does not fit the model's matmul dimensions")
    m = r.metrics()
    assert m["format"] == mode and m["steps"] == 3 and len(r.history) == 3
    assert math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"])
    assert 0.0 <= m["val_accuracy"] <= 1.0


@pytest.mark.parametrize(
    "mode",
    ["fp32", "mxfp8", *(pytest.param(m, marks=pytest.mark.slow) for m in ("fp16", "fp16-scalify", "int8_per_channel"))],
)
def test_transformer_mode_smoke(mode):
    r = train("transformer", mode, steps=2, seed=0, hparams=TINY_GPT)
    assert r.model == "transformer" and len(r.history) == 2
    # The first loss is computed before any update; later values may be NaN in the modes that do not
    # train this model (plain fp16: Adam's eps underflows; see docs/accuracy.md).
    assert math.isfinite(r.history[0])
    assert "val_loss" in r.metrics()
    assert "val_accuracy" not in r.metrics()


def test_cli_json_subprocess():
    env = dict(os.environ)
    model = "mlp" if HAVE_SKLEARN else "transformer"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scalify.train",
            "--model",
            model,
            "--format",
            "mxfp8",
            "--steps",
            "2",
            "--json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    for k in ("format", "steps", "train_loss", "val_loss"):
        assert k in m
    assert m["format"] == "mxfp8" and m["steps"] == 2
    if HAVE_SKLEARN:
        assert "val_accuracy" in m


def test_cli_rejects_unknown_format(capsys):
    from scalify.train import main

    assert main(["--format", "fp7", "--steps", "1"]) == 2
    assert "Unknown --format" in capsys.readouterr().err


@needs_sklearn
def test_float16_collapse_and_scalify_recovery():
    # Unnormalised N(0, 1) init times 8: activations overflow float16 (max 65504).
    hp = {"init_std": 1.0, "lr": 1e-3}
    f32 = train("mlp", "fp32", steps=40, seed=0, init_scale=8.0, hparams=hp)
    f16 = train("mlp", "fp16", steps=40, seed=0, init_scale=8.0, hparams=hp)
    sc = train("mlp", "fp16-scalify", steps=40, seed=0, init_scale=8.0, hparams=hp)
    assert not math.isfinite(f16.history[-1]) or f16.val_accuracy < 0.2  # collapsed
    assert f32.val_accuracy > 0.5
    assert abs(sc.val_accuracy - f32.val_accuracy) < 0.05
