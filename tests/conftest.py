"""Shared test set-up: strict dtype promotion catches silent upcasts in library code."""

import os

import jax
import pytest
from gpu_division import inexact_division  # noqa: F401  (a fixture for every test folder)

jax.config.update("jax_numpy_dtype_promotion", "strict")

# The same XLA programs recur across tests and across the two lanes (the float32 baseline of every
# benchmark and recipe, a model step per format), so compiled programs go to JAX's persistent cache:
# one folder per test process, as two processes reading and writing one folder can see half-written
# entries. Keys include JAX's version, the backend and the flags, so an old entry is never reused
# wrongly. Set JAX_COMPILATION_CACHE_DIR to choose the folder yourself.
if jax.config.jax_compilation_cache_dir is None:
    _worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _root = os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "jax-compilation-cache")
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.join(_root, _worker)))

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
