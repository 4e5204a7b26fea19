"""One process of the two-process data-parallel test (launched by test_multiprocess.py).

Usage: python _mp_worker.py PROCESS_ID PORT OUT.npz FMT AXES   (FMT: carrier | mxfp8; AXES: explicit | auto)
Each process has 4 CPU devices; together they form the 2x4 mesh; the batch is split across them.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

pid, port, out_path, fmt_name, axes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _dist_common import DP_SPECS, mesh_2x4, mlp_data, named, scaled_params, train_step  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import qformats as qf  # noqa: E402
import scalify as jsa  # noqa: E402
from scalify._sharding import scaled_sharding  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
mesh = mesh_2x4(axes)
params, x, y = mlp_data()
sp = scaled_params(params, {"carrier": None, "mxfp8": qf.MXFP8}[fmt_name])
sx = jsa.as_scaled_array(jnp.asarray(x), scale=np.float32(2.0))


def global_array(tree, sharding_tree):
    """Build global arrays from the (identical) host copy every process holds."""

    def one(leaf, sh):
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree.map(one, tree, sharding_tree)


in_sh = (
    scaled_sharding(sp, named(mesh, DP_SPECS["params"])),
    scaled_sharding(sx, named(mesh, DP_SPECS["x"])),
    named(mesh, DP_SPECS["y"]),
)
args = (global_array(sp, in_sh[0]), global_array(sx, in_sh[1]), global_array(jnp.asarray(y), in_sh[2]))
step = jsa.scalify(train_step)
out_shape = jax.eval_shape(step, *args)
out_sh = (scaled_sharding(out_shape[0], named(mesh, P())), named(mesh, P()))
new, loss = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh)(*args)
vals = {k: np.asarray(v.to_array(jnp.float32)) for k, v in new.items()}  # replicated: addressable here
np.savez(out_path, loss=np.asarray(loss), **vals)
jax.distributed.shutdown()
print(f"process {pid} done", flush=True)
