"""Shared test set-up: strict dtype promotion catches silent upcasts in library code."""

import os

import jax
import pytest
from gpu_division import inexact_division  # noqa: F401  (a fixture for every test folder)

jax.config.update("jax_numpy_dtype_promotion", "strict")

VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "vectors")


@pytest.fixture(scope="session")
def vectors_dir():
    path = os.environ.get("QFORMATS_VECTORS", VECTORS)
    if not os.path.isdir(path):
        pytest.skip(
            f"reference vectors not found at {path}: put the shared/ folder beside the checkout or set QFORMATS_VECTORS"
        )
    return path


def _exec_doc_blocks(path):
    """Execute the python code blocks of a markdown page in one namespace (docs stay true)."""
    import re

    text = open(path, encoding="utf-8").read()
    ns: dict = {}
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        exec(compile(block, path, "exec"), ns)
    return ns


CUSTOM_DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "custom_formats.md")
CUSTOM_NS = _exec_doc_blocks(CUSTOM_DOC)  # registers "int4_g128" before test collection
