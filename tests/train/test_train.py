"""Smoke tests of examples.train: every mode for a few steps, the CLI, and the float16 collapse."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from examples.train import list_modes, loop, train

try:
    import sklearn  # noqa: F401

    HAVE_SKLEARN = True
except ImportError:
    HAVE_SKLEARN = False


@pytest.fixture(autouse=True)
def _standard_promotion():
    # tests/conftest.py makes dtype promotion strict; optax's Adam bias correction mixes a Python
    # float with its int32 step count, which strict promotion rejects (optax, not examples.train).
    with jax.numpy_dtype_promotion("standard"):
        yield


ROOT = Path(__file__).resolve().parents[2]
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
        loop.get_mode("nope")


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
    assert r.step_traces <= 1  # the step compiles once (see the transformer test)
    assert math.isfinite(m["train_loss"]) and math.isfinite(m["val_loss"])
    assert 0.0 <= m["val_accuracy"] <= 1.0


@pytest.mark.parametrize(
    "mode", [m if m in ("fp32", "mxfp8") else pytest.param(m, marks=pytest.mark.slow) for m in list_modes()]
)
def test_transformer_every_mode_smoke(mode):
    try:
        r = train("transformer", mode, steps=3, seed=0, hparams=TINY_GPT)
    except ValueError as e:  # a user-registered format whose blocks do not fit the 32-wide matmuls
        assert "multiple of" in str(e)
        pytest.skip(f"{mode}: block size does not fit the model's matmul dimensions")
    assert r.model == "transformer" and len(r.history) == 3
    assert "val_loss" in r.metrics() and "val_accuracy" not in r.metrics()
    assert r.step_s > 0
    if mode == "fp16":
        # Plain float16 does not train this model (Adam's eps and g**2 flush to zero; see
        # docs/accuracy.md): only the first loss, computed before any update, is finite.
        assert math.isfinite(r.history[0])
    else:
        assert all(math.isfinite(v) for v in r.history) and math.isfinite(r.val_loss)
    # The step compiles once: it is traced at most once during the loop (under fp16-scalify it was
    # already traced, by scalify.tree.settle_state, with the layout every step then gets: 0 here).
    # Without settle_state the first step returns optimizer-state leaves in another layout than the
    # initial state and the scalified step is traced, and compiled, a second time.
    assert r.step_traces <= 1


def test_adam_fp32_update_float16_moments_cover_a_wide_gradient():
    # A float16 gradient spanning 1e6 within one tensor: its square spans 1e12, more than a float16
    # tensor holds under one scale. Stored as sqrt(nu), Adam's first update is -lr * sign(g) everywhere.
    import jax.numpy as jnp

    import scalify

    lr = 1e-3
    opt = loop.adam_fp32_update(lr)
    mags = np.logspace(-6, 0, 64).astype(np.float32)
    g32 = mags * np.where(np.arange(64) % 2, 1, -1).astype(np.float32)
    params = scalify.as_scaled_array({"w": jnp.zeros((64,), jnp.float16)})
    grads = scalify.as_scaled_array({"w": jnp.asarray(g32, jnp.float16)})

    def two_steps(p, g):
        s = opt.init(p)
        u1, s = opt.update(g, s)
        u2, _ = opt.update(g, s)
        return u1, u2

    u1, u2 = jax.jit(scalify.scalify(two_steps))(params, grads)
    for u in (u1, u2):  # a constant gradient: every Adam update is -lr * sign(g) (float16 rounding aside)
        np.testing.assert_allclose(np.asarray(u["w"].to_array(jnp.float32)), -lr * np.sign(g32), rtol=0.05)


def test_cli_json_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # examples/ is not installed
    model = "mlp" if HAVE_SKLEARN else "transformer"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.train",
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
        cwd=ROOT,
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
    from examples.train import main

    assert main(["--format", "fp7", "--steps", "1"]) == 2
    assert "Unknown --format" in capsys.readouterr().err


def test_cli_recipe_trains_and_a_recipe_that_cannot_block_the_model_says_why(capsys):
    """``--recipe`` trains the unchanged model under a built-in recipe; the blockwise recipes need
    every GEMM dimension a multiple of 128, and on the small transformer (d_model 64) the run stops
    with the recipe's error, which names the operand and the fixes, instead of a traceback."""
    from examples.train import main

    assert main(["--model", "transformer", "--recipe", "mxfp8", "--steps", "2", "--json", "--no-progress"]) == 0
    m = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert m["format"] == "recipe:mxfp8" and math.isfinite(m["val_loss"])
    argv = ["--model", "transformer", "--recipe", "float8_blockwise", "--steps", "2", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "float8_blockwise" in err and "multiple of 128" in err and "high_precision_scopes" in err


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


def _load_accuracy_script():
    import importlib.util

    path = ROOT / "scripts" / "accuracy_table.py"
    spec = importlib.util.spec_from_file_location("accuracy_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_accuracy(mode, init_scale):
    if mode == "fp16" and init_scale >= 4:
        return 0.08  # collapsed
    if mode in ("fp16", "fp16-scalify") and init_scale < 1:
        return 0.85  # both float16 modes behind float32
    return 0.9


@needs_sklearn
def test_accuracy_script_reports_every_mode(tmp_path, monkeypatch):
    # The markdown logic only: train() is replaced by a fake with a slow int8_per_channel step.
    script = _load_accuracy_script()

    def fake_train(model, mode, steps, seed, init_scale=1.0, **kw):
        slow = mode == "int8_per_channel" and model == "transformer"
        nan = mode == "fp16" and model == "transformer"
        return loop.TrainResult(
            model=model,
            format=mode,
            mechanism="",
            steps=steps,
            seed=seed,
            init_scale=init_scale,
            train_loss=float("nan") if nan else 2.0,
            val_loss=float("nan") if nan else 2.0 + 0.01 * seed,
            val_accuracy=_fake_accuracy(mode, init_scale) if model == "mlp" else None,
            time_s=1.0,
            step_s=9.0 if slow else 0.1,
            history=[2.0] * steps,
        )

    monkeypatch.setattr(script, "train", fake_train)
    monkeypatch.setattr(script, "plot_histories", lambda *a, **k: None)
    out = tmp_path / "accuracy.md"
    script.main(["--mlp-steps", "2", "--gpt-steps", "2", "--scale-steps", "2", "--seeds", "0,1", "--out", str(out)])
    text = out.read_text()
    gpt = text.split("## Character-level transformer")[1]
    for m in list_modes():
        assert f"| `{m}` |" in gpt  # every mode has a row, run or not
    assert "| `int8_per_channel` | not run: 9.0 s/step (budget 5 s/step)" in gpt
    assert "Plain `fp16` trains the transformer to NaN" in gpt
    assert "`mxfp8` +0.00% (met)" in gpt
    assert "Plain float16 first collapses at init scale 4 here (2/2 seeds)" in text
    assert "`fp16-scalify` is +0.00 points at 4, +0.00 points at 8 from float32" in text
    assert "At 0.5, where plain float16 trains, both float16 modes trail float32 (-5.00 / -5.00 points" in text
