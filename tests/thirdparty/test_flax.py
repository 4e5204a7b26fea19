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
from thirdparty_harness import Case, StepResults, check_grad, check_sharpness_aware_step, check_update, run_loss

flax = pytest.importorskip("flax", reason="flax is not installed (pip install -e '.[test]')")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

VOCAB = 64


def _tokens(seed, batch, seq):
    return jax.numpy.asarray(np.random.default_rng(seed).integers(0, VOCAB, size=(batch, seq + 1)), jax.numpy.int32)


def _next_token_loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class NNXDecoder(nnx.Module):
    def __init__(self, d, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=d // 32, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(tokens))
        x = x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))
        return self.embed.attend(self.ln_f(x))


def nnx_case(d_model=64, batch=2, seq=8):
    """Width ``d_model`` (a multiple of 32), heads of 32, MLP 2 * d_model."""
    graphdef, state = nnx.split(NNXDecoder(d_model, nnx.Rngs(0)))

    def loss(state, tokens):
        model = nnx.merge(graphdef, state)
        return _next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])

    return Case("flax_nnx_decoder", loss, state, _tokens(0, batch, seq))


class LinenDecoder(nn.Module):
    d: int = 64

    @nn.compact
    def __call__(self, tokens):
        d = self.d
        embed = nn.Embed(VOCAB, d, embedding_init=nn.initializers.normal(stddev=1.0))
        x = embed(tokens)
        x = x + self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, tokens.shape[1], d))
        y = nn.SelfAttention(num_heads=d // 32, qkv_features=d, deterministic=True)(
            nn.LayerNorm()(x), mask=nn.make_causal_mask(tokens)
        )
        x = x + y
        y = nn.Dense(d)(nn.relu(nn.Dense(2 * d)(nn.LayerNorm()(x))))
        x = x + y
        return embed.attend(nn.LayerNorm()(x))


def linen_case(d_model=64, batch=2, seq=8):
    """Width ``d_model`` (a multiple of 32), heads of 32, MLP 2 * d_model, learned positions."""
    model = LinenDecoder(d_model)
    tokens = _tokens(1, batch, seq)
    params = model.init(jax.random.key(1), tokens[:, :-1])["params"]

    def loss(params, tokens):
        return _next_token_loss(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])

    return Case("flax_linen_decoder", loss, params, tokens)


CASES = {"flax_nnx": nnx_case, "flax_linen": linen_case}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return CASES[request.param]()


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
