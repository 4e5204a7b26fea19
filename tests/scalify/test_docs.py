"""docs/quickstart.md runs as a doctest; docs/operators.md is regenerated and must be current."""

from __future__ import annotations

import doctest
import importlib.util
import pathlib

import jax

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quickstart_doctest():
    with jax.numpy_dtype_promotion("standard"):
        result = doctest.testfile(
            str(ROOT / "docs" / "quickstart.md"), module_relative=False, optionflags=doctest.ELLIPSIS
        )
    assert result.attempted > 10
    assert result.failed == 0


def _generator():
    spec = importlib.util.spec_from_file_location("gen_operators_doc", ROOT / "scripts" / "gen_operators_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_operators_doc_is_current():
    text = _generator().render()
    current = (ROOT / "docs" / "operators.md").read_text()
    assert current == text, "docs/operators.md is stale: run `python scripts/gen_operators_doc.py`"


def test_operators_doc_lists_every_lax_primitive():
    from scalify._jax_compat import all_lax_primitives

    text = (ROOT / "docs" / "operators.md").read_text()
    for name in all_lax_primitives():
        assert f"`{name}`" in text
