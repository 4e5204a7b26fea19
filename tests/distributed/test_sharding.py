"""scaled_sharding / device_put: data and scale laid out consistently under jax.sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dist_common import AXES, explicit, mesh_2x4
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from user_formats import DICT_MXFP8

import qformats as qf
import scalify as jsa
from scalify._sharding import device_put, scaled_sharding


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=shape).astype(np.float32) * np.float32(3.0))


def _check_shards_consistent(sa):
    """Every device's (data, scale) shard dequantizes to that device's slice of the value."""
    full = np.asarray(sa.to_array(jnp.float32))
    scale_leaves = jax.tree.leaves(sa.scale)
    shards = sa.data.addressable_shards
    for dshard in (shards[0], shards[-1]):  # two devices suffice (and keep the test fast)
        dev = dshard.device
        sshards = [next(s for s in leaf.addressable_shards if s.device == dev) for leaf in scale_leaves]
        local_scale = jax.tree.unflatten(jax.tree.structure(sa.scale), [s.data for s in sshards])
        local = jsa.ScaledArray(dshard.data, local_scale, fmt=sa.fmt, dtype=sa.dtype if sa.fmt else None)
        # the logical slice of this shard: data index, unpacked on packed axes
        idx = []
        for ax, sl in enumerate(dshard.index):
            ratio = full.shape[ax] // sa.data.shape[ax]
            start = (sl.start or 0) * ratio
            stop = (sl.stop if sl.stop is not None else sa.data.shape[ax]) * ratio
            idx.append(slice(start, stop))
        np.testing.assert_array_equal(np.asarray(local.to_array(jnp.float32)), full[tuple(idx)])


CASES = [
    # (name, fmt, shape, spec, expected scale spec)
    ("carrier per-tensor", None, (16, 256), P("d", "m"), P()),
    ("fp8 per-tensor", qf.FP8_E4M3, (16, 256), P("d", "m"), P()),
    ("int8 per-channel (channel axis sharded)", qf.INT8_PER_CHANNEL, (16, 256), P("d", "m"), P(None, "m")),
    ("int8 per-channel (other axis sharded)", qf.INT8_PER_CHANNEL, (16, 256), P("m", None), P(None, None)),
    ("mxfp8 blocked axis sharded", qf.MXFP8, (16, 256), P("d", "m"), P("d", "m")),
    ("mxfp4 packed", qf.MXFP4, (16, 256), P("d", "m"), P("d", "m")),
    ("user format, dict scale", DICT_MXFP8, (16, 256), P("d", "m"), P("d", "m")),
]


# every case on the explicit mesh (jax.make_mesh's default), the blocked and packed ones on an auto mesh too
PUT_CASES = [(*c, "explicit") for c in CASES] + [
    (*c, "auto") for c in CASES if c[1] in (qf.MXFP8, qf.MXFP4, DICT_MXFP8)
]


@pytest.mark.parametrize("name,fmt,shape,spec,scale_spec,axes", PUT_CASES, ids=[f"{c[0]}-{c[-1]}" for c in PUT_CASES])
def test_device_put_places_data_and_scale(name, fmt, shape, spec, scale_spec, axes):
    mesh = mesh_2x4(axes)
    x = _x(shape)
    sa = jsa.as_scaled_array(x, scale=np.float32(2.0)) if fmt is None else jsa.as_scaled_array(x, fmt=fmt)
    placed = device_put(sa, NamedSharding(mesh, spec))
    assert placed.data.sharding.spec == spec
    for leaf in jax.tree.leaves(placed.scale):
        assert P(*tuple(leaf.sharding.spec)) == P(*tuple(scale_spec)) or (
            leaf.sharding.is_fully_replicated and all(e is None for e in scale_spec)
        )
    _check_shards_consistent(placed)


@pytest.mark.parametrize("axes", AXES)
def test_nvfp4_block_and_tensor_scale(axes):
    mesh = mesh_2x4(axes)
    sa = jsa.as_scaled_array(_x((64, 256)), fmt=qf.NVFP4)
    sh = scaled_sharding(sa, NamedSharding(mesh, P("d", "m")))
    assert sh.scale.block.spec == P("d", "m") and sh.scale.tensor.spec == P()
    placed = device_put(sa, NamedSharding(mesh, P("d", "m")))
    assert placed.data.shape == (64, 128)  # packed fp4 bytes, sharded on whole bytes
    assert placed.scale.tensor.sharding.is_fully_replicated
    _check_shards_consistent(placed)


@pytest.mark.parametrize("axes", ["explicit"])  # spec logic only: the axis type does not enter
def test_split_block_is_a_clear_error(axes):
    mesh = mesh_2x4(axes)
    sa = jsa.as_scaled_array(_x((8, 64)), fmt=qf.MXFP8)  # 64 / 4 = 16 < block of 32
    with pytest.raises(ValueError, match=r"axis 1.*length 16.*block of 32"):
        scaled_sharding(sa, NamedSharding(mesh, P(None, "m")))
    # PartitionSpecs (shard_map in_specs) are checked against an explicit mesh too
    with pytest.raises(ValueError, match="length 16"):
        scaled_sharding(sa, P(None, "m"), mesh=mesh)


@pytest.mark.parametrize("axes", ["explicit"])  # spec logic only: the axis type does not enter
def test_packed_bytes_must_not_split(axes):
    mesh = mesh_2x4(axes)
    sa = jsa.as_scaled_array(_x((8, 64)), fmt=qf.MXFP6_E2M3)  # 48 packed bytes along axis 1; 2 blocks
    scaled_sharding(sa, NamedSharding(mesh, P(None, "d")))  # 32 elements each: ok
    with pytest.raises(ValueError, match="length 16"):
        scaled_sharding(sa, NamedSharding(mesh, P(None, "m")))


@pytest.mark.parametrize("axes", AXES)
def test_pytree_prefix_and_jit_shardings(axes):
    mesh = mesh_2x4(axes)
    tree = {
        "w": jsa.as_scaled_array(_x((64, 256)), fmt=qf.MXFP8),
        "b": _x((256,), 1),
        "s": jsa.as_scaled_array(_x((64, 256), 2), scale=np.float32(4.0)),
    }
    shard = {"w": NamedSharding(mesh, P(None, "m")), "b": NamedSharding(mesh, P("m")), "s": NamedSharding(mesh, P("d"))}
    shardings = scaled_sharding(tree, shard)
    placed = device_put(tree, shard)

    def f(t):
        return jsa.scalify(lambda w, b, s: jax.nn.relu(w + b + s))(t["w"], t["b"], t["s"])

    out_shape = jax.eval_shape(f, placed)
    out_sh = scaled_sharding(out_shape, NamedSharding(mesh, P("d", "m")))
    out = jax.jit(f, in_shardings=(shardings,), out_shardings=out_sh)(placed)
    assert out.data.sharding.spec == P("d", "m")
    ref = jax.nn.relu(tree["w"].to_array() + tree["b"] + tree["s"].to_array())
    np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(ref), rtol=1e-6, atol=1e-6)
    if jnp.ndim(out.scale) == 0:
        assert out.scale.sharding.is_fully_replicated
    else:
        _check_shards_consistent(out)


@pytest.mark.parametrize("axes", ["explicit"])  # spec logic only: the axis type does not enter
def test_partition_specs_for_shard_map(axes):
    sa = jsa.as_scaled_array(_x((64, 256)), fmt=qf.MXFP8)
    specs = scaled_sharding({"w": sa, "p": _x((4,))}, P("d", "m"), mesh=mesh_2x4(axes))
    assert specs["w"].data == P("d", "m") and specs["w"].scale == P("d", "m") and specs["p"] == P("d", "m")


@pytest.mark.parametrize("axes", AXES)
def test_sharding_constraint_lays_out_the_scale_with_its_blocks(axes):
    """``with_sharding_constraint`` (``reshard`` on an explicit mesh) inside scalify: the block
    scales follow the data's layout (``scaled_sharding``), as docs/distributed.md says; they are
    not replicated."""
    mesh = mesh_2x4(axes)
    spec = P("d", None)
    sx = jsa.as_scaled_array(_x((64, 128)), fmt=qf.MXFP8)
    constrain = jax.sharding.reshard if explicit(mesh) else jax.lax.with_sharding_constraint

    def f(v):
        return constrain(v * 2.0, NamedSharding(mesh, spec))

    with jax.set_mesh(mesh):
        out = jax.jit(jsa.scalify(f))(sx)
    assert out.scale.shape == (64, 4)
    want = scaled_sharding(out, spec, mesh=mesh).scale
    assert out.scale.sharding.is_equivalent_to(NamedSharding(mesh, want), out.scale.ndim)
    assert not out.scale.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out), 2.0 * np.asarray(sx))


@pytest.mark.parametrize("axes", AXES)
def test_device_put_inside_scalify_lays_out_the_scale_with_its_blocks(axes):
    """``jax.device_put(x, NamedSharding)`` inside the scalified function (a layout written in the
    model) moves the block scales with their blocks, as ``with_sharding_constraint`` does: the
    rule puts the scale on the matching sharding; on an explicit mesh the output keeps it (on an
    auto mesh XLA chooses the jitted output's layout, for plain arrays too)."""
    mesh = mesh_2x4(axes)
    spec = P("d", None)
    sx = jsa.as_scaled_array(_x((64, 128)), fmt=qf.MXFP8)

    def f(v):
        return jax.device_put(v * 2.0, NamedSharding(mesh, spec))

    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jsa.scalify(f))(sx)
        out = jax.jit(jsa.scalify(f))(sx)
    (put,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "device_put"]
    want = NamedSharding(mesh, scaled_sharding(out, spec, mesh=mesh).scale)
    assert put.params["devices"][0].is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert put.params["devices"][1].is_equivalent_to(want, 2) and not want.is_fully_replicated
    if explicit(mesh):
        assert out.scale.sharding.is_equivalent_to(want, out.scale.ndim)
    np.testing.assert_array_equal(np.asarray(out), 2.0 * np.asarray(sx))
