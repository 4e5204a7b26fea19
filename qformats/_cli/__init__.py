"""``python -m qformats``: list the formats, or compare them on your tensors.

Exit status: 0 when everything asked for was analysed; 2 when there was an input problem (missing,
unreadable or integer-only file, unknown tensor or format name, a format that does not fit a
tensor's shape, NaN/Inf in a tensor, a missing optional package): every problem is printed to
stderr with its fix, and everything else is still analysed and printed.

The analysis itself is :mod:`qformats._cli._engine` (re-exported as ``qformats.compare``); this
module imports it, and with it jax, only inside the commands, so that parsing (``--help``, argument
errors) needs the standard library only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys

EXIT_INPUT = 2
# _engine's DEFAULT_MAX_FLUSHED / DEFAULT_MAX_SATURATED in percent (without importing jax for `--help`)
DEFAULT_MAX_FLUSHED_PCT = 5.0
DEFAULT_MAX_SATURATED_PCT = 1.0


def _fmt_num(v, spec=".4g"):
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "exact" if v > 0 else "-inf"
    return format(v, spec)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _cmd_list(args) -> int:
    import qformats as qf

    rows = [qf.get_format(n).describe() for n in qf.list_formats()]
    if args.json:
        from qformats._cli._engine import _json_number

        print(json.dumps(_json_number(rows), indent=2, allow_nan=False))
        return 0
    header = ["name", "element", "bits/elem", "max", "smallest normal", "layout"]
    print(_table([[_fmt_num(r[h]) if isinstance(r[h], float) else r[h] for h in header] for r in rows], header))
    return 0


def _print_compare(result, tensors) -> None:
    desc = {t.name: t for t in tensors}
    header = ["format", "bits/elem", "SQNR dB", "max rel err", "saturated", "flushed", "quantize ms", ""]
    by_tensor: dict[str, list[dict]] = {}
    for r in result.records:
        by_tensor.setdefault(r["tensor"], []).append(r)
    for name, recs in by_tensor.items():
        r0 = recs[0]
        t = desc.get(name)
        what = t.description if t is not None and t.description else r0["source"]
        print(f"{name}  {tuple(r0['shape'])} {r0['dtype']}  ({what})")
        rows = []
        for r in recs:
            if not r["applicable"]:
                rows.append([r["format"], "n/a", "-", "-", "-", "-", "-", "does not fit (see below)"])
                continue
            mark = "<- recommended" if r["recommended"] else ""
            rows.append(
                [
                    r["format"],
                    f"{r['bits_per_element']:.3f}",
                    "overflow" if r["overflow_fraction"] else _fmt_num(r["sqnr_db"], ".2f"),
                    _fmt_num(r["max_rel_error"], ".3g"),
                    f"{100 * r['saturated_fraction']:.3g}%",
                    f"{100 * r['flushed_fraction']:.3g}%",
                    f"{1e3 * r['quantize_seconds']:.3f}",
                    mark,
                ]
            )
        print(_table(rows, header))
        for r in recs:
            # the SQNR is in the table; say why a format is out when it is (also) for another reason
            if r["applicable"] and (
                r["overflow_fraction"] > 0
                or r["flushed_fraction"] > result.max_flushed
                or r["saturated_fraction"] > result.max_saturated
            ):
                print(f"  {r['format']}: not recommended: {r['rejected_because']}.")
        rec = result.recommendations.get(name)
        if rec is None:
            print(
                f"  no format reaches {result.min_sqnr:g} dB SQNR within the flush/saturation limits on {name}; "
                "lower --min-sqnr, raise --max-flushed / --max-saturated, or add wider formats."
            )
        print()
    limits = (
        f"reaches {result.min_sqnr:g} dB SQNR, flushing at most {100 * result.max_flushed:g}% and saturating at "
        f"most {100 * result.max_saturated:g}% of the values,"
    )
    if result.overall:
        print(f"overall: {result.overall} is the smallest format that {limits} on every tensor.")
    elif by_tensor:
        print(f"overall: no single format {limits} on every tensor; use the per-tensor picks.")


def _plot(result, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    by_tensor: dict[str, list[dict]] = {}
    for r in result.records:
        if r["applicable"]:
            by_tensor.setdefault(r["tensor"], []).append(r)
    finite = [r["sqnr_db"] for rs in by_tensor.values() for r in rs if math.isfinite(r["sqnr_db"])]
    top = max(finite, default=result.min_sqnr) + 10
    for name, rs in by_tensor.items():
        rs = sorted(rs, key=lambda r: r["bits_per_element"])
        xs = [r["bits_per_element"] for r in rs]
        ys = [r["sqnr_db"] if math.isfinite(r["sqnr_db"]) else top for r in rs]
        ax.plot(xs, ys, "o-", label=name)
        for r, xv, yv in zip(rs, xs, ys, strict=True):
            ax.annotate(r["format"], (xv, yv), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(result.min_sqnr, color="gray", ls="--", lw=1, label=f"min SQNR {result.min_sqnr:g} dB")
    ax.set_xlabel("bits per element (scales included)")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title("qformats compare")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cmd_compare(args) -> int:
    problems: list[str] = []
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib, which is not installed: pip install matplotlib", file=sys.stderr)
            return EXIT_INPUT
    for mod in args.imports:
        try:
            importlib.import_module(mod)
        except Exception as e:
            problems.append(f"--import {mod}: could not import it ({e}). Is it on PYTHONPATH?")

    from qformats._cli import _engine  # jax and the formats load only now, after parsing

    if args.paths:
        tensors, load_problems = _engine.load_tensors(args.paths, args.tensor or None)
        problems += load_problems
    else:
        tensors = _engine.default_tensors()
        if args.tensor:
            names = {t.name for t in tensors}
            for n in args.tensor:
                if n not in names:
                    problems.append(f"--tensor {n}: no such tensor in the default set ({', '.join(sorted(names))}).")
            tensors = [t for t in tensors if t.name in set(args.tensor)]
    formats = None
    if args.formats:
        formats = [n for arg in args.formats for n in arg.split(",") if n.strip()]
    result = _engine.compare(
        tensors,
        formats,
        axis=args.axis,
        min_sqnr=args.min_sqnr,
        max_flushed=args.max_flushed / 100,
        max_saturated=args.max_saturated / 100,
        repeats=args.repeats,
        progress=len(tensors) >= 8 and not args.json,
    )
    problems += result.problems
    if args.json:
        print(json.dumps(result.to_json(), indent=2, allow_nan=False))
    elif result.records:
        _print_compare(result, tensors)
    if args.plot and result.records:
        _plot(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    if not tensors and not problems:
        problems.append("no tensor to analyse.")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return EXIT_INPUT if problems else 0


def _percent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage between 0 and 100")
    return v


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qformats",
        description="Low-precision number formats for JAX: list them, or measure which one fits your tensors.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="print a table of every registered format")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser(
        "compare",
        help="quantize tensors with each format and recommend the smallest one that is accurate enough",
        description=(
            "Quantize every floating tensor of the given .npy/.npz/.safetensors files (default: an embedded "
            "set of typical weights, activations, gradients and embeddings) with each format; report bits "
            "per element, SQNR, max relative error, saturated and flushed fractions and quantize time; "
            "recommend the smallest format whose SQNR reaches --min-sqnr while flushing and saturating at most "
            "--max-flushed / --max-saturated percent of the values. Exit status 2 on input problems "
            "(reported on stderr; the rest is still analysed). --json output is strict JSON."
        ),
    )
    p.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help=".npy, .npz or .safetensors files, .gguf files or checkpoint folders (quantized weights as their values)",
    )
    p.add_argument("--formats", action="append", metavar="A,B,...", help="formats to compare (default: all registered)")
    p.add_argument(
        "--axis", type=int, default=None, help="block / channel axis for formats that have one (default: -1)"
    )
    p.add_argument("--tensor", action="append", metavar="NAME", help="analyse only this tensor (repeatable)")
    p.add_argument("--min-sqnr", type=float, default=25.0, metavar="DB", help="SQNR a format must reach (default: 25)")
    p.add_argument(
        "--max-flushed",
        type=_percent,
        default=DEFAULT_MAX_FLUSHED_PCT,
        metavar="PCT",
        help=f"a recommended format flushes at most PCT%% of the values to zero (default: {DEFAULT_MAX_FLUSHED_PCT:g})",
    )
    p.add_argument(
        "--max-saturated",
        type=_percent,
        default=DEFAULT_MAX_SATURATED_PCT,
        metavar="PCT",
        help=(
            "a recommended format clips at most PCT%% of the values at its largest magnitude "
            f"(default: {DEFAULT_MAX_SATURATED_PCT:g})"
        ),
    )
    p.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="timed quantize runs, median reported (default: 3)"
    )
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per tensor and format")
    p.add_argument("--plot", metavar="FILE.png", help="draw SQNR against bits per element (needs matplotlib)")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (e.g. one that registers custom formats)",
    )
    p.set_defaults(func=_cmd_compare)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
