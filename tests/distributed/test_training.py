"""Data-parallel and tensor-parallel (megatron column/row split) MLP training steps under
``jit(scalify(...))`` on a 2x4 mesh equal the single-device result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dist_common import DP_SPECS, TP_SPECS, mesh_2x4, mlp_data, named, scaled_params, train_step, values
from jax.sharding import PartitionSpec as P

import qformats as qf
import scalify as jsa
from scalify._sharding import device_put, scaled_sharding

# Tolerance: every value is float32 (the carrier dtype of both forms) and all scales are powers of
# two, so the sharded and single-device programs differ only in the order of float32 sums
# (partial matmuls + all-reduce): a few ulps of the largest magnitude.
RTOL, ATOL = 2e-5, 2e-6


def _run(fmt, specs, mesh):
    params, x, y = mlp_data()
    sp = scaled_params(params, fmt)
    sx = jsa.as_scaled_array(jnp.asarray(x), scale=np.float32(2.0))
    step = jsa.scalify(train_step)
    ref = values(jax.jit(step)(sp, sx, jnp.asarray(y)))  # single device

    pspec = specs["params"]
    in_sh = (
        scaled_sharding(sp, in_sh_params_spec(mesh, pspec)),
        scaled_sharding(sx, named(mesh, specs["x"])),
        named(mesh, specs["y"]),
    )
    args = (jax.device_put(sp, in_sh[0]), jax.device_put(sx, in_sh[1]), jax.device_put(jnp.asarray(y), in_sh[2]))
    out_shape = jax.eval_shape(step, *args)
    out_sh = (scaled_sharding(out_shape[0], in_sh_params_spec(mesh, pspec)), named(mesh, P()))
    out = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh)(*args)
    return out, ref


def in_sh_params_spec(mesh, pspec):
    return named(mesh, pspec) if isinstance(pspec, P) else jax.tree.map(lambda s: named(mesh, s), pspec)


@pytest.mark.parametrize("fmt", [None, qf.MXFP8], ids=["carrier", "mxfp8"])
@pytest.mark.parametrize("mode", ["data-parallel", "tensor-parallel"])
def test_mlp_step_matches_single_device(fmt, mode):
    mesh = mesh_2x4()
    specs = DP_SPECS if mode == "data-parallel" else TP_SPECS
    out, ref = _run(fmt, specs, mesh)
    got = values(out)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL), got, ref)
    # the updated parameters keep the parameter layout (data and scale)
    new = out[0]
    if mode == "tensor-parallel":
        assert new["w1"].data.sharding.spec == P(None, "m")
        assert new["w2"].data.sharding.spec == P("m", None)
    # the step changed the parameters (the test would notice a no-op)
    params, _, _ = mlp_data()
    assert np.max(np.abs(got[0]["w1"] - params["w1"])) > 1e-4


def test_tensor_parallel_keeps_mx_scale_with_its_blocks():
    mesh = mesh_2x4()
    params, _, _ = mlp_data()
    sp = scaled_params(params, qf.MXFP8)
    placed = device_put(sp, {"w1": named(mesh, P(None, "m")), "w2": named(mesh, P("m", None))})
    # w1 is blocked along its columns: 128 / 4 = 32 columns per shard = one MX block each
    assert placed["w1"].scale.sharding.spec == P(None, "m")
    assert placed["w2"].scale.sharding.spec == P("m", None)
