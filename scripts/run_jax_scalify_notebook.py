"""Run jax-scalify's quickstart notebook with ``import scalify as jsa`` and compare with its stored outputs.

    python scripts/run_jax_scalify_notebook.py                 # pip download jax-scalify's sdist (ships it)
    python scripts/run_jax_scalify_notebook.py --source DIR    # a checkout: git clone
                                                               #   https://github.com/graphcore-research/jax-scalify
    python scripts/run_jax_scalify_notebook.py --seed          # also run it in jax-scalify 0.1.1's own
                                                               #   environment (JAX 0.4.30), both seeded
    python scripts/run_jax_scalify_notebook.py --markdown      # print the table as Markdown

The notebook (``examples/scalify-quickstart.ipynb``) is read from jax-scalify's sdist, which the
script downloads into a temporary directory (or from ``--source DIR``); nothing of it is copied into
this repository. The only change made to it is the import: ``import jax_scalify as jsa`` becomes
``import scalify as jsa``. Code cells are executed in order in one namespace, in a fresh Python
process; each cell's stdout, stderr (warnings) and the repr of its last expression (what Jupyter
shows as ``Out[n]``) are captured and compared with the outputs stored in the notebook.

Differing cells are classified:

* ``numpy-2 repr``: equal once NumPy 2 scalar reprs (``np.float32(1.0)``) are written as NumPy 1 did;
* ``jax version``: equal once JAX class paths / names that changed between JAX 0.4 and ours are mapped;
* ``warning location``: only the file name IPython gives a cell differs in a warning;
* ``unseeded randomness``: the cell (or one before it) draws from ``np.random`` without a seed, and the
  text is equal with every number masked. With ``--seed`` the notebook is run seeded
  (``np.random.seed(0)`` before the first cell) here and in the seed's environment, and such a cell
  is confirmed only if the two seeded runs agree;
* ``genuine``: anything else.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

NOTEBOOK = Path("examples") / "scalify-quickstart.ipynb"
IMPORT_SEED = re.compile(r"^(\s*)import jax_scalify as jsa\s*$", re.M)
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", re.I)
RANDOM = re.compile(r"\bnp\.random\.(?!seed\b)\w+")


# -- worker: runs in the environment under test (stdlib only before the notebook's own imports) ----------
def _worker(cells_path: str, out_path: str, np_seed: int | None) -> None:
    import contextlib
    import io
    import linecache
    import traceback
    import warnings

    warnings.simplefilter("default")  # as in IPython: each warning once per location
    cells = json.loads(Path(cells_path).read_text())
    ns: dict = {"__name__": "__main__"}
    results = []
    for i, src in cells:
        if np_seed is not None and RANDOM.search(src):
            # Seed each drawing cell: imports and libraries that touch the global state do not shift draws.
            import numpy

            numpy.random.seed(np_seed + i)
        out, err = io.StringIO(), io.StringIO()
        res = {"index": i, "result": None, "error": None}
        # Register the cell's source, so warnings and tracebacks quote its lines as IPython does.
        linecache.cache[f"<cell {i}>"] = (len(src), None, src.splitlines(True), f"<cell {i}>")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                tree = ast.parse(src)
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                exec(compile(tree, f"<cell {i}>", "exec"), ns)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), f"<cell {i}>", "eval"), ns)
                    if value is not None:
                        res["result"] = repr(value)
            except Exception:
                res["error"] = traceback.format_exc(limit=-3)
        res["stdout"], res["stderr"] = out.getvalue(), err.getvalue()
        results.append(res)
    Path(out_path).write_text(json.dumps(results))


# -- driver --------------------------------------------------------------------------------------------
def load_cells(notebook: Path) -> list[dict]:
    nb = json.loads(notebook.read_text())
    cells = []
    for i, c in enumerate(nb["cells"]):
        if c["cell_type"] != "code":
            continue
        src = "".join(c["source"])
        stored = {"stdout": "", "stderr": "", "result": None}
        for o in c.get("outputs", []):
            if o["output_type"] == "stream":
                stored[o["name"]] += "".join(o["text"])
            elif o["output_type"] == "execute_result":
                stored["result"] = "".join(o["data"].get("text/plain", ""))
        cells.append({"index": i, "source": src, "stored": stored})
    return cells


def execute(python: str, cells: list[dict], rewrite: bool, np_seed: int | None, work: Path) -> list[dict]:
    srcs = [
        (c["index"], IMPORT_SEED.sub(r"\1import scalify as jsa", c["source"]) if rewrite else c["source"])
        for c in cells
    ]
    tag = "ours" if rewrite else "seed"
    cells_path, out_path = work / f"cells-{tag}.json", work / f"out-{tag}.json"
    cells_path.write_text(json.dumps(srcs))
    cmd = [python, str(Path(__file__).resolve()), "--worker", str(cells_path), str(out_path)]
    if np_seed is not None:
        cmd += ["--np-seed", str(np_seed)]
    subprocess.run(cmd, check=True, cwd=work, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out_path.read_text())


def _numpy1(text: str) -> str:
    text = re.sub(r"np\.(?:float|int|uint|complex)\d+\(([^()]*)\)", r"\1", text)
    return re.sub(r"np\.(True|False)_", r"\1", text)


def _jax_version(text: str) -> str:
    return text.replace("jaxlib._jax.ArrayImpl", "jaxlib.xla_extension.ArrayImpl")


def _warning_location(text: str) -> str:
    text = re.sub(r"/tmp/ipykernel_\d+/\d+\.py:(\d+)", r"<cell>:\1", text)
    return re.sub(r"<cell \d+>:(\d+)", r"<cell>:\1", text)


def _masked(text: str) -> str:
    return NUMBER.sub("#", text)


def _close(a: str, b: str, rtol: float = 1e-6) -> bool:
    xs, ys = NUMBER.findall(a), NUMBER.findall(b)
    return len(xs) == len(ys) and all(
        abs(float(x) - float(y)) <= rtol * abs(float(x)) for x, y in zip(xs, ys, strict=False)
    )


def classify(stored: str, got: str, random_before: bool, uses_jsa: bool = True) -> str | None:
    """None when equal; else the class of the first normalisation that makes them equal."""
    if stored == got:
        return None
    steps = (("numpy-2 repr", _numpy1), ("jax version", _jax_version), ("warning location", _warning_location))
    a, b, found = stored, got, []
    for name, fn in steps:
        a2, b2 = fn(a), fn(b)
        if (a2, b2) != (a, b):
            found.append(name)
        a, b = a2, b2
        if a == b:
            return " + ".join(found)
    if _masked(a) == _masked(b) and _close(a, b):
        return " + ".join([*found, "float last digits (rel < 1e-6: JAX/NumPy reduction order)"])
    if random_before and _masked(a) == _masked(b):
        return " + ".join([*found, "unseeded randomness"])
    if not uses_jsa:
        return " + ".join([*found, "library version (the cell does not use jsa)"])
    return "genuine"


def _short_diff(stored: str, got: str, width: int = 160) -> str:
    a, b = stored.splitlines(), got.splitlines()
    lines = [
        line
        for line in difflib.unified_diff(a, b, "stored", "ours", lineterm="", n=0)
        if not line.startswith(("---", "+++", "@@"))
    ]
    return " | ".join(lines)[:width]


def _jsa_names(src: str) -> set[str]:
    """Names a cell binds to something built with jsa (``@jsa.scalify def f``, ``f = jsa.scalify(g)``)."""
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and any("jsa" in ast.unparse(d) for d in node.decorator_list):
            names.add(node.name)
        elif isinstance(node, ast.Assign) and "jsa" in ast.unparse(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def compare(cells: list[dict], ours: list[dict], seed: list[dict] | None, seeded: bool = False) -> list[dict]:
    """Rows of the table; ``seeded``: both sides drew the same random numbers (no randomness excuse)."""
    rows = []
    random_before = False
    jsa_names: set[str] = set()
    for k, (c, got) in enumerate(zip(cells, ours, strict=True)):
        random_before = (random_before or bool(RANDOM.search(c["source"]))) and not seeded
        jsa_names |= _jsa_names(c["source"])
        used = {n.id for n in ast.walk(ast.parse(c["source"])) if isinstance(n, ast.Name)}
        uses_jsa = "jsa." in c["source"] or bool(used & jsa_names)
        row = {"index": c["index"], "first": c["source"].strip().splitlines()[0][:50] if c["source"].strip() else ""}
        if got["error"]:
            row.update(status="error", why="genuine", diff=got["error"].strip().splitlines()[-1][:160])
            rows.append(row)
            continue
        whys, diffs = [], []
        for key in ("stdout", "stderr", "result"):
            stored, mine = c["stored"][key] or "", got[key] or ""
            why = classify(stored, mine, random_before, uses_jsa)
            if why is None:
                continue
            if "unseeded randomness" in why and seed is not None:
                theirs, ours_seeded = seed[k], seed[k]["_ours_seeded"]
                agree = not theirs["error"] and not ours_seeded["error"]
                agree = agree and classify(theirs[key] or "", ours_seeded[key] or "", False) != "genuine"
                if not agree:
                    diff = _short_diff(theirs[key] or "", ours_seeded[key] or "", 100)
                    why = f"genuine (seeded runs differ: {diff})"
                else:
                    why += " (seeded runs agree)"
            whys.append(f"{key}: {why}")
            diffs.append(_short_diff(stored, mine))
        if not whys:
            row.update(status="ran, output equal", why="", diff="")
        else:
            row.update(status="ran, output differs", why="; ".join(whys), diff=" || ".join(diffs))
        rows.append(row)
    return rows


def print_table(rows: list[dict], markdown: bool) -> None:
    if markdown:
        print("| cell | first line | outcome | why | difference (stored → ours) |")
        print("|---|---|---|---|---|")
        for r in rows:
            cells = [str(r["index"]), f"`{r['first']}`" if r["first"] else "(empty)", r["status"], r["why"], r["diff"]]
            print("| " + " | ".join(x.replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
    else:
        for r in rows:
            print(f"[{r['index']:>2}] {r['status']:<20} {r['first']}")
            if r["why"]:
                print(f"       why:  {r['why']}")
                print(f"       diff: {r['diff']}")
    n_eq = sum(r["status"] == "ran, output equal" for r in rows)
    n_diff = sum(r["status"] == "ran, output differs" for r in rows)
    n_err = sum(r["status"] == "error" for r in rows)
    n_gen = sum("genuine" in r["why"] for r in rows)
    print(
        f"\n{len(rows)} code cells: {n_eq + n_diff} ran ({n_eq} output equal, {n_diff} differ), {n_err} errors; "
        f"{n_gen} with a genuine difference"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="a jax-scalify checkout or unpacked sdist (default: pip download)")
    ap.add_argument("--seed", action="store_true", help="also run in jax-scalify 0.1.1's own venv, both seeded")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--json", type=Path, help="write the rows (and raw outputs) to this file")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--np-seed", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(*args.worker, args.np_seed)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _jax_scalify_source import fetch_sdist, seed_python

    with tempfile.TemporaryDirectory(prefix="jax-scalify-notebook-") as tmp:
        work = Path(tmp)
        source = args.source.resolve() if args.source else fetch_sdist(work)
        notebook = source / NOTEBOOK
        if not notebook.exists():
            raise SystemExit(f"{notebook} not found: pass --source DIR, a clone of the jax-scalify repository.")
        cells = load_cells(notebook)
        ours = execute(sys.executable, cells, rewrite=True, np_seed=None, work=work)
        seed = None
        if args.seed:
            seed = execute(str(seed_python()), cells, rewrite=False, np_seed=0, work=work)
            ours_seeded = execute(sys.executable, cells, rewrite=True, np_seed=0, work=work)
            # Seeded comparison: ours seeded vs the seed seeded, cell by cell.
            seed_as_stored = [{**c, "stored": s} for c, s in zip(cells, seed, strict=True)]
            seeded_rows = compare(seed_as_stored, ours_seeded, None, seeded=True)
        rows = compare(cells, ours, seed_for_check(seed, ours_seeded) if args.seed else None)
    print(f"jax-scalify quickstart ({NOTEBOOK}), `import scalify as jsa`, vs the outputs stored in the notebook\n")
    print_table(rows, args.markdown)
    if args.seed:
        print(
            "\nSeeded (np.random.seed(i) before drawing cell i): jax-scalify 0.1.1 on JAX 0.4.30 (as stored) vs ours\n"
        )
        print_table(seeded_rows, args.markdown)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "cells": cells, "ours": ours}, indent=1))
    return 0


def seed_for_check(seed: list[dict], ours_seeded: list[dict]) -> list[dict]:
    """For the randomness check: pair the seed's seeded output with ours seeded (compare() compares to `mine`)."""
    return [{**s, "_ours_seeded": o} for s, o in zip(seed, ours_seeded, strict=True)]


if __name__ == "__main__":
    sys.exit(main())
