"""The docs site builds without warnings, and docs/formats.md matches the registry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_formats_doc_is_up_to_date():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_formats_doc.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr + "\nRegenerate it: python scripts/gen_formats_doc.py"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs and mkdocstrings[python] are not installed (pip install -e '.[docs]')",
)
def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "formats" / "index.html").exists()
    assert "get_format" in (tmp_path / "site" / "api" / "index.html").read_text()
