"""flax: a decoder block from NNX modules and one from Linen modules, in the shape of flax's examples.

Both use the library's own layers and initialisers (``nnx.Embed``/``nnx.MultiHeadAttention``/
``nnx.LayerNorm``/``nnx.Linear``; ``nn.Embed``/``nn.SelfAttention``/``nn.LayerNorm``/``nn.Dense``),
flax's causal mask (``make_causal_mask``, applied by flax as ``where(mask, w, finfo(dtype).min)``) and
a tied read-out (``Embed.attend``). Head dim 32 and width 64 so MX (block 32) and NVFP4 (block 16)
layouts accept the projection kernels.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from conftest import Case, StepResults, check_grad, check_update, run_loss

flax = pytest.importorskip("flax", reason="flax is not installed (pip install -e '.[test]')")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

VOCAB, D, HEADS, HIDDEN, BATCH, T = 64, 64, 2, 128, 2, 8


def _tokens(seed=0):
    return jax.numpy.asarray(np.random.default_rng(seed).integers(0, VOCAB, size=(BATCH, T + 1)), jax.numpy.int32)


def _next_token_loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class NNXDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, HIDDEN, rngs=rngs)
        self.fc2 = nnx.Linear(HIDDEN, D, rngs=rngs)
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(tokens))
        x = x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))
        return self.embed.attend(self.ln_f(x))


def nnx_case():
    graphdef, state = nnx.split(NNXDecoder(nnx.Rngs(0)))

    def loss(state, tokens):
        model = nnx.merge(graphdef, state)
        return _next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])

    return Case("flax_nnx_decoder", loss, state, _tokens(0))


class LinenDecoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(stddev=1.0))
        x = embed(tokens)
        x = x + self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, tokens.shape[1], D))
        y = nn.SelfAttention(num_heads=HEADS, qkv_features=D, deterministic=True)(
            nn.LayerNorm()(x), mask=nn.make_causal_mask(tokens)
        )
        x = x + y
        y = nn.Dense(D)(nn.relu(nn.Dense(HIDDEN)(nn.LayerNorm()(x))))
        x = x + y
        return embed.attend(nn.LayerNorm()(x))


def linen_case():
    model = LinenDecoder()
    tokens = _tokens(1)
    params = model.init(jax.random.key(1), tokens[:, :-1])["params"]

    def loss(params, tokens):
        return _next_token_loss(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])

    return Case("flax_linen_decoder", loss, params, tokens)


@pytest.fixture(scope="module", params=["nnx", "linen"])
def case(request):
    return {"nnx": nnx_case, "linen": linen_case}[request.param]()


STEPS = StepResults()


def test_loss(case, fmt_name):
    run_loss(case, fmt_name)


@pytest.mark.slow
def test_grad(case, fmt_name):
    check_grad(STEPS, case, fmt_name)


@pytest.mark.slow
def test_adam_update(case, fmt_name):
    check_update(STEPS, case, fmt_name)
