"""A third-party mixture of experts (jax-llm-examples' Qwen3-MoE, experts in ``lax.ragged_dot``) under the recipes.

    git clone https://github.com/jax-ml/jax-llm-examples /tmp/jax-llm-examples
    python scripts/run_moe_models.py --source /tmp/jax-llm-examples      # every built-in recipe
    python scripts/run_moe_models.py --source DIR --recipes mxfp8,nvfp4

The model is ``qwen3/qwen3_jax/model.py`` of a checkout (or an extracted tree) of
https://github.com/jax-ml/jax-llm-examples, imported at run time from ``--source`` (nothing of it is
copied into this repository). Its MoE layer (``moe_block``) routes tokens top-k, sorts them by
expert inside a ``jax.shard_map`` and runs the three expert GEMMs (gate, up, down) as
``jax.lax.ragged_dot`` (``_moe_gmm``; the Pallas ``decode_ragged_dot`` kernel is TPU-only and off by
default). What the script sets to run it on CPU: a one-device mesh ``(1, 1, 1)`` with the model's
axis names ``x, y, z`` (explicit axes, ``jax.set_mesh``), ``dtype=float32``, and a tiny config: 2
MoE layers, 4 experts, top-2, widths 64 (heads 4 x 32, kv heads 2), vocab 128, batch 2 x 32 tokens
(so batch x seq x top_k = 128). Weights are the model's own random init (``Weights.init``).

The loss is next-token cross-entropy on random tokens (one-hot, since the model's explicit
shardings refuse ``take_along_axis`` on the sharded logits). Per recipe it prints the loss's
relative difference from float32's; the cosine of the flattened gradient (all parameters) with
float32's, for (b) ``jax.grad(recipes.apply(loss, r))`` and the max |difference| between that and
(c) ``recipes.apply(jax.value_and_grad(loss), r)``; and, to show the ragged_dot itself was quantized,
the relative error of the expert weights' gradient of layer 0's ``moe_block`` alone (same
input, router in high precision, so its only quantized GEMMs are the three ragged_dots).

The router's ``Sk,kj->Sj`` contraction (4 experts wide, no multiple of any block) is kept in high
precision (``high_precision_scopes``), as Transformer Engine and torchao leave MoE routers.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import scalify

RECIPES = ("mxfp8", "mxfp8_rceil", "float8_rowwise", "float8_tensorwise", "mxfp4", "nvfp4")
ROUTER_SCOPE = "Sk,kj->Sj"  # the router's einsum (jnp.einsum names its scope by the subscripts)
EXPERTS = ("we_gate", "we_up", "we_down")
# --split: MXFP8 on the MoE blocks alone (attention, its projections and the read-out kept out), and on
# everything but the grouped GEMMs (jnp.einsum and lax.ragged_dot name their scopes as below)
SPLIT = {
    "mxfp8, MoE blocks only": ("attn_pre_norm", "qkv_matmul", "attention", "projection", "btd,dv->btv"),
    "mxfp8, grouped GEMMs kept": ("jax.lax.ragged_dot",),
}


def import_model(source: Path):
    root = source / "qwen3" if (source / "qwen3").is_dir() else source
    if not (root / "qwen3_jax" / "model.py").is_file():
        raise SystemExit(f"{root}: no qwen3_jax/model.py; pass --source a checkout of jax-ml/jax-llm-examples")
    sys.path.insert(0, str(root))
    from qwen3_jax import model

    return model


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def cosine(a, b) -> float:
    a, b = flat(a), flat(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def rel_err(a, b) -> float:
    a, b = flat(a), flat(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def recipe(name: str):
    base = scalify.recipes.get_recipe(name)
    return base.replace(high_precision_scopes=(*base.high_precision_scopes, ROUTER_SCOPE))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a checkout of jax-ml/jax-llm-examples")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated built-in names")
    parser.add_argument("--split", action="store_true", help="also MXFP8 on the MoE blocks alone, and without them")
    args = parser.parse_args(argv)
    m = import_model(args.source.resolve())

    mesh = jax.make_mesh((1, 1, 1), ("x", "y", "z"), axis_types=(AxisType.Explicit,) * 3)
    cfg = m.Config(
        embed=64, q_heads=4, kv_heads=2, num_layers=2, head_dim=32, vocab_size=128, max_seq_len=64, causal=True,
        moe_ffw_size=64, moe_experts_per_tok=2, moe_num_experts=4, mlp_ffw_size=-1, mesh=mesh, dtype=jnp.float32,
    )  # fmt: skip
    weights = m.Weights.init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)

    def loss(w, tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits, _ = m.forward(x, jnp.ones_like(x), w, cfg)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(y, cfg.vocab_size), -1))

    layer0 = weights.layers[0].ffw
    moe_x = jax.random.normal(jax.random.key(2), (2, 32, cfg.embed), jnp.float32)

    def moe_loss(layer, x):  # layer 0's MoE block alone: a fixed cotangent on its output
        return jnp.sum(m.moe_block(x, layer, cfg) * jnp.cos(jnp.arange(x.size).reshape(x.shape)))

    with jax.set_mesh(mesh):
        start = time.time()
        l32, g32 = jax.jit(jax.value_and_grad(loss))(weights, tokens)
        moe_g32 = jax.jit(jax.grad(moe_loss))(layer0, moe_x)
        print(f"float32: loss {float(l32):.6f}, |grad| {np.linalg.norm(flat(g32)):.4g} ({time.time() - start:.1f}s)")
        header = (
            f"{'recipe':26s} {'loss rel diff':>13s} {'grad cos (b)':>12s} {'max|b-c|':>9s} "
            f"{'moe expert-grad rel err':>23s} {'max|dW_e - f32|':>15s}  time"
        )
        print(header + "\n" + "-" * len(header), flush=True)
        failed = 0
        runs = [(name, recipe(name)) for name in args.recipes.split(",")]
        if args.split:
            base = recipe("mxfp8")
            kept = base.high_precision_scopes
            runs += [(k, base.replace(high_precision_scopes=(*kept, *v))) for k, v in SPLIT.items()]
        for name, r in runs:
            start = time.time()
            try:
                lb, gb = jax.jit(jax.value_and_grad(scalify.recipes.apply(loss, r)))(weights, tokens)
                lc, gc = jax.jit(scalify.recipes.apply(jax.value_and_grad(loss), r))(weights, tokens)
                moe_g = jax.jit(jax.grad(scalify.recipes.apply(moe_loss, r)))(layer0, moe_x)
            except Exception as e:  # a recipe's exception is a finding: print it, go on with the others
                failed += 1
                print(f"{name:26s} FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc(limit=-6)
                continue
            experts = lambda g: [getattr(layer.ffw, k) for layer in g.layers for k in EXPERTS]
            moe_experts = lambda g: [getattr(g, k) for k in EXPERTS]
            print(
                f"{name:26s} {float(lb / l32 - 1):13.2e} {cosine(g32, gb):12.5f} "
                f"{np.abs(flat(gb) - flat(gc)).max():9.2e} "
                f"{rel_err(moe_experts(moe_g32), moe_experts(moe_g)):23.4f} "
                f"{np.abs(flat(experts(gb)) - flat(experts(g32))).max():15.3e}  {time.time() - start:.0f}s",
                flush=True,
            )
            failed += not (np.isfinite(flat(gb)).all() and float(lb) == float(lc))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
