"""penzai's transformer variants under the training recipes: the gradient's cosine with float32's.

The models are the third-party suite's (``tests/thirdparty/test_penzai.py``: penzai's Gemma 2
style decoder with checkpointed blocks, its GPT-NeoX with a layer stack), built by penzai's own
constructors; the check is KerasHub's (``run_keras_hub_models.check_recipe``): the loss and its
gradient under ``jax.value_and_grad(recipes.apply(loss, recipe))``, finite, with a gradient cosine
above the recipe's floor (0.95 for 8-bit elements, 0.8 for 4-bit), ``high`` equal to float32.

    python scripts/run_penzai_models.py                      # every built-in recipe, both models
    python scripts/run_penzai_models.py --weights-only --markdown
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated built-in names, or 'high'")
    parser.add_argument("--weights-only", action="store_true", help="recipe.replace(weights_only=True)")
    parser.add_argument("--markdown", action="store_true", help="print a table for docs/examples.md")
    args = parser.parse_args(argv)
    names = args.recipes.split(",")
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
