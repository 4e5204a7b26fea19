"""docs/io.md stays true: its python blocks run in order in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "io.md"


def test_io_doc_examples_run():
    pytest.importorskip("flax.serialization", reason="docs/io.md shows flax; flax is not installed")
    pytest.importorskip("orbax.checkpoint", reason="docs/io.md shows orbax; orbax-checkpoint is not installed")
    pytest.importorskip("flatbuffers", reason="docs/io.md shows jax.export serialization, which needs flatbuffers")
    ns: dict = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S):
        exec(compile(block, str(DOC), "exec"), ns)
    assert ns["ys"].shape == (3, 5, 16)
