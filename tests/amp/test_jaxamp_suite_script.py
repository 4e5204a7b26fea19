"""scripts/run_jaxamp_suite.py, offline: a stand-in jaxamp test suite given with --source."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_jaxamp_suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("run_jaxamp_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_source(root: Path, body: str) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "test_fake.py").write_text(textwrap.dedent(body))
    return root


def test_rewrites_only_the_import_and_counts(suite, tmp_path, capsys):
    source = _fake_source(
        tmp_path / "src",
        """
        import scalify.amp
        from jaxamp import (
            amp,
            DynamicScalerState,
        )
        import jaxamp


        def test_names_come_from_scalify_amp():
            assert amp is scalify.amp.amp and jaxamp is scalify.amp
            assert "total_resets" in DynamicScalerState._fields


        def test_fails():
            assert "from jaxamp import" == "kept as written"  # string literals are not rewritten
        """,
    )
    assert suite.main(["--source", str(source), "--", "-q"]) == 1
    out = capsys.readouterr().out
    assert "1 passed, 1 failed, 0 errors, 0 skipped of 2" in out
    assert "from jaxamp import" in (source / "tests" / "test_fake.py").read_text()  # the source is untouched


def test_refuses_a_directory_without_jaxamp_imports(suite, tmp_path):
    source = _fake_source(tmp_path / "src", "def test_x():\n    pass\n")
    with pytest.raises(SystemExit) as e:
        suite.main(["--source", str(source)])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        suite.main(["--source", str(tmp_path / "missing")])
