"""Fixtures of the third-party model suite; the harness itself is thirdparty_harness.py.

(It is imported by name from the test modules; a module named ``conftest`` would clash with the other
test folders' conftest modules.)
"""

from __future__ import annotations

import jax
import pytest
from thirdparty_harness import (
    COVERED_BY_FAMILY,
    FAMILY_REPRESENTATIVES,
    FORMAT_NAMES,
    ROTATION_EXEMPT,
    fast_lane_formats,
    runs_step,
)


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


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(config, items):
    """Deselects the step tests that :data:`thirdparty_harness.STEP_ROTATION` gives to other suites,
    then marks slow the (case, format) pairs that :func:`thirdparty_harness.fast_lane_formats`
    leaves to the slow lane."""
    keep, drop = [], []
    for item in items:
        fmt_name = _fmt_name(item)
        ok = not fmt_name or runs_step(item.module.__name__.rpartition(".")[2], item.originalname, fmt_name)
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    _rotate_formats(items)


def _fmt_name(item):
    """The item's ``fmt_name`` parameter, or None."""
    return getattr(item, "callspec", None) and item.callspec.params.get("fmt_name")


def _rotate_formats(items):
    """Groups the fast lane's format-parametrized items by test, numbers each test's cases (its other
    parameters) in collection order, and marks slow what the case's fast-lane formats exclude."""
    tests: dict[tuple, dict] = {}
    for item in items:
        fmt_name = _fmt_name(item)
        module = item.module.__name__.rpartition(".")[2]
        if fmt_name in FAMILY_REPRESENTATIVES and module not in ROTATION_EXEMPT and not item.get_closest_marker("slow"):
            case = tuple(sorted((k, repr(v)) for k, v in item.callspec.params.items() if k != "fmt_name"))
            test = tests.setdefault((module, item.originalname), {})
            test.setdefault(case, []).append((fmt_name, item))
    for cases in tests.values():
        present = {f for pairs in cases.values() for f, _ in pairs}
        formats = tuple(f for f in FAMILY_REPRESENTATIVES if f in present)
        for k, pairs in enumerate(cases.values()):
            fast = fast_lane_formats(k, len(cases), formats)
            for fmt_name, item in pairs:
                if fmt_name not in fast:
                    item.add_marker(pytest.mark.slow)
