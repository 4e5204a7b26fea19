"""The examples of docs/distributed.md run on an explicit mesh (jax.make_mesh's default)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"


def _example(marker: str) -> str:
    text = DOC.read_text()
    m = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"docs/distributed.md has no python block after <!-- {marker} -->"
    return m.group(1)


def test_explicit_mesh_example_runs():
    exec(compile(_example("explicit-example"), str(DOC), "exec"), {"__name__": "docs_example"})


def test_scalify_of_shard_map_example_runs():
    exec(compile(_example("scalify-shard-map-example"), str(DOC), "exec"), {"__name__": "docs_example"})


def test_set_up_uses_make_mesh_defaults():
    text = DOC.read_text()
    assert 'jax.make_mesh((2, 4), ("d", "m"))' in text
    assert "AxisType.Auto, AxisType.Auto" not in text
