"""Two processes on localhost (jax.distributed.initialize, gloo CPU collectives) run a scalified
data-parallel step; the result equals the one-process result."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dist_common import mlp_data, scaled_params, train_step, values

import qformats as qf
import scalify as jsa

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# both formats on the explicit mesh (jax.make_mesh's default), the carrier on an auto mesh too
MP_CASES = [("carrier", "explicit"), ("mxfp8", "explicit"), ("carrier", "auto")]


@pytest.mark.parametrize("fmt_name,axes", MP_CASES, ids=[f"{f}-{a}" for f, a in MP_CASES])
def test_two_process_data_parallel_step(tmp_path, fmt_name, axes):
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    outs = [tmp_path / f"p{i}.npz" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_mp_worker.py"), str(i), str(port), str(outs[i]), fmt_name, axes],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"

    params, x, y = mlp_data()
    sp = scaled_params(params, {"carrier": None, "mxfp8": qf.MXFP8}[fmt_name])
    sx = jsa.as_scaled_array(jnp.asarray(x), scale=np.float32(2.0))
    ref_new, ref_loss = values(jax.jit(jsa.scalify(train_step))(sp, sx, jnp.asarray(y)))
    for path in outs:
        got = np.load(path)
        np.testing.assert_allclose(got["loss"], ref_loss, rtol=2e-5)
        for k in ("w1", "w2"):
            np.testing.assert_allclose(got[k], ref_new[k], rtol=2e-5, atol=2e-6)
