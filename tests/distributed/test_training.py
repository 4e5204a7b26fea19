"""Data-parallel and tensor-parallel (megatron column/row split) training steps of an MLP and of a
GPT-style transformer block under ``jit(scalify(...))`` on a 2x4 mesh equal the single-device result."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dist_common import (
    AXES,
    BLOCK_FORMATS,
    BLOCK_SPECS,
    BLOCK_TP_PARAMS,
    DP_SPECS,
    TP_SPECS,
    block_inputs,
    block_loss,
    block_train_step,
    explicit,
    format_step,
    megatron_ops,
    mesh_2x4,
    mlp_data,
    named,
    scaled_params,
    train_step,
    values,
)
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
    ref = values(jax.jit(jsa.scalify(train_step))(sp, sx, jnp.asarray(y)))  # single device
    # Explicit axes, row-split w2: the program says how the sum over "m" is laid out (by the batch).
    out_sharding = named(mesh, specs["y"]) if explicit(mesh) and specs is TP_SPECS else None
    step = jsa.scalify(functools.partial(train_step, out_sharding=out_sharding))

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


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("fmt", [None, qf.MXFP8], ids=["carrier", "mxfp8"])
@pytest.mark.parametrize("mode", ["data-parallel", "tensor-parallel"])
def test_mlp_step_matches_single_device(fmt, mode, axes):
    mesh = mesh_2x4(axes)
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


@pytest.mark.parametrize("axes", AXES)
def test_tensor_parallel_keeps_mx_scale_with_its_blocks(axes):
    mesh = mesh_2x4(axes)
    params, _, _ = mlp_data()
    sp = scaled_params(params, qf.MXFP8)
    placed = device_put(sp, {"w1": named(mesh, P(None, "m")), "w2": named(mesh, P("m", None))})
    # w1 is blocked along its columns: 128 / 4 = 32 columns per shard = one MX block each
    assert placed["w1"].scale.sharding.spec == P(None, "m")
    assert placed["w2"].scale.sharding.spec == P("m", None)


# -- the transformer block -------------------------------------------------------------------------
# Tolerances. The loss and the gradients are float32 carriers (formatted parameters decode exactly
# into float32 and every scale is a power of two), so the sharded and the single-device programs
# differ only in the order of float32 additions: partial matmuls summed by an all-reduce (row-split
# matmuls, batch-sharded weight gradients) and XLA's different tiling of the local reductions. A
# reordered float32 sum of n terms moves by at most ~n * 2^-24 of the sum of the magnitudes (n <= 256
# here: 1.5e-5), typically ~sqrt(n) times less; softmax and layer norm pass such differences on
# without amplifying them much. Measured (GSPMD and shard_map): at most 8e-7 of a tensor's largest
# magnitude. The bound, 1e-5 of it, leaves a margin of >10 and is ~100 times below every gradient.
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-5  # GRAD_ATOL is relative to the tensor's largest magnitude
# The updated parameters are re-quantized into their formats. Where the float32 update lands within
# ~1e-7 of a rounding boundary of the format, the two programs may round it to neighbouring grid
# points (and a per-tensor or block scale on a power-of-two boundary may flip): an element may then
# differ by one step of the format's grid (the coarser of the two results'), never more. Such flips
# are rare (float32 differences ~1e-7 relative; a float16 step is 2^-11 and an fp8 one 2^-4 of the
# value; measured: one float16 element of 16384 in the tensor-parallel run), so at most 0.1% of a
# tensor's elements may differ at all; the others must be bit-identical.
MAX_FLIP_FRACTION = 1e-3


@functools.cache
def _block_reference():
    """The same scalified step on one device (no shardings): ``(raw outputs, their float32 values)``."""
    _, sp, sx, y = block_inputs()
    out = jax.jit(jsa.scalify(block_train_step))(sp, sx, y)
    got = values(out)
    # the step is not a no-op: the gradients are ~100 times above the tolerance, and every held
    # parameter moved (fp8 grids are coarse next to one SGD update: not every element moves)
    assert min(np.max(np.abs(g)) for g in got[2].values()) > 1e-3
    held = values(sp)
    assert all(np.any(got[0][k] != held[k]) for k in held)
    return out, got


def _assert_close_grads(got_loss, got_grads):
    _, ref = _block_reference()
    np.testing.assert_allclose(got_loss, ref[1], rtol=GRAD_RTOL)
    for k, e in ref[2].items():
        np.testing.assert_allclose(got_grads[k], e, rtol=GRAD_RTOL, atol=GRAD_ATOL * np.max(np.abs(e)), err_msg=k)


def _assert_within_one_step(got, ref, got_value, ref_value, name):
    diff = np.abs(got_value.astype(np.float64) - ref_value)
    tol = np.maximum(format_step(got), format_step(ref)) * (1 + 1e-6)
    assert np.all(diff <= tol), f"{name}: {np.sum(diff > tol)} elements differ by more than one step of the format"
    assert np.count_nonzero(diff) <= MAX_FLIP_FRACTION * diff.size, f"{name}: {np.count_nonzero(diff)} flips"


# Each compilation of the block step takes seconds: every mode on the explicit mesh (jax.make_mesh's
# default), the tensor-parallel one (collectives inserted by GSPMD) on an auto mesh too.
BLOCK_CASES = [("data-parallel", "explicit"), ("tensor-parallel", "explicit"), ("tensor-parallel", "auto")]


@pytest.mark.parametrize("mode,axes", BLOCK_CASES, ids=[f"{m}-{a}" for m, a in BLOCK_CASES])
def test_transformer_block_step_matches_single_device(mode, axes):
    """Forward, backward and SGD update of a GPT-style block (layer norm, causal attention, GELU MLP,
    residuals) with FP16, FP8_E4M3 and MXFP8 parameters under jit(scalify(...)) on the 2x4 mesh."""
    mesh = mesh_2x4(axes)
    specs = BLOCK_SPECS[mode]
    _, sp, sx, y = block_inputs()
    # Explicit axes, row-split weights: the program says how their sums over "m" are laid out.
    out_sharding = named(mesh, P("d", None, None)) if explicit(mesh) and mode == "tensor-parallel" else None
    step = jsa.scalify(functools.partial(block_train_step, out_sharding=out_sharding))
    p_sh = {k: named(mesh, s) for k, s in specs["params"].items()}
    x_sh = named(mesh, specs["x"])
    in_sh = (jsa.scaled_sharding(sp, p_sh), jsa.scaled_sharding(sx, x_sh), x_sh)
    args = (jsa.device_put(sp, p_sh), jsa.device_put(sx, x_sh), jax.device_put(y, x_sh))
    new_shape, _, grads_shape = jax.eval_shape(step, *args)
    out_sh = (jsa.scaled_sharding(new_shape, p_sh), named(mesh, P()), jsa.scaled_sharding(grads_shape, p_sh))
    out = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh)(*args)
    got = values(out)

    _assert_close_grads(got[1], got[2])
    ref_out, ref = _block_reference()
    for k, new in out[0].items():
        # the parameters stay held in their format, laid out like the step's parameters
        assert new.fmt == BLOCK_FORMATS[k]
        assert new.data.sharding.is_equivalent_to(p_sh[k], new.data.ndim), k
        _assert_within_one_step(new, ref_out[0][k], got[0][k], ref[0][k], k)


def _megatron_shard_map(mesh, check_vma):
    """The block's loss and gradients in shard_map: batch over "d", Megatron over "m", scalified
    inside the shard, so scalify's psum rule sums the scaled partial outputs of the row-split
    matmuls (forward) and the scaled cotangents entering the column-split ones (backward)."""
    _, sp, sx, y = block_inputs()
    pspecs = jsa.scaled_sharding(sp, BLOCK_TP_PARAMS, mesh=mesh)
    xspec = jsa.scaled_sharding(sx, P("d"), mesh=mesh)

    def body(p, x, y):
        if check_vma:  # varying types make JAX insert Megatron's f and g (psum and its transpose)
            loss, grads = jax.value_and_grad(block_loss)(p, x, y, g=lambda v: jax.lax.psum(v, "m"))
        else:  # explicit f and g; grads of the weights held on every "d" shard are summed over "d"
            f, g = megatron_ops("m")
            loss, grads = jax.value_and_grad(block_loss)(p, x, y, f, g)
            grads = jax.lax.psum(grads, "d")
        # the mean over the 2 data shards; out as plain values (per-shard scales differ)
        return jax.lax.pmean(loss, "d"), jax.tree.map(lambda v: v / np.float32(2), grads)

    def run(p, x, y):
        loss, grads = jsa.scalify(body)(p, x, y)
        return jsa.asarray(loss), jsa.asarray(grads)

    in_specs = (pspecs, xspec, P("d"))
    fn = jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=(P(), BLOCK_TP_PARAMS), check_vma=check_vma)
    # Under explicit axes shard_map's inputs must already be laid out as in_specs says.
    args = jsa.device_put((sp, sx, y), (BLOCK_TP_PARAMS, P("d"), P("d")), mesh=mesh)
    return jax.jit(fn)(*args)


@pytest.mark.parametrize("axes", ["explicit"])
def test_transformer_block_megatron_in_shard_map(axes):
    loss, grads = _megatron_shard_map(mesh_2x4(axes), check_vma=False)
    _assert_close_grads(np.asarray(loss), {k: np.asarray(v) for k, v in grads.items()})


@pytest.mark.parametrize("axes", AXES)
def test_transformer_block_megatron_in_shard_map_with_vma_checking(axes):
    loss, grads = _megatron_shard_map(mesh_2x4(axes), check_vma=True)
    _assert_close_grads(np.asarray(loss), {k: np.asarray(v) for k, v in grads.items()})
