"""Runs each file of tests/distributed in a subprocess with 8 virtual CPU devices.

JAX fixes the device count when it initializes, and the rest of the suite runs with one device, so
the distributed tests (sharding, shard_map collectives, quantized all-gather, multi-process) get a
fresh interpreter with ``--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


DISTRIBUTED = sorted(p.name for p in (ROOT / "tests" / "distributed").glob("test_*.py"))


# One subprocess per file, each in one process (``-n 0``): pytest-xdist spreads the files over its
# workers, where one subprocess running them all held one worker for minutes.
@pytest.mark.parametrize("name", DISTRIBUTED)
def test_distributed_suite_on_8_cpu_devices(name):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "distributed" / name),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail
