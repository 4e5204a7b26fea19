"""Run jax-scalify's own test suite against ``scalify`` through a name-mapping shim, and count.

    python scripts/run_jax_scalify_suite.py                     # pip download the sdist, run, print counts
    python scripts/run_jax_scalify_suite.py --source DIR        # an unpacked jax-scalify source tree
    python scripts/run_jax_scalify_suite.py --list public-fail  # also list tests of one class/outcome

jax-scalify's code is never copied into this repository: the script fetches its sdist with
``pip download --no-deps --no-binary :all: jax-scalify`` into a temporary directory, installs the
suite's test-only dependencies there (``chex``, ``absl-py``, ``toolz``, with ``pip install --target``,
so the active environment is not touched), writes a package ``jax_scalify`` on a temporary
``sys.path`` that maps jax-scalify's *public* names onto ``scalify`` and runs ``pytest`` on the
suite's ``tests/`` directory.

The shim and the public/internal rule
-------------------------------------
Public names (mapped onto ours): everything exported at the top level of ``jax_scalify``
(``ScaledArray``, ``ScalifyConfig``, ``Pow2RoundMode``, ``as_scaled_array``, ``asarray``,
``scaled_array``, ``scalify``, ``debug_callback``) wherever a test imports it from (``jax_scalify``
or ``jax_scalify.core``), every name of ``jax_scalify.ops`` and ``jax_scalify.tree``, and the
scaling primitives of ``jax_scalify.lax`` that user programs call (``set_scaling``, ``stop_scaling``,
``get_data_scale``, ``rebalance``); plus the typing aliases ``Array``, ``DTypeLike``, ``Shape``.

Every other ``jax_scalify`` name is internal: the per-primitive implementations ``lax.scaled_*``
(which the interpreter registers; users reach them through ``scalify``), the ``*_p`` primitives,
and ``core`` helpers (``pow2_*``, ``is_static_*``, ``make_scaled_scalar``, ``register_scaled_op``,
``find_registered_scaled_op``, interpreter classes, ...). The shim gives each internal name a stub
that raises ``NotImplementedError`` when called.

A test is in the **public-API subset** when no internal name appears in its source: the AST of the
test function (body and decorators) is walked, and every ``Name`` / ``Attribute`` chain that
resolves to a ``jax_scalify`` name (through the module's ``import``/``from ... import``) must be
public. The classification does not depend on our implementation.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _jax_scalify_source import fetch_sdist

TEST_DEPS = ("chex", "absl-py", "toolz")

# jax_scalify module -> {public name: expression over `scalify`}.
_TOP = {
    "ScaledArray": "scalify.ScaledArray",
    "ScalifyConfig": "scalify.ScalifyConfig",
    "Pow2RoundMode": "scalify.Pow2RoundMode",
    "as_scaled_array": "scalify.as_scaled_array",
    "asarray": "scalify.asarray",
    "scaled_array": "scalify.scaled_array",
    "scalify": "scalify.scalify",
    "debug_callback": "scalify.debug_callback",
}
_TYPING = {"Array": "jax.Array", "DTypeLike": "numpy.typing.DTypeLike", "Shape": "builtins.tuple"}
_LAX = {n: f"scalify.lax.{n}" for n in ("set_scaling", "stop_scaling", "get_data_scale", "rebalance")}
_OPS = {
    n: f"scalify.ops.{n}"
    for n in (
        "cast_on_backward",
        "cast_on_forward",
        "reduce_precision_on_backward",
        "reduce_precision_on_forward",
        "debug_callback",
        "debug_callback_grad",
        "debug_print",
        "debug_print_grad",
        "dynamic_rescale_l1",
        "dynamic_rescale_l1_grad",
        "dynamic_rescale_l2",
        "dynamic_rescale_l2_grad",
        "dynamic_rescale_max",
        "dynamic_rescale_max_grad",
    )
}
_TREE = {n: f"scalify.tree.{n}" for n in ("all", "astype", "flatten", "leaves", "map", "structure", "unflatten")}
PUBLIC = {
    "jax_scalify": {**_TOP},
    "jax_scalify.core": {**_TOP, **_TYPING},
    "jax_scalify.core.datatype": {k: _TOP[k] for k in ("ScaledArray", "as_scaled_array", "asarray", "scaled_array")},
    "jax_scalify.core.typing": {"Array": "jax.Array"},
    "jax_scalify.core.interpreters": {k: _TOP[k] for k in ("ScalifyConfig", "scalify")},
    "jax_scalify.core.pow2": {"Pow2RoundMode": "scalify.Pow2RoundMode"},
    "jax_scalify.lax": dict(_LAX),
    "jax_scalify.lax.base_scaling_primitives": dict(_LAX),
    "jax_scalify.ops": dict(_OPS),
    "jax_scalify.tree": dict(_TREE),
}
SUBMODULES = {"jax_scalify": ("core", "lax", "ops", "tree")}


def _module_source(modname: str, submodules: list[str]) -> str:
    names = PUBLIC.get(modname, {})
    lines = [
        f'"""Shim of {modname}: public names mapped onto scalify; other names are internal stubs."""',
        "import importlib, jax, numpy, numpy.typing",
        "",
        "def _public(path):",
        "    # A public name scalify lacks becomes a stub, so the suite still runs and counts it.",
        "    mod, _, name = path.rpartition('.')",
        "    try:",
        "        return getattr(importlib.import_module(mod), name)",
        "    except (ImportError, AttributeError):",
        "        return _Internal(path + ' (public name missing in scalify)')",
        "",
        "class _Internal:",
        "    def __init__(self, name):",
        "        self._name = name",
        "    def __call__(self, *args, **kwargs):",
        "        raise NotImplementedError(f'{self._name}: not provided by the scalify shim')",
        "    def __repr__(self):",
        "        return f'<jax-scalify internal {self._name}>'",
        "",
    ]
    lines += [f"{k} = _public({v!r})" for k, v in names.items()]
    lines += [f"from . import {s}" for s in submodules]
    if modname == "jax_scalify":
        lines.append("__version__ = '0.1.1+scalify-shim'")
    lines += [
        "",
        "def __getattr__(name):",
        "    if name.startswith('__'):",
        "        raise AttributeError(name)",
        f"    return _Internal('{modname}.' + name)",
        "",
    ]
    return "\n".join(lines)


def write_shim(src_pkg: Path, dest: Path) -> None:
    """Mirror the module tree of jax-scalify's package ``src_pkg`` as shim modules under ``dest``."""
    for py in sorted(src_pkg.rglob("*.py")):
        rel = py.relative_to(src_pkg.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        modname = ".".join(parts)
        subs = []
        if is_pkg:
            subs = sorted(p.name for p in py.parent.iterdir() if p.is_dir() and (p / "__init__.py").exists()) or list(
                SUBMODULES.get(modname, ())
            )
        out = dest.joinpath(*parts, "__init__.py") if is_pkg else dest.joinpath(*parts[:-1], parts[-1] + ".py")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_module_source(modname, subs))


# -- classification ---------------------------------------------------------------------------------
def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> qualified jax_scalify name, from the module's imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "jax_scalify":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "jax_scalify"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax_scalify":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _qualnames(node: ast.AST, imports: dict[str, str]) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute):
            chain, cur = [], sub
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in imports:
                found.add(".".join([imports[cur.id], *reversed(chain)]))
        elif isinstance(sub, ast.Name) and sub.id in imports:
            found.add(imports[sub.id])
    return found


def _is_public(qual: str) -> bool:
    """A qualified name is public when it (or its longest module prefix) maps to a public name."""
    parts = qual.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in PUBLIC or mod in ("jax_scalify",):
            rest = parts[i:]
            if not rest:
                return True  # a module itself, e.g. `jax_scalify.ops`
            return rest[0] in PUBLIC.get(mod, {}) or f"{mod}.{rest[0]}" in PUBLIC
    return False


def classify(tests_dir: Path) -> dict[tuple[str, str, str], bool]:
    """(module path, class or '', function) -> True when the test uses only public names."""
    out = {}
    for py in sorted(tests_dir.rglob("test_*.py")):
        tree = ast.parse(py.read_text())
        imports = _imports(tree)
        mod = ".".join(py.relative_to(tests_dir.parent).with_suffix("").parts)
        for node in tree.body:
            funcs = [(None, node)] if isinstance(node, ast.FunctionDef) else []
            if isinstance(node, ast.ClassDef):
                funcs = [(node.name, f) for f in node.body if isinstance(f, ast.FunctionDef)]
            for cls, fn in funcs:
                if fn.name.startswith("test"):
                    out[(mod, cls or "", fn.name)] = all(_is_public(q) for q in _qualnames(fn, imports))
    return out


def _lookup(classes, mod: str, cls: str, name: str):
    """Find the source test of a (possibly parameterized / variant) junit test name."""
    best = None
    for (m, c, f), pub in classes.items():
        if m == mod and c == cls and name.startswith(f) and (best is None or len(f) > len(best[0])):
            best = (f, pub)
    return best


def parse_junit(path: Path, classes) -> list[dict]:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        parts = classname.split(".")
        match = None
        for split in (len(parts) - 1, len(parts)):
            mod, cls = ".".join(parts[:split]), ".".join(parts[split:])
            match = _lookup(classes, mod, cls, name)
            if match:
                break
        public = match[1] if match else False
        el = case.find("failure") if case.find("failure") is not None else case.find("error")
        msg = (el.get("message") or "")[:200] if el is not None else ""
        rows.append({"id": f"{classname}::{name}", "outcome": outcome, "public": public, "message": msg})
    return rows


# -- fetch and run ----------------------------------------------------------------------------------
def install_test_deps(work: Path) -> Path:
    target = work / "deps"
    missing = []
    for dep, mod in zip(TEST_DEPS, ("chex", "absl", "toolz"), strict=True):
        try:
            __import__(mod)
        except ImportError:
            missing.append(dep)
    if missing:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target), *missing],
            check=True,
        )
    return target


def run(source: Path, work: Path, pytest_args: list[str]) -> list[dict]:
    if not (source / "jax_scalify").is_dir() or not (source / "tests").is_dir():
        raise SystemExit(f"{source} is not a jax-scalify source tree (needs jax_scalify/ and tests/).")
    shim = work / "shim"
    write_shim(source / "jax_scalify", shim)
    tests = work / "tests"
    subprocess.run(["cp", "-r", str(source / "tests"), str(tests)], check=True)
    deps = install_test_deps(work)
    junit = work / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(deps), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(work)]
    cmd += ["--junitxml", str(junit), "-o", "junit_family=xunit1", *pytest_args, "tests"]
    subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return parse_junit(junit, classify(tests))


def report(rows: list[dict], listing: str | None) -> None:
    def counts(sel):
        c = Counter(r["outcome"] for r in sel)
        return (
            f"{len(sel)} tests: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"
        )

    print("jax-scalify suite through the scalify shim")
    print("  all         ", counts(rows))
    print("  public API  ", counts([r for r in rows if r["public"]]))
    print("  internals   ", counts([r for r in rows if not r["public"]]))
    if listing:
        subset, _, outcome = listing.partition("-")
        for r in rows:
            if (subset == "all" or r["public"] == (subset == "public")) and (not outcome or r["outcome"] == outcome):
                print(f"  {r['outcome']:7s} {r['id']}  {r['message']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="unpacked jax-scalify source tree (default: pip download the sdist)")
    ap.add_argument("--list", help="list tests: {public,internal,all}[-{passed,failed,error}]")
    ap.add_argument("--json", type=Path, help="write per-test rows to this file")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jax-scalify-suite-") as tmp:
        work = Path(tmp)
        source = args.source.resolve() if args.source else fetch_sdist(work)
        rows = run(source, work, args.pytest_args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    report(rows, args.list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
