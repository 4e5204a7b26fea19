"""haiku: an LSTM language model under ``hk.dynamic_unroll`` (a ``lax.scan`` scalify interprets).

``hk.Embed`` -> ``hk.LSTM`` unrolled over time -> ``hk.Linear`` read-out, built with
``hk.transform`` and initialised by haiku. The LSTM's fused gate kernel is (in + hidden, 4 * hidden):
width 32 and hidden 32 give a (64, 128) kernel that every block layout accepts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from thirdparty_harness import Case, StepResults, check_grad, check_sharpness_aware_step, check_update, run_loss

hk = pytest.importorskip("haiku", reason="dm-haiku is not installed (pip install -e '.[test]')")

VOCAB = 64


def lstm_case(d_model=32, batch=2, seq=8):
    """Embedding width and LSTM hidden size ``d_model`` (a multiple of 32)."""

    def logits(tokens):  # tokens [T, B], time-major as dynamic_unroll expects
        x = hk.Embed(VOCAB, d_model)(tokens)
        core = hk.LSTM(d_model)
        out, _ = hk.dynamic_unroll(core, x, core.initial_state(tokens.shape[1]))
        return hk.Linear(VOCAB)(out)

    model = hk.without_apply_rng(hk.transform(logits))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, size=(seq + 1, batch)), jnp.int32)
    params = model.init(jax.random.key(4), tokens[:-1])

    def loss(params, tokens):
        logits = model.apply(params, tokens[:-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[1:]).mean()

    return Case("haiku_lstm", loss, params, tokens)


CASES = {"haiku_lstm": lstm_case}


@pytest.fixture(scope="module")
def case():
    return lstm_case()


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)


def test_sharpness_aware_step_under_recipe(case):
    """Both gradients of a sharpness-aware step taken inside ``recipes.apply``: the second at
    parameters that mix every input of the step (through the first gradient) still runs each
    GEMM in its roles (before, the step raised the pairing error)."""
    check_sharpness_aware_step(case)
