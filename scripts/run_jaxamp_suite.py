"""Run jaxamp's own test suite against ``scalify.amp`` (``import scalify.amp as jaxamp``).

jaxamp's tests ship in its source distribution on PyPI. This script downloads it (``pip download
--no-deps --no-binary :all: jaxamp==VERSION``), or takes an unpacked copy with ``--source DIR``
(a directory holding ``tests/``, e.g. a clone of https://github.com/acutkosky/jaxamp), copies the
tests into a temporary directory, rewrites the jaxamp import and nothing else::

    from jaxamp import (...)   ->   from scalify.amp import (...)
    import jaxamp              ->   import scalify.amp as jaxamp

runs them with pytest there and prints the pass / fail counts. Nothing from jaxamp is kept.

The tests need ``equinox`` and ``jaxtyping`` (``pip install equinox jaxtyping``).

Usage::

    python scripts/run_jaxamp_suite.py                 # download jaxamp 0.0.4 from PyPI
    python scripts/run_jaxamp_suite.py --source DIR    # use an unpacked sdist or a git clone
    python scripts/run_jaxamp_suite.py -- -k dynamic   # extra arguments go to pytest

Exit status: 0 when every test passed, 1 when some failed, 2 when the suite could not be run.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_VERSION = "0.0.4"
REQUIRED = ("equinox", "jaxtyping", "pytest")

# only the import statements change; the tests' bodies are run as written
_IMPORT_REWRITES = (
    (re.compile(r"^(\s*)from jaxamp import ", re.M), r"\1from scalify.amp import "),
    (re.compile(r"^(\s*)import jaxamp\s*$", re.M), r"\1import scalify.amp as jaxamp"),
)


def _fail(msg: str) -> None:
    print(f"run_jaxamp_suite: {msg}", file=sys.stderr)
    sys.exit(2)


def _download_sdist(version: str, dest: Path) -> Path:
    """``pip download`` jaxamp's sdist into ``dest`` and unpack it; returns the unpacked root."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(dest)]
    cmd.append(f"jaxamp=={version}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    archives = sorted(dest.glob("jaxamp-*.tar.gz"))
    if proc.returncode != 0 or not archives:
        _fail(
            f"could not download jaxamp=={version} from PyPI:\n{proc.stderr.strip()}\n"
            "Clone https://github.com/acutkosky/jaxamp (or unpack its sdist) and pass --source DIR."
        )
    with tarfile.open(archives[0]) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python without extraction filters: refuse members that would land outside dest
            for m in tar.getmembers():
                if not (dest / m.name).resolve().is_relative_to(dest.resolve()) or m.issym() or m.islnk():
                    _fail(f"refusing to unpack {archives[0].name}: unsafe member {m.name!r}.")
            tar.extractall(dest)
    roots = [p for p in dest.iterdir() if p.is_dir() and (p / "tests").is_dir()]
    if not roots:
        _fail(f"the jaxamp sdist {archives[0].name} has no tests/ directory.")
    return roots[0]


def _copy_tests(source: Path, dest: Path) -> list[Path]:
    """Copy ``source/tests`` to ``dest/tests`` with the jaxamp import rewritten; returns the test files."""
    tests = source / "tests"
    if not tests.is_dir():
        _fail(f"{source} has no tests/ directory; pass the root of a jaxamp checkout or unpacked sdist.")
    shutil.copytree(tests, dest / "tests")
    files = sorted((dest / "tests").rglob("test_*.py"))
    if not files:
        _fail(f"no test_*.py files under {tests}.")
    rewritten = 0
    for f in files:
        text = f.read_text()
        for pattern, repl in _IMPORT_REWRITES:
            text, n = pattern.subn(repl, text)
            rewritten += n
        f.write_text(text)
    if rewritten == 0:
        _fail("found no `import jaxamp` / `from jaxamp import` to rewrite; is this jaxamp's test suite?")
    return files


def _counts(junit: Path) -> dict[str, int]:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="unpacked jaxamp sdist or git clone (holding tests/)")
    parser.add_argument("--version", default=DEFAULT_VERSION, help="jaxamp version to download (default %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory and print its path")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if missing:
        _fail(f"jaxamp's tests need {', '.join(missing)}: pip install {' '.join(missing)}")
    if importlib.util.find_spec("jaxamp") is not None:
        # the rewritten tests never import it, but say so: results must come from scalify.amp alone
        print("note: a real jaxamp is installed; the rewritten tests do not import it.")

    tmp = Path(tempfile.mkdtemp(prefix="jaxamp_suite_"))
    try:
        source = args.source.resolve() if args.source else _download_sdist(args.version, tmp / "download")
        run_dir = tmp / "run"
        run_dir.mkdir()
        files = _copy_tests(source, run_dir)
        # an empty ini file makes run_dir pytest's rootdir, so no outer configuration applies
        (run_dir / "pytest.ini").write_text("[pytest]\n")
        junit = tmp / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests"]
        proc = subprocess.run([*cmd, *args.pytest_args], cwd=run_dir, check=False)
        if not junit.exists():
            _fail(f"pytest produced no report (exit status {proc.returncode}).")
        c = _counts(junit)
        print(
            f"\njaxamp test suite ({len(files)} file(s), import rewritten to scalify.amp): "
            f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped "
            f"of {c['tests']}"
        )
        return 0 if c["failures"] == c["errors"] == 0 and c["passed"] > 0 else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
