"""Write the results table of docs/performance.md from asv results.

    cd asv_bench && asv run --python=same --quick --set-commit-hash $(git rev-parse HEAD)
    python scripts/perf_table.py            # newest results file of the newest machine
    python scripts/perf_table.py --results asv_bench/results/<machine>/<file>.json

Reads the ``track_*_ratio``, ``track_bits_per_element`` and ``track_sqnr_db`` results of one asv
results file and replaces the text between ``<!-- perf-table:start -->`` and
``<!-- perf-table:end -->`` (formats), and between ``<!-- scalify-table:start -->`` and
``<!-- scalify-table:end -->`` (models under scalify), in ``docs/performance.md`` (``--print``
writes to stdout instead).
Every number comes from the results file; nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "asv_bench" / "results"
DOC = ROOT / "docs" / "performance.md"
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"
SCALIFY_START, SCALIFY_END = "<!-- scalify-table:start -->", "<!-- scalify-table:end -->"
# Targets from the scalify issue, for its float16 MLP: (step ratio, trace+lower ratio).
SCALIFY_TARGETS = (1.03, 2.0)

# Targets from issue 5 (ratio to x * 2 under jit, CPU, 2048x2048 float32): (quantize, dequantize).
TARGETS = {
    "mxfp8": (2.0, 1.5),
    "mxfp8_e5m2": (2.0, 1.5),
    "mxfp6_e2m3": (3.0, 2.0),
    "mxfp6_e3m2": (3.0, 2.0),
    "mxfp4": (2.5, 2.0),
    "nvfp4": (3.0, 2.0),
    "int8_per_channel": (1.5, 1.5),
    "fp8_e4m3": (2.0, 1.5),
    "fp8_e5m2": (2.0, 1.5),
}
DATA_KINDS = ("gaussian", "heavy_tailed_outliers", "log_uniform")


def newest_results_file(results_dir: Path = RESULTS) -> Path:
    files = [p for p in results_dir.glob("*/*.json") if p.name not in ("machine.json", "benchmarks.json")]
    if not files:
        raise SystemExit(
            f"no asv results under {results_dir}; run first:\n"
            "  cd asv_bench && asv run --python=same --quick --set-commit-hash $(git rev-parse HEAD)"
        )
    return max(files, key=lambda p: p.stat().st_mtime)


def load(path: Path) -> tuple[dict, dict]:
    """``({benchmark name: {param tuple: value}}, results file header)``."""
    data = json.loads(path.read_text())
    cols = data["result_columns"]
    out = {}
    for name, row in data["results"].items():
        row = dict(zip(cols, row, strict=False))
        values, params = row.get("result"), row.get("params") or []
        if values is None:
            continue
        if not isinstance(values, list):  # a benchmark without parameters
            values = [values]
        combos = [()]
        for axis in params:
            combos = [(*c, p) for c in combos for p in axis]
        out[name] = {tuple(eval_param(p) for p in combo): v for combo, v in zip(combos, values, strict=True)}
    return out, data


def eval_param(p: str):
    """asv stores parameters as their ``repr``: ``"'mxfp8'"`` becomes ``mxfp8``."""
    return p[1:-1] if len(p) >= 2 and p[0] == p[-1] and p[0] in "'\"" else p


def find(results: dict, suffix: str) -> dict:
    for name, vals in results.items():
        if name.endswith(suffix):
            return vals
    return {}


def fmt_num(v, digits=2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f}"


def verdict(v, target) -> str:
    if target is None or v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return " ✓" if v <= target else " ✗"


def table(results: dict, header: dict, source: Path) -> str:
    quant = find(results, "Ratio.track_quantize_ratio")
    deq = find(results, "Ratio.track_dequantize_ratio")
    bits = find(results, "Storage.track_bits_per_element")
    sqnr = find(results, "Accuracy.track_sqnr_db")
    shapes = sorted({k[1] for k in quant} | {k[1] for k in deq})
    shape = "2048x2048" if "2048x2048" in shapes else (shapes[-1] if shapes else "?")
    formats = list(dict.fromkeys([k[0] for k in quant] + [k[0] for k in bits] + [k[0] for k in sqnr]))
    m = header.get("params", {})
    lines = [
        f"Machine: `{m.get('machine', '?')}`, {m.get('cpu', '?')}, {m.get('num_cpu', '?')} CPUs, "
        f"{m.get('os', '?')}; Python {platform.python_version()}; commit `{header.get('commit_hash', '?')[:10]}`.",
        "",
        f"Ratios are median wall time over the median of `x * 2` under jit on the same {shape} float32 array, "
        "runs interleaved (lower is better); ✓/✗ against the target in brackets. Bits per element include "
        "the scales (shape 1024x1024). SQNR in dB on 256x1024 arrays.",
        "",
        "| format | quantize (target) | dequantize (target) | bits/elem | SQNR gaussian "
        "| SQNR heavy-tailed + outliers | SQNR log-uniform 2^-30..2^0 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in formats:
        tq, td = TARGETS.get(f, (None, None))
        q, d = quant.get((f, shape)), deq.get((f, shape))
        qs = fmt_num(q) + verdict(q, tq) + (f" ({tq})" if tq else "")
        ds = fmt_num(d) + verdict(d, td) + (f" ({td})" if td else "")
        b = bits.get((f, "1024x1024"), next((v for k, v in bits.items() if k[0] == f), None))
        s = [fmt_num(sqnr.get((f, kind)), 1) for kind in DATA_KINDS]
        lines.append(f"| {f} | {qs} | {ds} | {fmt_num(b, 3)} | {' | '.join(s)} |")
    return "\n".join(lines)


def scalify_table(results: dict) -> str:
    """Models under scalify against the same program in plain JAX (ratios, lower is better)."""
    f16_step = find(results, "Float16MLPStep.track_ratio").get(())
    f16_trace = find(results, "Float16MLPStep.track_trace_lower_ratio").get(())
    ts, tt = SCALIFY_TARGETS
    lines = [
        "The scalify issue's target, MLP 784-1024-1024-10, batch 256, float16 data with float32 per-tensor "
        "scales, forward + backward + SGD (`bench_scalify.Float16MLPStep`): step "
        f"**{fmt_num(f16_step, 3)}**{verdict(f16_step, ts)} (target {ts}), trace+lower "
        f"**{fmt_num(f16_trace)}**{verdict(f16_trace, tt)} (target {tt}).",
        "",
        "Per format (`bench_scalify`, smaller models with float32 logical dtype; parameters and inputs in "
        "the format; the baseline is the same step on plain float32 arrays):",
        "",
        "| format | MLP step | MLP trace+lower | transformer block fwd+bwd | transformer trace+lower |",
        "| --- | --- | --- | --- | --- |",
    ]
    cols = [
        find(results, f"{model}.track{kind}")
        for model in ("MLPTrainStep", "TransformerBlockFwdBwd")
        for kind in ("_ratio", "_trace_lower_ratio")
    ]
    formats = list(dict.fromkeys(k[0] for c in cols for k in c))
    for f in formats:
        lines.append(f"| {f} | " + " | ".join(fmt_num(c.get((f,))) for c in cols) + " |")
    return "\n".join(lines)


def _replace(doc: str, start: str, end: str, text: str, path: Path) -> str:
    if start not in doc or end not in doc:
        raise SystemExit(f"{path} has no {start} ... {end} markers")
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{text}\n{end}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, help="asv results JSON (default: the newest one)")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--print", action="store_true", help="print the table instead of editing the doc")
    ap.add_argument(
        "--only",
        choices=("formats", "scalify"),
        help="write one table (for a results file of `asv run --bench bench_formats` or `bench_scalify`)",
    )
    args = ap.parse_args(argv)
    path = args.results or newest_results_file()
    results, header = load(path)
    parts = []
    if args.only in (None, "formats"):
        parts.append((START, END, table(results, header, path.resolve())))
    if args.only in (None, "scalify"):
        parts.append((SCALIFY_START, SCALIFY_END, scalify_table(results)))
    if args.print:
        print(*(text for _, _, text in parts), sep="\n\n")
        return 0
    doc = args.doc.read_text()
    for start, end, text in parts:
        doc = _replace(doc, start, end, text, args.doc)
    args.doc.write_text(doc)
    print(f"wrote the results of {path.name} into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
