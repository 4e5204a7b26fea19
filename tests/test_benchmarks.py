"""The asv suite cannot rot: every benchmark function runs once, on tiny sizes, for every format.

Sets ``QFORMATS_BENCH_SMALL=1`` before importing ``asv_bench/benchmarks`` (as a uniquely named
package), then calls ``setup`` and the benchmark the way asv does. A setup raising
``NotImplementedError`` is asv's "skip" (scalify benchmarks before ``scalify.scalify`` exists).
Also runs ``asv check`` when asv is installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "asv_bench" / "benchmarks"
PKG = "qformats_asv_benchmarks"
PREFIXES = ("time_", "track_", "peakmem_", "mem_")
SLOW_MODULES = ("bench_matmul", "bench_scalify")  # compile a model per format: test a few formats
SLOW_FORMATS = ("int8_per_channel", "mxfp8", "nvfp4")
# Classes whose setup compiles a model step (seconds per parameter): the fast lane runs their first
# parameter, which reaches every line of the benchmark; the other recipes and formats are each
# tested on their own, and run here in the slow lane.
MODEL_STEP_CLASSES = ("GPTBlockRecipeStep", "MoERecipeStep", "GPTBlockScalified", "QwixTrainingStep")


def _load_suite():
    os.environ["QFORMATS_BENCH_SMALL"] = "1"
    spec = importlib.util.spec_from_file_location(
        PKG, BENCH_DIR / "__init__.py", submodule_search_locations=[str(BENCH_DIR)]
    )
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[PKG] = pkg
    spec.loader.exec_module(pkg)
    mods = [importlib.import_module(f"{PKG}.{p.stem}") for p in sorted(BENCH_DIR.glob("bench_*.py"))]
    return mods


def _cases():
    """One case per (benchmark class, parameters): its ``setup`` once, then every benchmark method.

    asv calls ``setup`` before each method; here one call serves them all, since what is checked is
    that every method runs, and a setup compiles the benchmarked programs (seconds each)."""
    cases = []
    for mod in _load_suite():
        for cname, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__ or cname.startswith("_"):
                continue
            methods = tuple(sorted(m for m in dir(cls) if m.startswith(PREFIXES)))
            if not methods:
                continue
            params = getattr(cls, "params", ())
            axes = (
                [list(a) for a in params]
                if params and isinstance(params[0], (list, tuple))
                else ([list(params)] if params else [])
            )
            # every format for the per-format benchmarks, a few for the slow model ones; the
            # smallest (first) value of the other parameters
            fmts = axes[0] if axes else [None]
            if axes and mod.__name__.endswith(SLOW_MODULES):
                fmts = [f for f in fmts if f in SLOW_FORMATS] or fmts[:1]
            for i, fmt in enumerate(fmts):
                args = ([fmt] if axes else []) + [a[0] for a in axes[1:]]
                slow_case = mod.__name__.endswith(SLOW_MODULES) or (cname in MODEL_STEP_CLASSES and i > 0)
                slow = (pytest.mark.slow,) if slow_case else ()
                cases.append(
                    pytest.param(
                        cls,
                        methods,
                        args,
                        id=f"{mod.__name__.split('.')[-1]}.{cname}[{','.join(map(str, args))}]",
                        marks=slow,
                    )
                )
    return cases


@pytest.mark.parametrize(("cls", "methods", "args"), _cases())
def test_benchmark_runs_once(cls, methods, args):
    bench = cls()
    try:
        if hasattr(bench, "setup"):
            bench.setup(*args)
    except NotImplementedError as e:
        pytest.skip(f"asv would skip this benchmark: {e}")
    try:
        for method in methods:
            out = getattr(bench, method)(*args)
            if method.startswith("track_"):
                assert isinstance(out, (int, float)), (method, out)
                assert not math.isinf(out), (method, out)
                if "ratio" in method:
                    assert out > 0, (method, out)
    finally:
        if hasattr(bench, "teardown"):
            bench.teardown(*args)


def test_suite_sees_every_registered_format():
    import qformats as qf

    common = importlib.import_module(f"{PKG}._common")
    assert set(qf.list_formats()) <= set(common.FORMAT_NAMES)


def test_env_var_adds_a_custom_format(monkeypatch):
    common = importlib.import_module(f"{PKG}._common")
    monkeypatch.setenv("QFORMATS_BENCH_FORMATS", "qformats:MXFP8")
    assert "mxfp8" in common._load_env_formats()
    monkeypatch.setenv("QFORMATS_BENCH_FORMATS", "qformats")
    with pytest.raises(ValueError, match="module:attribute"):
        common._load_env_formats()


@pytest.mark.skipif(shutil.which("asv") is None, reason="asv is not installed (pip install 'qformats[bench]')")
def test_asv_check():
    env = {**os.environ, "QFORMATS_BENCH_SMALL": "1"}
    r = subprocess.run(
        ["asv", "check", "--python=same"], cwd=ROOT / "asv_bench", capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No problems found" in r.stdout, r.stdout


def test_perf_table_from_asv_results(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("perf_table", ROOT / "scripts" / "perf_table.py")
    perf_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf_table)
    cols = ["result", "params", "version"]
    results = {
        "bench_formats.Ratio.track_quantize_ratio": [[1.8, 2.7], [["'mxfp8'", "'nvfp4'"], ["'2048x2048'"]], "v"],
        "bench_formats.Ratio.track_dequantize_ratio": [[1.2, None], [["'mxfp8'", "'nvfp4'"], ["'2048x2048'"]], "v"],
        "bench_formats.Storage.track_bits_per_element": [[8.25, 4.5], [["'mxfp8'", "'nvfp4'"], ["'1024x1024'"]], "v"],
        "bench_scalify.Float16MLPStep.track_ratio": [[1.02], [], "v"],
        "bench_scalify.Float16MLPStep.track_trace_lower_ratio": [[2.5], [], "v"],
        "bench_scalify.MLPTrainStep.track_ratio": [[1.3], [["'mxfp8'"]], "v"],
    }
    header = {"result_columns": cols, "results": results, "commit_hash": "abc", "params": {"machine": "m", "cpu": "c"}}
    path = tmp_path / "res.json"
    path.write_text(json.dumps(header))
    doc = tmp_path / "perf.md"
    doc.write_text(
        f"intro\n{perf_table.START}\nold\n{perf_table.END}\nmiddle\n"
        f"{perf_table.SCALIFY_START}\nstale\n{perf_table.SCALIFY_END}\noutro\n"
    )
    assert perf_table.main(["--results", str(path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "old" not in text and "stale" not in text and "middle" in text
    assert text.startswith("intro") and text.rstrip().endswith("outro")
    assert "step **1.020** ✓ (target 1.03), trace+lower **2.50** ✗ (target 2.0)" in text
    assert "| mxfp8 | 1.30 | n/a | n/a | n/a |" in text
    assert "| mxfp8 | 1.80 ✓ (2.0) | 1.20 ✓ (1.5) | 8.250 |" in text
    assert "| nvfp4 | 2.70 ✓ (3.0) | n/a (2.0) | 4.500 |" in text
    # `--only scalify` rewrites the scalify table and leaves the formats table as it was.
    doc.write_text(
        f"{perf_table.START}\nkept\n{perf_table.END}\n{perf_table.SCALIFY_START}\nstale\n{perf_table.SCALIFY_END}\n"
    )
    assert perf_table.main(["--results", str(path), "--doc", str(doc), "--only", "scalify"]) == 0
    text = doc.read_text()
    assert "kept" in text and "stale" not in text and "step **1.020**" in text
