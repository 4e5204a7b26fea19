"""shard_map of scalified functions: collectives on scaled values, and the quantized all-gather."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dist_common import AXES, mesh_2x4
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from user_formats import DICT_MXFP8

import qformats as qf
import scalify as jsa
from scalify._sharding import scaled_sharding

PERM = [(i, (i + 1) % 4) for i in range(4)]
ROWS = P(("d", "m"), None)
# name -> (collective, out_specs); each shard holds 2 rows of a (16, 64) input
COLLECTIVES = {
    "psum": (lambda v: jax.lax.psum(v, "m"), P("d", None)),
    "pmax": (lambda v: jax.lax.pmax(v, "m"), P("d", None)),
    "pmin": (lambda v: jax.lax.pmin(v, "m"), P("d", None)),
    "all_gather": (lambda v: jax.lax.all_gather(v, "m", axis=0, tiled=True), P("d", None)),
    "all_gather_untiled": (lambda v: jax.lax.all_gather(v, "m", axis=1, tiled=False), P("d", None)),
    "ppermute": (lambda v: jax.lax.ppermute(v, "m", PERM), ROWS),
    "all_to_all": (lambda v: jax.lax.all_to_all(v, "m", 1, 0, tiled=True), ROWS),
    "psum_scatter": (lambda v: jax.lax.psum_scatter(v, "m", scatter_dimension=1, tiled=True), P("d", "m")),
}
FORMATS = {
    "carrier": None,
    "mxfp8": qf.MXFP8,
    "fp8_per_tensor": qf.FP8_E4M3,
    "int8_per_channel": qf.INT8_PER_CHANNEL,
    "user_dict_mxfp8": DICT_MXFP8,
}
CASES = [(n, f) for n in COLLECTIVES for f in FORMATS if f != "int8_per_channel" or n in ("psum", "all_to_all")]
# every case on the explicit mesh (jax.make_mesh's default); on an auto mesh, every collective on MXFP8
CASES = [(n, f, "explicit") for n, f in CASES] + [(n, "mxfp8", "auto") for n in COLLECTIVES]


def _input(mesh=None, spec=ROWS):
    """Rows of very different magnitudes: every shard quantizes with its own (different) scales.

    With a mesh, laid out as ``spec`` (shard_map's in_specs must match the input's sharding under
    explicit mesh axes; under auto ones, it moves the input itself)."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(16, 64)) * 2.0 ** np.arange(-8, 8)[:, None]).astype(np.float32)
    return x if mesh is None else jax.device_put(x, NamedSharding(mesh, spec))


def _quantize(v, fmt):
    if fmt is None:
        return jsa.as_scaled_array(v, scale=jnp.max(jnp.abs(v)))  # a per-shard, data-dependent scale
    return jsa.as_scaled_array(v, fmt=fmt)


@pytest.mark.parametrize("name,fmt_name,axes", CASES, ids=[f"{n}-{f}-{a}" for n, f, a in CASES])
def test_collective_on_per_shard_scaled_values(name, fmt_name, axes):
    fmt = FORMATS[fmt_name]
    coll, out_spec = COLLECTIVES[name]
    mesh = mesh_2x4(axes)
    x = _input(mesh)

    def scaled(v):  # quantize inside the shard, run the scalified collective
        out = jsa.scalify(coll)(_quantize(v, fmt))
        assert isinstance(out, jsa.ScaledArray)
        return out.to_array(jnp.float32)

    def plain(v):  # the same collective on the dequantized shard values
        return coll(_quantize(v, fmt).to_array(jnp.float32))

    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ROWS, out_specs=out_spec, check_vma=False))(x)
    got, want = np.asarray(run(scaled)), np.asarray(run(plain))
    # Scales are powers of two, so rescaling to the common scale is exact in float32; psum and
    # psum_scatter add in a different order (pre-scaled by 1/2 for n = 4): a few ulps.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("axes", AXES)
def test_psum_of_mx_values_with_different_shard_scales(axes):
    """The shards' block scales differ by up to 2**15; the sum must not use any one shard's scale."""
    mesh = mesh_2x4(axes)
    x = _input()
    sx = jsa.as_scaled_array(jnp.asarray(x), fmt=qf.MXFP8)
    specs = scaled_sharding(sx, P("m", None), mesh=mesh)
    placed = jsa.device_put(sx, P("m", None), mesh=mesh)  # data and scales laid out as in_specs says

    def f(s):
        out = jsa.scalify(lambda v: jax.lax.psum(v, "m"))(s)
        return out.to_array(jnp.float32)

    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False))(placed)
    want = np.asarray(sx.to_array(jnp.float32)).reshape(4, 4, 64).sum(0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    scales = np.asarray(qf.MXFP8.scale_values(sx.scale)).reshape(4, 4, 2)
    assert scales.max(0).min() / scales.min(0).max() >= 2.0**8  # the shards really differ


VMA_CASES = [(n, "explicit") for n in ["psum", "pmax", "ppermute", "all_to_all", "psum_scatter"]] + [("psum", "auto")]


@pytest.mark.parametrize("name,axes", VMA_CASES, ids=[f"{n}-{a}" for n, a in VMA_CASES])
def test_collectives_with_vma_checking(name, axes):
    """shard_map's default check_vma=True (the pvary casts it inserts have a rule too)."""
    coll, out_spec = COLLECTIVES[name]
    mesh = mesh_2x4(axes)
    x = _input(mesh)

    def scaled(v):
        return jsa.scalify(coll)(_quantize(v, qf.MXFP8)).to_array(jnp.float32)

    def plain(v):
        return coll(_quantize(v, qf.MXFP8).to_array(jnp.float32))

    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ROWS, out_specs=out_spec))(x)
    np.testing.assert_allclose(np.asarray(run(scaled)), np.asarray(run(plain)), rtol=1e-6, atol=1e-6 * np.abs(x).max())


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("fmt_name", ["carrier", "mxfp8"])
def test_arithmetic_with_replicated_operands_under_vma_checking(fmt_name, axes):
    """A varying scaled value meeting constants and replicated arrays: scalify traces its function on
    avals that keep shard_map's varying axes, so JAX inserts the pvary casts the operations need."""
    mesh = mesh_2x4(axes)
    x = _input(mesh)
    w = jax.device_put(jnp.linspace(0.5, 1.5, x.shape[1], dtype=jnp.float32), NamedSharding(mesh, P()))
    f = lambda a, b: (a * 2.0 + b) / 3.0 - jnp.mean(a, axis=-1, keepdims=True)

    def scaled(v, b):
        return jsa.scalify(f)(_quantize(v, FORMATS[fmt_name]), b).to_array(jnp.float32)

    def plain(v, b):
        return f(_quantize(v, FORMATS[fmt_name]).to_array(jnp.float32), b)

    run = lambda g: jax.jit(jax.shard_map(g, mesh=mesh, in_specs=(ROWS, P()), out_specs=ROWS))(x, w)
    # float32 carriers with power-of-two scales: a few ulps of the largest value.
    np.testing.assert_allclose(np.asarray(run(scaled)), np.asarray(run(plain)), rtol=1e-6, atol=1e-6 * np.abs(x).max())


_BYTES = {"u8": 1, "s8": 1, "pred": 1, "f16": 2, "bf16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8}


def _all_gather_bytes(hlo: str) -> int:
    """Total bytes of the results of every all-gather in an HLO module (fp8 types count 1 byte)."""
    total = 0
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s+all-gather(?:-start)?\(", line)
        if not m:
            continue
        for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1)):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            total += n * (1 if dt.startswith("f8") else _BYTES[dt])
    return total


def _fsdp_gather_bytes(w, mesh):
    spec_w = scaled_sharding(w, ROWS, mesh=mesh)  # data and scale rows split over all 8 devices
    w = jsa.device_put(w, ROWS, mesh=mesh)

    def f(wshard, x):
        full = jsa.scalify(lambda v: jax.lax.all_gather(v, ("d", "m"), axis=0, tiled=True))(wshard)
        return x @ jsa.asarray(full)

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec_w, P()), out_specs=P(), check_vma=False))
    x = jnp.ones((4, w.shape[0]), jnp.float32)
    hlo = fn.lower(w, x).compile().as_text()
    out = np.asarray(fn(w, x))
    want = np.ones((4, w.shape[0]), np.float32) @ np.asarray(jsa.asarray(w))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    return _all_gather_bytes(hlo)


@pytest.mark.parametrize("axes", AXES)
def test_quantized_all_gather_moves_mxfp8_bytes(axes):
    """FSDP-style: gathering MXFP8 weights moves 1 + 1/32 bytes per element (fp8 data + E8M0 scales)."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(256, 512)).astype(np.float32))
    n = w.size
    mesh = mesh_2x4(axes)
    mx_bytes = _fsdp_gather_bytes(jsa.as_scaled_array(w, fmt=qf.MXFP8), mesh)
    f32_bytes = _fsdp_gather_bytes(jsa.as_scaled_array(w, scale=np.float32(1.0)), mesh)
    print(f"all-gather bytes/element: MXFP8 {mx_bytes / n:.4f}, float32 carrier {f32_bytes / n:.4f}")
    assert mx_bytes / n == pytest.approx(1 + 1 / 32, abs=1e-3)
    assert f32_bytes / n == pytest.approx(4.0, abs=1e-3)


# Groups over "m" listed out of order: the k-th member of a group receives the k-th chunk.
GROUPS = [[0, 2], [3, 1]]


def _block_grid(v):
    """A carrier whose scale is a (2, 4) block grid (blocks of 1 x 16), per-shard and data-dependent."""
    amax = jnp.max(jnp.abs(v.reshape(2, 4, 16)), axis=-1)
    return jsa.as_scaled_array(v, scale=jnp.maximum(amax, np.float32(1e-30)))


_MAKERS = {"mxfp8": lambda v: jsa.as_scaled_array(v, fmt=qf.MXFP8), "grid": _block_grid}
SCATTER_CASES = [(m, t, "explicit") for m in _MAKERS for t in (True, False)] + [("mxfp8", True, "auto")]


@pytest.mark.parametrize(
    "make,tiled,axes", SCATTER_CASES, ids=[f"{m}-{'tiled' if t else 'untiled'}-{a}" for m, t, a in SCATTER_CASES]
)
def test_psum_scatter_of_block_scaled_value_with_axis_index_groups(make, tiled, axes):
    """Each shard keeps the scale blocks of the chunk its position in its group receives."""
    make = _MAKERS[make]
    mesh = mesh_2x4(axes)
    x = _input(mesh)
    # per shard (2, 64): tiled scatters the 64 columns (2 MX blocks, 4 grid blocks) into 2 chunks;
    # untiled scatters the 2 rows (the scattered axis must have the group's size)
    dim = 1 if tiled else 0
    coll = lambda v: jax.lax.psum_scatter(v, "m", scatter_dimension=dim, axis_index_groups=GROUPS, tiled=tiled)

    def scaled(v):
        out = jsa.scalify(coll)(make(v))
        assert isinstance(out, jsa.ScaledArray) and jnp.ndim(out.scale) > 0  # the block-scaled path
        return out.to_array(jnp.float32)

    def plain(v):
        return coll(make(v).to_array(jnp.float32))

    out_spec = P(("d", "m"), None) if tiled else P(("d", "m"))
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ROWS, out_specs=out_spec, check_vma=False))(x)
    got, want = np.asarray(run(scaled)), np.asarray(run(plain))
    # as above: power-of-two rescaling is exact, the sum of 2 (pre-scaled by 1/2) in another order
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(want))))
