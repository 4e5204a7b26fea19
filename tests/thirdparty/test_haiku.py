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
from conftest import Case, StepResults, check_grad, check_update, run_loss

hk = pytest.importorskip("haiku", reason="dm-haiku is not installed (pip install -e '.[test]')")

VOCAB, EMBED, HIDDEN, BATCH, T = 64, 32, 32, 2, 8


def _logits(tokens):  # tokens [T, B], time-major as dynamic_unroll expects
    x = hk.Embed(VOCAB, EMBED)(tokens)
    core = hk.LSTM(HIDDEN)
    out, _ = hk.dynamic_unroll(core, x, core.initial_state(tokens.shape[1]))
    return hk.Linear(VOCAB)(out)


@pytest.fixture(scope="module")
def case():
    model = hk.without_apply_rng(hk.transform(_logits))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, size=(T + 1, BATCH)), jnp.int32)
    params = model.init(jax.random.key(4), tokens[:-1])

    def loss(params, tokens):
        logits = model.apply(params, tokens[:-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[1:]).mean()

    return Case("haiku_lstm", loss, params, tokens)


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)
