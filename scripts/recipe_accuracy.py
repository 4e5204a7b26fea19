"""Accuracy of the low-precision training recipes (``scalify.recipes``) on the character transformer.

    python scripts/recipe_accuracy.py [--steps 500] [--seeds 0,1,2] [--json /tmp/recipe_accuracy.json]
    python scripts/recipe_accuracy.py --ablation-seeds 0,1,2  # the NVFP4 ablations on three seeds
    python scripts/recipe_accuracy.py --render-only          # rewrite the doc from the JSON, no training
    python scripts/recipe_accuracy.py --blockwise            # the blockwise recipes, on a wider transformer

Trains ``examples.train``'s transformer in float32 (the baseline) and under every built-in recipe
(``recipes.apply(loss, recipe)`` on the unchanged float32 model, as ``python -m examples.train --recipe NAME``),
then three NVFP4 ablations (on ``--ablation-seeds``, default the first seed): no random Hadamard transform
on the weight-gradient GEMM, no stochastic rounding, neither. Runs go in order of importance (float32 seed 0,
every recipe seed 0, then the next seeds, then the ablations) and each finished run is appended to the JSON
file at once, so a cut run loses nothing; a rerun with the same JSON skips the runs already there. Every
number written to ``docs/recipes_accuracy.md`` (and the plot ``docs/recipes_transformer_loss.png``, needs
matplotlib) comes from the runs in that JSON file. Run it under ``nice -n 19`` on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/recipe_accuracy.py` from a checkout
    sys.path.insert(0, str(ROOT))
DEFAULT_JSON = "/tmp/recipe_accuracy.json"
DOC = ROOT / "docs" / "recipes_accuracy.md"
PLOT = ROOT / "docs" / "recipes_transformer_loss.png"
MODEL = "transformer"
TOLERANCE_PCT = 2.0
ABLATION_NAMES = {
    "nvfp4_no_hadamard": "NVFP4.replace(wgrad_hadamard=None)",
    "nvfp4_no_sr": "NVFP4.replace(stochastic_rounding=())",
    "nvfp4_no_hadamard_no_sr": "NVFP4.replace(wgrad_hadamard=None, stochastic_rounding=())",
}


# The blockwise recipes quantize in blocks of 128 along every GEMM's summed axis, which the transformer's
# d_model of 64 does not hold. ``--blockwise`` trains them on the same transformer made wider (WIDE),
# with weights_only=True: attention's products of two activations (head dimension 64) stay in float32,
# as torchao's and Transformer Engine's linear-layer swaps leave them. Float32 runs on that model too.
WIDE = {"d_model": 128, "d_ff": 512}
WIDE_RECIPES = ("float8_blockwise", "float8_blockwise_pow2")
BLOCKWISE_JSON = "/tmp/recipe_accuracy_blockwise.json"
BLOCKWISE_DOC = ROOT / "docs" / "recipes_accuracy_blockwise.md"
BLOCKWISE_PLOT = ROOT / "docs" / "recipes_blockwise_loss.png"


def _linear_only():
    from scalify import recipes

    return {f"{n}_linear": recipes.BUILTINS[n].replace(name=f"{n}_linear", weights_only=True) for n in WIDE_RECIPES}


def _descriptions():
    """How each extra (non-built-in) recipe name is built, for the mechanism column and the docs."""
    linear = {f"{n}_linear": f"{n.upper()}.replace(weights_only=True)" for n in WIDE_RECIPES}
    return {**ABLATION_NAMES, **linear}


def _ablations():
    from scalify import recipes

    nv = recipes.NVFP4
    return {
        "nvfp4_no_hadamard": nv.replace(name="nvfp4_no_hadamard", wgrad_hadamard=None),
        "nvfp4_no_sr": nv.replace(name="nvfp4_no_sr", stochastic_rounding=()),
        "nvfp4_no_hadamard_no_sr": nv.replace(
            name="nvfp4_no_hadamard_no_sr", wgrad_hadamard=None, stochastic_rounding=()
        ),
    }


def _install_ablation_modes():
    """Let ``examples.train`` train the ablation recipes, for this process only.

    ``loop.get_mode`` resolves ``recipe:NAME`` through the built-in recipes; the wrapper answers the
    ablation names first (same Mode construction as a built-in recipe) and defers to the original for
    everything else. Nothing is registered in the library.
    """
    from examples.train import loop

    if getattr(loop.get_mode, "_recipe_accuracy", False):
        return
    import jax.numpy as jnp

    extra = {**_ablations(), **_linear_only()}
    descriptions = _descriptions()
    original = loop.get_mode

    def get_mode(name):
        if name.startswith(loop.RECIPE_PREFIX) and name[len(loop.RECIPE_PREFIX) :] in extra:
            recipe = extra[name[len(loop.RECIPE_PREFIX) :]]
            mech = f"recipes.apply(loss, {descriptions[recipe.name]}) on the unchanged float32 model"
            return loop.Mode(name, jnp.float32, mech, quantize=recipe)
        return original(name)

    get_mode._recipe_accuracy = True
    loop.get_mode = get_mode


def _plan(seeds, ablation_seeds, only=None, blockwise=False):
    from scalify import recipes

    if blockwise:
        return [(n, s) for s in seeds for n in ("fp32", *_linear_only())]
    names = [n for n in sorted(recipes.BUILTINS) if n not in WIDE_RECIPES]
    if only:
        names = [n for n in names if n in only]
    plan = []
    for s in seeds:
        plan.append(("fp32", s))
        plan.extend((n, s) for n in names)
    for s in ablation_seeds:
        plan.extend((n, s) for n in ABLATION_NAMES)
    return plan


def _key(name, seed, steps):
    return f"{name}|seed={seed}|steps={steps}"


def _load(path):
    p = Path(path)
    if p.exists():
        return json.loads(p.read_text())
    return {"meta": {}, "runs": {}}


def _save(path, data):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _machine():
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = jax.devices()[0]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "backend": f"{dev.platform} ({dev.device_kind})",
        "python": platform.python_version(),
    }


def run(args):
    import attrs

    from examples.train import loop, models, train

    _install_ablation_modes()
    data = _load(args.json)
    meta = data["meta"]
    meta.setdefault("machine", _machine())
    meta.setdefault("hparams", dict(loop.GPT_HPARAMS))
    hparams = {"gpt": WIDE} if args.blockwise else None
    meta.setdefault("gpt", attrs.asdict(models.GPTConfig(**(hparams or {}).get("gpt", {}))))
    meta.setdefault("sessions", []).append({"start": _now()})
    _save(args.json, data)
    plan = _plan(args.seeds, args.ablation_seeds, args.only, args.blockwise)
    for name, seed in plan:
        key = _key(name, seed, args.steps)
        if key in data["runs"]:
            continue
        if args.stop_at and datetime.datetime.now(datetime.UTC) >= args.stop_at:
            print(f"stop-at reached; not starting {key}", file=sys.stderr)
            break
        fmt = "fp32" if name == "fp32" else loop.recipe_mode(name)
        t0 = time.perf_counter()
        r = train(model=MODEL, fmt=fmt, steps=args.steps, seed=seed, hparams=hparams)
        wall = time.perf_counter() - t0
        rec = r.metrics()
        rec.update(name=name, wall_s=round(wall, 2), history=r.history, finished=_now())
        data["runs"][key] = rec
        meta["sessions"][-1]["end"] = _now()
        _save(args.json, data)
        print(f"{key}: val {r.val_loss:.4f} train {r.train_loss:.4f} ({wall:.1f} s)", flush=True)
    meta["sessions"][-1]["end"] = _now()
    _save(args.json, data)
    return data


def _now():
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _stats(vals):
    v = np.asarray([x for x in vals if math.isfinite(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan"), 0
    std = float(v.std(ddof=1)) if v.size > 1 else float("nan")
    return float(v.mean()), std, int(v.size)


def _fmt_ms(mean, std, n, digits=4):
    if n == 0:
        return "nan"
    if n == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _runs_by_name(data, steps):
    out = {}
    for rec in data["runs"].values():
        if rec["steps"] == steps:
            out.setdefault(rec["name"], []).append(rec)
    for recs in out.values():
        recs.sort(key=lambda r: r["seed"])
    return out


def _smooth(h, k):
    h = np.asarray([v if math.isfinite(v) else np.nan for v in h], dtype=float)
    return np.array([np.nanmean(h[max(0, i - k + 1) : i + 1]) for i in range(len(h))])


def plot(by, path, steps, names):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot", file=sys.stderr)
        return False
    names = ["fp32", *[n for n in names if n in by]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    k = max(1, steps // 25)
    start = steps // 4
    tails = []
    for name in names:
        s0 = min(by[name], key=lambda r: r["seed"])
        sm = _smooth(s0["history"], k)
        x = np.arange(1, len(sm) + 1)
        style = {"lw": 2.2, "color": "black"} if name == "fp32" else {"lw": 1.2}
        label = f"{name} (seed {s0['seed']})"
        axes[0].plot(x, sm, label=label, **style)
        axes[1].plot(x[start:], sm[start:], label=label, **style)
        tails.append(sm[start:])
    tail = np.concatenate(tails)
    tail = tail[np.isfinite(tail)]
    ref = tails[0][np.isfinite(tails[0])]  # fp32
    if tail.size and ref.size:  # zoom on float32's range; curves far above it leave the panel
        axes[1].set_ylim(tail.min() - 0.02, ref.max() * 1.1)
    axes[0].set_title(f"{MODEL}: training loss (moving average over {k} steps)")
    axes[1].set_title(f"from step {start + 1}, zoomed on float32's range")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _results_table(by, names, fp32_ref, f_mean, f_sd, f_n):
    """The results table (float32, then ``names``) and the sentence that sums it up, as lines."""
    lines = [
        "| recipe | seeds | val loss | train loss (last 10 steps) | gap to fp32 | within 2% | s / run (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    gaps = {}
    for name in ["fp32", *names]:
        recs = by.get(name, [])
        if not recs:
            lines.append(f"| {name} | 0 | not run | | | | |")
            continue
        m, s, n = _stats([r["val_loss"] for r in recs])
        tm, ts, tn = _stats([r["train_loss"] for r in recs])
        secs = np.mean([r["wall_s"] for r in recs])
        seed_list = ",".join(str(r["seed"]) for r in recs)
        if name == "fp32":
            gap, within = "—", "—"
        else:
            ref = fp32_ref(recs)
            g = 100.0 * (m - ref) / ref
            gaps[name] = g
            gap, within = f"{g:+.2f}%", ("yes" if g <= TOLERANCE_PCT else "**no**")
        lines.append(
            f"| {name} | {seed_list} | {_fmt_ms(m, s, n)} | {_fmt_ms(tm, ts, tn)} | {gap} | {within} | {secs:.0f} |"
        )
    ok = [f"{n} ({g:+.2f}%)" for n, g in gaps.items() if g <= TOLERANCE_PCT]
    bad = [f"{n} ({g:+.2f}%)" for n, g in gaps.items() if g > TOLERANCE_PCT]
    return [
        *lines,
        "",
        f"Within {TOLERANCE_PCT:g}% of float32: {', '.join(ok) or 'none'}. "
        f"Not within: {', '.join(bad) or 'none'}. "
        f"Float32's own seed-to-seed standard deviation is {100 * f_sd / f_mean:.2f}% of its mean "
        f"({f_n} seeds), the scale on which gaps below it are noise.",
    ]


def render(data, steps, doc_path, plot_path, seeds, ablation_seeds, blockwise=False):
    from scalify import recipes

    by = _runs_by_name(data, steps)
    if "fp32" not in by:
        raise SystemExit(f"no fp32 run with --steps {steps} in the JSON file; nothing to compare against")
    meta = data["meta"]
    f_mean, f_sd, f_n = _stats([r["val_loss"] for r in by["fp32"]])
    fp32_by_seed = {r["seed"]: r["val_loss"] for r in by["fp32"]}

    def fp32_ref(recs):
        """float32's mean over the seeds the recipe has (all of float32's when a run was cut)."""
        common = [fp32_by_seed[r["seed"]] for r in recs if r["seed"] in fp32_by_seed]
        return float(np.mean(common)) if common else f_mean

    desc = _descriptions()
    if blockwise:
        names = list(_linear_only())
        title = [
            "# Accuracy of the blockwise float8 recipes",
            "",
            "Final validation loss of `examples.train`'s character transformer made wider (d_model 128, d_ff 512: "
            "the blockwise recipes block every GEMM's summed axis by 128, which the default d_model of 64 does not "
            "hold), trained in float32 and under "
            + " and ".join(f"`{desc[n]}`" for n in names)
            + " (`recipes.apply(loss, recipe)` on the unchanged float32 model). `weights_only=True` keeps "
            "attention's products of two activations (head dimension 64) in float32, as torchao's and Transformer "
            "Engine's linear-layer swaps leave them; every other GEMM, the LM head included, follows the recipe. "
            "Produced by `python scripts/recipe_accuracy.py --blockwise`; every number here comes from its runs. "
            "The other recipes, on the default model: [recipes_accuracy.md](recipes_accuracy.md).",
        ]
    else:
        names = [n for n in sorted(recipes.BUILTINS) if n not in WIDE_RECIPES]
        title = [
            "# Accuracy of the training recipes",
            "",
            "Final validation loss of `examples.train`'s character transformer trained in float32 and under each "
            "built-in `scalify.recipes` recipe (`recipes.apply(loss, recipe)` on the unchanged float32 model, as "
            f"`python -m examples.train --model transformer --recipe NAME --steps {steps}`). Produced by "
            "`python scripts/recipe_accuracy.py`; every number here comes from its runs.",
        ]
    lines = [
        *title,
        "",
        f"## Results ({steps} steps)",
        "",
        "Validation loss: mean ± sample standard deviation over the seeds. Gap: the recipe's mean relative to "
        f"float32's mean over the same seeds. Within {TOLERANCE_PCT:g}%: the gap is at most +{TOLERANCE_PCT:g}% "
        "(a recipe that ends below float32 counts as within).",
        "",
    ]
    lines += _results_table(by, names, fp32_ref, f_mean, f_sd, f_n)
    if not blockwise:
        lines += [
            "",
            f"The blockwise recipes ({', '.join(WIDE_RECIPES)}) block every GEMM by 128, which this model's d_model "
            "of 64 does not hold: they are measured on the same transformer at d_model 128 in "
            f"[{BLOCKWISE_DOC.name}]({BLOCKWISE_DOC.name}).",
        ]
    planned = _plan(seeds, ablation_seeds, blockwise=blockwise)
    done = {(r["name"], r["seed"]) for recs in by.values() for r in recs}
    missing = [(n, s) for n, s in planned if (n, s) not in done]

    lines += [] if blockwise else ["", "## NVFP4 ablations", ""]
    fp_seed = {r["seed"]: r["val_loss"] for r in by["fp32"]}
    nv_seed = {r["seed"]: r["val_loss"] for r in by.get("nvfp4", [])}
    abl = {n: {r["seed"]: r["val_loss"] for r in by.get(n, [])} for n in ABLATION_NAMES}
    if blockwise:
        pass
    elif not any(abl.values()):
        lines.append("Not run (the deadline came first).")
    else:
        lines += [
            "Each row on the seeds listed; the gap and the change are taken over the same seeds, so they compare "
            "runs with the same initialisation and batches that differ only in the recipe. Change vs full NVFP4: "
            "mean of the per-seed relative differences of the validation loss (the per-seed values in brackets).",
            "",
            "| recipe | seeds | val loss | gap to fp32 (same seeds) | change vs full NVFP4 (same seeds) |",
            "|---|---|---|---|---|",
        ]
        rows = [("`NVFP4` (Hadamard + stochastic rounding)", nv_seed, False)]
        rows += [(f"`{desc}`", abl[n], True) for n, desc in ABLATION_NAMES.items()]
        for label, vals, compare in rows:
            seeds_here = sorted(vals)
            if not seeds_here:
                lines.append(f"| {label} | — | not run | | |")
                continue
            m, sd, n = _stats([vals[k] for k in seeds_here])
            common = [k for k in seeds_here if k in fp_seed]
            ref = float(np.mean([fp_seed[k] for k in common])) if common else float("nan")
            gap = f"{100 * (m - ref) / ref:+.2f}%" if common else "—"
            change = "—"
            if compare:
                both = [k for k in seeds_here if k in nv_seed]
                diffs = [100 * (vals[k] - nv_seed[k]) / nv_seed[k] for k in both]
                if diffs:
                    change = f"{np.mean(diffs):+.2f}%"
                    if len(diffs) > 1:
                        change += " (" + ", ".join(f"{d:+.2f}%" for d in diffs) + ")"
            seed_list = ",".join(str(k) for k in seeds_here)
            lines.append(f"| {label} | {seed_list} | {_fmt_ms(m, sd, n)} | {gap} | {change} |")
        _, nv_sd, nv_n = _stats(list(nv_seed.values()))
        if nv_n > 1:
            lines += [
                "",
                f"For scale: the seed-to-seed standard deviation of full NVFP4's validation loss is {nv_sd:.4f} "
                f"({100 * nv_sd / f_mean:.2f}% of float32's mean), from {nv_n} seeds.",
            ]

    if missing:
        lines += ["", "Not run (cut by the deadline): " + ", ".join(f"{n} seed {s}" for n, s in missing) + "."]

    hp = meta.get("hparams", {})
    gpt = meta.get("gpt", {})
    mach = meta.get("machine", {})
    all_runs = [r for recs in by.values() for r in recs]
    total = sum(r["wall_s"] for r in all_runs)
    sessions = meta.get("sessions", [])
    dates = sorted({s["start"][:10] for s in sessions if "start" in s})
    lines += [
        "",
        "## Setup",
        "",
        "* Model: `examples.train`'s character transformer, "
        f"`GPTConfig({', '.join(f'{k}={v}' for k, v in gpt.items())})`"
        " (pre-LayerNorm decoder), trained on the source of 12 Python standard-library modules as ASCII "
        "characters (`examples.train.data.load_text`, last 10% held out); validation loss: "
        f"{hp.get('eval_batches', '?')} batches of held-out windows.",
        f"* Training: {steps} steps, batch size {hp.get('batch_size', '?')}, {hp.get('optimizer', '?')} with "
        f"learning rate {hp.get('lr', '?')}; float32 master weights and optimizer state in every row (a recipe "
        "only quantizes the GEMM operands: forward, input-gradient and weight-gradient GEMMs).",
        f"* Seeds: {', '.join(str(s) for s in seeds)} (initialisation and batch order). The recipes' own "
        "stochastic-rounding seed is the built-in `Recipe.seed=0` in every run."
        + ("" if blockwise else f" NVFP4 ablations: seeds {', '.join(str(x) for x in ablation_seeds) or 'none'}."),
        f"* Machine: {mach.get('cpu', '?')}, {mach.get('cores', '?')} cores shared with other jobs (runs under "
        f"`nice -n 19`, one at a time), JAX {mach.get('jax', '?')} on {mach.get('backend', '?')}, "
        f"Python {mach.get('python', '?')}.",
        f"* Date: {', '.join(dates) or '?'} (UTC). Wall time: {total / 60:.1f} min for {len(all_runs)} runs "
        "(the first seed's run of each recipe includes its compilation; the machine was shared, "
        "so times are indicative only).",
        "",
    ]
    if plot_path is not None and plot(by, plot_path, steps, names):
        lines += [
            f"![training loss]({Path(plot_path).name})",
            "",
            "Training loss of the first seed per recipe (moving average), full run and zoom from step "
            f"{steps // 4 + 1} on float32's range (a curve far above float32 leaves the right panel).",
            "",
        ]
    Path(doc_path).write_text("\n".join(lines))
    print(f"wrote {doc_path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--json", default=None, help=f"results file, appended run by run (default {DEFAULT_JSON})")
    ap.add_argument("--doc", default=None, help=f"default {DOC.relative_to(ROOT)}")
    ap.add_argument("--plot", default=None, help=f"default {PLOT.relative_to(ROOT)}")
    ap.add_argument(
        "--blockwise",
        action="store_true",
        help=f"the blockwise recipes on the wider transformer (default JSON {BLOCKWISE_JSON}, "
        f"doc {BLOCKWISE_DOC.relative_to(ROOT)})",
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--ablation-seeds", default=None, help="seeds of the NVFP4 ablations (default: the first seed)")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated recipe names (default: all built-ins)")
    ap.add_argument("--stop-at", default=None, help="UTC time HH:MM after which no new run starts")
    ap.add_argument("--render-only", action="store_true", help="write the doc from the JSON file, no training")
    args = ap.parse_args(argv)
    args.json = args.json or (BLOCKWISE_JSON if args.blockwise else DEFAULT_JSON)
    args.doc = args.doc or str(BLOCKWISE_DOC if args.blockwise else DOC)
    args.plot = args.plot or str(BLOCKWISE_PLOT if args.blockwise else PLOT)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.no_ablations or args.blockwise:
        args.ablation_seeds = []
    elif args.ablation_seeds is None:
        args.ablation_seeds = args.seeds[:1]
    else:
        args.ablation_seeds = [int(x) for x in args.ablation_seeds.split(",") if x.strip()]
    args.only = set(args.only.split(",")) if args.only else None
    if args.stop_at:
        hh, mm = (int(x) for x in args.stop_at.split(":"))
        now = datetime.datetime.now(datetime.UTC)
        args.stop_at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    data = _load(args.json) if args.render_only else run(args)
    plot_path = None if args.no_plot else args.plot
    render(data, args.steps, args.doc, plot_path, args.seeds, args.ablation_seeds, args.blockwise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
