"""Fixtures of the third-party model suite; the harness itself is thirdparty_harness.py.

(It is imported by name from the test modules; a module named ``conftest`` would clash with the other
test folders' conftest modules.)
"""

from __future__ import annotations

import jax
import pytest
from thirdparty_harness import COVERED_BY_FAMILY, FORMAT_NAMES, runs_step


@pytest.fixture(scope="module", autouse=True)
def _standard_promotion():
    """Third-party model code is written for JAX's default dtype promotion (the rest of the suite runs strict)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(
    params=[pytest.param(n, marks=pytest.mark.slow) if n in COVERED_BY_FAMILY else n for n in FORMAT_NAMES],
    scope="module",
)
def fmt_name(request):
    """Every registered format (``qf.list_formats()``), so a newly registered one is tested too;
    built-ins whose family has a representative run in the slow lane (thirdparty_harness.py)."""
    return request.param


def pytest_collection_modifyitems(config, items):
    """Deselects the step tests that :data:`thirdparty_harness.STEP_ROTATION` gives to other suites."""
    keep, drop = [], []
    for item in items:
        fmt_name = getattr(item, "callspec", None) and item.callspec.params.get("fmt_name")
        ok = not fmt_name or runs_step(item.module.__name__.rpartition(".")[2], item.originalname, fmt_name)
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
