"""penzai's transformer variants under the training recipes: the gradient's cosine with float32's.

The models are the third-party suite's (``tests/thirdparty/test_penzai.py``: penzai's Gemma 2
style decoder with checkpointed blocks, its GPT-NeoX with a layer stack), built by penzai's own
constructors; the check is KerasHub's (``run_keras_hub_models.check_recipe``): the loss and its
gradient under ``jax.value_and_grad(recipes.apply(loss, recipe))``, finite, with a gradient cosine
above the recipe's floor (0.95 for 8-bit elements, 0.8 for 4-bit), ``high`` equal to float32.

    python scripts/run_penzai_models.py                      # every built-in recipe, both models
    python scripts/run_penzai_models.py --weights-only --markdown
    python scripts/run_penzai_models.py --gemma2-ablation    # which Gemma 2 feature costs 4-bit
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_keras_hub_models import check_recipe, recipe  # noqa: E402
from test_penzai import CASES, penzai_case  # noqa: E402

RECIPES = ("high", "float8_tensorwise", "float8_rowwise", "mxfp8", "mxfp4", "nvfp4")

# The Gemma 2 style decoder with one of its features taken away (penzai config fields).
GEMMA2_VARIANTS = {
    "gemma2": {},
    "untied": {"tie_embedder_and_logits": False},
    "no_final_softcap": {"final_logit_softcap": None},
    "no_attn_softcap": {"attn_logits_soft_cap": None},
    "no_post_attn_norm": {"use_post_attn_norm": False},
    "no_post_ffw_norm": {"use_post_ffw_norm": False},
    "no_post_norms": {"use_post_attn_norm": False, "use_post_ffw_norm": False},
    "two_kv_heads": {"num_kv_heads": 2, "query_head_multiplier": 1},
    "swiglu": {"mlp_variant": "swiglu"},
}
# A recipe's GEMMs in its formats, the others in high precision.
GEMMS = {"all": (), "forward only": ("dgrad", "wgrad"), "backward only": ("fwd",)}


def gemma2_ablation(names) -> None:
    """The gradient cosine of each Gemma 2 variant under each recipe; for the decoder itself and
    without its post-norms, also with only the forward GEMMs, or only the backward ones, in the
    recipe's formats."""
    import dataclasses

    import jax
    from penzai.models.transformer.variants import llamalike_common as ll
    from test_penzai import checkpointed, gemma2_config

    for variant, fields in GEMMA2_VARIANTS.items():
        cfg = dataclasses.replace(gemma2_config(), **fields)
        case = penzai_case(variant, checkpointed(ll.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))))
        for name in names:
            for gemms, high in (GEMMS if variant in ("gemma2", "no_post_norms") else {"all": ()}).items():
                kept = {f"{g}_{side}": None for g in high for side in ("lhs", "rhs")}
                outcome, detail = check_recipe(case, recipe(name).replace(**kept))
                print(f"{variant:18s} {name:8s} {gemms:14s} {outcome:5s} {detail}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", help="names, comma-separated, or 'high' (default all; ablation mxfp4,nvfp4)")
    parser.add_argument("--weights-only", action="store_true", help="recipe.replace(weights_only=True)")
    parser.add_argument("--markdown", action="store_true", help="print a table for docs/examples.md")
    parser.add_argument(
        "--gemma2-ablation", action="store_true", help="the Gemma 2 decoder without each of its features, by GEMM"
    )
    args = parser.parse_args(argv)
    if args.gemma2_ablation:
        gemma2_ablation(args.recipes.split(",") if args.recipes else ["mxfp4", "nvfp4"])
        return 0
    names = (args.recipes or ",".join(RECIPES)).split(",")
    rows, failed = {}, 0
    for model in sorted(CASES):
        case = penzai_case(model, CASES[model]())
        for name in names:
            outcome, detail = check_recipe(case, recipe(name, weights_only=args.weights_only))
            failed += outcome == "FAIL"
            rows.setdefault(model, {})[name] = (outcome, detail)
            print(f"{model:28s} {name:18s} {outcome:8s} {detail}", flush=True)
    if args.markdown:
        print("\n| model | " + " | ".join(names) + " |\n| --- |" + " --- |" * len(names))
        for model, cells in rows.items():
            shown = [
                d.rsplit("cosine ", 1)[1].split()[0] if o == "ok" and "cosine" in d else o for o, d in cells.values()
            ]
            print(f"| {model} | " + " | ".join(shown) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
