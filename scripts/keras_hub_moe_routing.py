"""How much of a mixture of experts' gradient error under a recipe comes from tokens routed to other experts.

    python scripts/keras_hub_moe_routing.py                          # mixtral, qwen3_moe, gpt_oss; nvfp4, mxfp4, mxfp8
    python scripts/keras_hub_moe_routing.py --only mixtral --recipes nvfp4 \
        --high-precision-scopes sparse_feedforward_gate_dense,self_attention

A diagnostic for the MoE rows of ``run_keras_hub_models.py --recipes`` (same models, same 32 tokens,
same ``--source``). Per (model, recipe), with the routers' scopes kept in high precision, it prints:

* the fraction of tokens, per MoE layer, whose top-k set of experts under the recipe differs from
  float32's;
* the cosine of the recipe's gradient (all weights) with float32's, as the main script measures it;
* the same cosine with the routing *pinned* to float32's: each router's top-k indices are float32's
  and its top-k weights are the recipe's router probabilities at those indices.

Pinning is done by wrapping ``keras.ops.top_k`` for the duration of the run (the only call of it in
these models is the routers'); KerasHub's model code is not changed. The gap between the two
cosines is the part of the error due to rerouted tokens; what remains is the GEMMs' rounding.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from run_flax_examples import pop_option
from run_keras_hub_models import RECIPE_SEQ, _flat, build, fetch_keras_hub, import_keras_hub, recipe

MOE_MODELS = ("mixtral", "qwen3_moe", "gpt_oss")
# The routers' scopes in KerasHub 0.32 (Mixtral and Qwen3-MoE name theirs alike).
ROUTER_SCOPES = ("sparse_feedforward_gate_dense", "router")


@contextlib.contextmanager
def routed(record: list | None = None, pinned: list | None = None):
    """Within the block, ``keras.ops.top_k`` appends its indices to ``record`` and, when ``pinned``
    is given, returns ``pinned``'s next indices (and ``x`` gathered there) instead of its own."""
    import keras

    top_k = keras.ops.top_k
    pinned = None if pinned is None else list(pinned)

    def wrapped(x, k, sorted=True):
        values, indices = top_k(x, k, sorted=sorted)
        if pinned is not None:
            indices = pinned.pop(0)
            values = jnp.take_along_axis(x, indices, axis=-1)
        if record is not None:
            record.append(indices)
        return values, indices

    keras.ops.top_k = wrapped
    try:
        yield
    finally:
        keras.ops.top_k = top_k


def cosine(a, b) -> float:
    """Cosine of two flattened gradient trees."""
    a, b = _flat(a), _flat(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def rerouted(got, expected) -> list[float]:
    """Per MoE layer, the fraction of tokens whose set of top-k experts differs."""
    return [float(np.mean(np.any(np.sort(g, -1) != np.sort(e, -1), -1))) for g, e in zip(got, expected, strict=True)]


def measure(case, rec) -> dict:
    """Rerouted fractions, gradient cosine, and gradient cosine with float32's routing, of ``rec`` on ``case``."""
    from scalify import recipes

    def loss_and_routes(params, batch):
        record = []
        with routed(record):
            return case.loss(params, batch), record

    (_, ref_routes), ref_grad = jax.value_and_grad(loss_and_routes, has_aux=True)(case.params, case.batch)
    (_, routes), grad = jax.value_and_grad(recipes.apply(loss_and_routes, rec), has_aux=True)(case.params, case.batch)

    def pinned_loss(params, batch):
        with routed(pinned=ref_routes):
            return case.loss(params, batch)

    pinned_grad = jax.grad(recipes.apply(pinned_loss, rec))(case.params, case.batch)
    return dict(
        rerouted=rerouted([np.asarray(r) for r in routes], [np.asarray(r) for r in ref_routes]),
        cosine=cosine(grad, ref_grad),
        pinned=cosine(pinned_grad, ref_grad),
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    source = pop_option(argv, "--source", "an unpacked keras-hub wheel or a git clone")
    only = pop_option(argv, "--only", f"comma-separated models among {', '.join(MOE_MODELS)}")
    names = only.split(",") if only else list(MOE_MODELS)
    recipe_names = pop_option(argv, "--recipes", "comma-separated built-in recipe names") or "nvfp4,mxfp4,mxfp8"
    recipe_names = recipe_names.split(",")
    extra = pop_option(argv, "--high-precision-scopes", "comma-separated jax.named_scope names")
    scopes = ROUTER_SCOPES + (tuple(extra.split(",")) if extra else ())
    from scalify import recipes

    if argv or any(n not in MOE_MODELS for n in names) or any(r not in recipes.BUILTINS for r in recipe_names):
        raise SystemExit(
            f"usage: {__doc__.splitlines()[2].strip()}\n"
            f"models: {', '.join(MOE_MODELS)}; recipes: {', '.join(sorted(recipes.BUILTINS))}"
        )
    with tempfile.TemporaryDirectory(prefix="keras_hub_") as tmp:
        hub = import_keras_hub(Path(source).resolve() if source else fetch_keras_hub(Path(tmp)))
        print(f"keras-hub {hub.__version__}; kept in high precision: {', '.join(scopes)}")
        print("| model | recipe | tokens rerouted per MoE layer | gradient cosine | with float32's routing |")
        print("| --- | --- | --- | --- | --- |")
        for name in names:
            case = build(hub, name, seq=RECIPE_SEQ)
            for r in recipe_names:
                m = measure(case, recipe(r, scopes))
                fractions = ", ".join(f"{f:.0%}" for f in m["rerouted"])
                print(f"| {name} | {r} | {fractions} | {m['cosine']:.3f} | {m['pinned']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
