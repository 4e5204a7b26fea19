"""tests/distributed needs 8 devices; JAX reads the device count once, when it initializes.

Run this folder with ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
tests/distributed`` (``tests/test_distributed.py`` does that, a subprocess per file, so the main
``python -m pytest`` run exercises it). Without the flag, every test here is skipped with that hint.
"""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP_REASON = (
    "needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
    "(tests/test_distributed.py runs each file here that way in a subprocess)"
)


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if os.path.abspath(str(it.fspath)).startswith(HERE + os.sep)]
    if not mine:
        return
    import jax

    if jax.device_count() >= 8:
        return
    for it in mine:
        it.add_marker(pytest.mark.skip(reason=SKIP_REASON))
