"""Google DeepMind's RecurrentGemma (Griffin), unchanged, under scalify (scripts/run_recurrentgemma.py).

The RG-LRU recurrence (linear and associative scans), local attention, ``nn.remat`` blocks and the
library's own ``Sampler`` (a ``lax.while_loop`` over recurrent states and a key/value cache), with
the weights in a scaled format, against the same programs in float32 on the dequantized weights
(the third-party harness's check and tolerance). The script downloads the recurrentgemma wheel with
typeguard 2 (its pin), einops and sentencepiece (``pip download --no-deps``), so this needs PyPI, as
the install CI runs first does.

The fast lane runs the training step in MXFP8 and the error that names ``dequantize_outputs``; the
slow lane decoding in NVFP4 (35 s on 2 workers; the ``gemma`` library's KV-cache decoding is in the
fast lane), the other families, the associative scan and two recipes.
``docs/examples.md`` has the script's full tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from thirdparty_harness import quantize_tree

import qformats as qf
import scalify

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import run_recurrentgemma as runner

# (check, format): every family meets the training step once and decoding once.
ROTATION = [
    ("griffin", "mxfp8"),
    ("decode", "nvfp4"),
    ("griffin", "fp16"),
    ("griffin", "nvfp4"),
    ("griffin", "mxfp4"),
    ("griffin_associative", "int8_per_channel"),
    ("griffin_associative", "fp8_e4m3"),
    ("decode", "mxfp8"),
    ("decode", "mxfp4"),
    ("decode", "int8_per_channel"),
    ("decode", "fp8_e4m3"),
    ("decode", "fp16"),
]
FAST = {("griffin", "mxfp8")}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    try:
        root = runner.fetch(tmp_path_factory.mktemp("recurrentgemma"))
    except SystemExit as exc:  # no route to PyPI: nothing to run the model from
        pytest.skip(f"the recurrentgemma wheels could not be downloaded: {str(exc)[-500:]}")
    return runner.import_recurrentgemma(root)


def test_rotation_covers_every_check_and_family():
    from thirdparty_harness import FAMILY_REPRESENTATIVES

    assert {c for c, _ in ROTATION} == set(runner.CHECKS)
    for check in ("decode", "griffin"):
        assert set(FAMILY_REPRESENTATIVES) <= {f for c, f in ROTATION if c.startswith(check)}, check


@pytest.mark.parametrize(
    ("check", "fmt_name"),
    [pytest.param(c, f, marks=() if (c, f) in FAST else pytest.mark.slow, id=f"{c}-{f}") for c, f in ROTATION],
)
def test_recurrentgemma_unchanged(lib, check, fmt_name):
    outcome, detail = runner.run_check(lib, check, qf.get_format(fmt_name), recipe_run=False)
    assert outcome == "ok", f"{check} in {fmt_name}: {outcome} {detail}"


def test_sampler_state_without_dequantize_outputs_names_the_option(lib):
    """The sampler's ``SamplingState`` (jaxtyping-checked ``flax.struct`` dataclass) rejects a
    ScaledArray field; plain ``scalify`` says so and names ``dequantize_outputs=True`` (it raised
    jaxtyping's TypeCheckError from inside the output's rebuild)."""
    import jax

    model = runner.griffin(lib)
    params = model.init(jax.random.PRNGKey(0), jax.numpy.zeros((1, 4), "int32"), jax.numpy.arange(4)[None])["params"]
    sampler = lib.rg.Sampler(model, runner.vocabulary(lib), quantize_tree(params, qf.MXFP8), jit_compile=False)
    tokens = jax.numpy.asarray([[1, 5, 6, 7]])
    with pytest.raises(TypeError, match=r"SamplingState.*dequantize_outputs=True"):
        jax.jit(scalify.scalify(sampler._prompt_processing_fn), static_argnums=(4, 5, 6))(
            sampler.params, tokens, None, jax.numpy.asarray([4]), 4, True, False
        )


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["high", "mxfp8", "nvfp4"])
def test_recurrentgemma_under_a_recipe(lib, recipe):
    """``recipes.apply`` on the unchanged loss at 32 tokens (the RG-LRU's block-diagonal gates and
    the attention's products under the recipe); ``high`` reproduces float32."""
    outcome, detail = runner.run_check(lib, "griffin", runner.recipe(recipe), recipe_run=True)
    assert outcome == "ok", f"griffin under {recipe}: {outcome} {detail}"
