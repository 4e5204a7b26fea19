"""Command line: ``python -m examples.train --model mlp|transformer --format NAME ...``."""

from __future__ import annotations

import argparse
import json
import math
import sys

from examples.train import loop
from scalify import recipes


def _parser():
    ap = argparse.ArgumentParser(
        prog="python -m examples.train",
        description="Train a small model (digits MLP or char-level transformer) in a number format.",
    )
    ap.add_argument("--model", choices=loop.MODELS, default="mlp")
    ap.add_argument(
        "--format",
        default="fp32",
        help="fp32, bf16, fp16 (plain), fp16-scalify, or a registered qformats format: "
        + ", ".join(loop.list_modes()[4:]),
    )
    ap.add_argument(
        "--recipe",
        default=None,
        help="train the unchanged float32 model under a scalify.recipes recipe instead of a format: "
        + ", ".join(sorted(recipes.BUILTINS)),
    )
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: 300 mlp, 200 transformer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-scale", type=float, default=1.0, help="multiplies the initial weights")
    ap.add_argument("--json", action="store_true", help="print the final metrics as one JSON object")
    ap.add_argument("--plot", metavar="FILE.png", help="save the training-loss curve(s) (needs matplotlib)")
    ap.add_argument("--sweep", action="store_true", help="train in every format and print a markdown table")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def plot_histories(results, path, title=None):
    """Save training-loss curves (one per result, smoothed) to ``path``; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: `pip install matplotlib` or `pip install 'qformats[train]'`.") from e
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        h = [v if math.isfinite(v) else float("nan") for v in r.history]
        k = max(1, len(h) // 50)
        sm = [sum(h[max(0, i - k + 1) : i + 1]) / len(h[max(0, i - k + 1) : i + 1]) for i in range(len(h))]
        ax.plot(range(1, len(sm) + 1), sm, label=r.format, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (moving average)")
    ax.set_title(title or f"{results[0].model}: training loss")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(results) -> str:
    has_acc = any(r.val_accuracy is not None for r in results)
    head = "| format | train loss | val loss |" + (" val accuracy |" if has_acc else "") + " mechanism |"
    sep = "|---|---|---|" + ("---|" if has_acc else "") + "---|"
    rows = [head, sep]
    for r in results:
        row = f"| {r.format} | {r.train_loss:.4f} | {r.val_loss:.4f} |"
        if has_acc:
            row += f" {r.val_accuracy:.4f} |" if r.val_accuracy is not None else " - |"
        rows.append(row + f" {r.mechanism} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    steps = args.steps if args.steps is not None else (300 if args.model == "mlp" else 200)
    if args.plot:  # fail before training when matplotlib is missing
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib (`pip install matplotlib`).", file=sys.stderr)
            return 2
    formats = loop.list_modes() if args.sweep else [args.format]
    if args.recipe is not None:
        if args.sweep:
            raise SystemExit("--recipe trains one recipe; leave out --sweep (or loop over recipes yourself).")
        try:
            recipes.get_recipe(args.recipe)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        formats = [loop.recipe_mode(args.recipe)]
    results, failures = [], []
    try:
        for f in formats:
            loop.get_mode(f)  # validate names first
        for f in formats:
            try:
                results.append(
                    loop.train(args.model, f, steps, args.seed, args.init_scale, progress=not args.no_progress)
                )
            except ValueError as e:  # e.g. a format whose block size does not fit the model
                if not args.sweep:
                    raise
                failures.append((f, str(e).splitlines()[0]))
                print(f"warning: {f} failed: {e}", file=sys.stderr)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.sweep:
        if args.json:
            print(json.dumps([r.metrics() for r in results] + [{"format": f, "error": m} for f, m in failures]))
        else:
            print(markdown_table(results))
            for f, m in failures:
                print(f"| {f} | error: {m} |")
    elif args.json:
        print(json.dumps(results[0].metrics()))
    else:
        r = results[0]
        acc = f"  val_accuracy {r.val_accuracy:.4f}" if r.val_accuracy is not None else ""
        print(
            f"{r.model} [{r.format}] steps {r.steps}: train_loss {r.train_loss:.4f}  val_loss {r.val_loss:.4f}{acc}"
            f"  ({r.time_s:.1f}s)\n  mechanism: {r.mechanism}"
        )
    if args.plot and results:
        plot_histories(results, args.plot)
        print(f"saved {args.plot}", file=sys.stderr)
    return 0
