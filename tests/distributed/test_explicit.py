"""Explicit mesh axes (``jax.make_mesh``'s default): the sharding is part of each array's type.

Regression tests for what raised ``ShardingTypeError`` on an explicit mesh: the reshapes of the MX
and NVFP4 quantize / dequantize paths (JAX infers a reshape's output sharding for one split or merge
of an axis only), scalify tracing a ScaledArray as an unsharded value (constants and broadcasts of
the traced program then disagree with the sharded data), and the quantized all-gather over one
axis of a mesh whose other axis stays explicit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dist_common import mesh_2x4
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from user_formats import DICT_MXFP8

import qformats as qf
import scalify as jsa

FORMATS = {
    "mxfp8": qf.MXFP8,
    "mxfp4": qf.MXFP4,
    "mxfp6-axis0": qf.MXFP6_E2M3.replace(axis=0),
    "nvfp4": qf.NVFP4,
    "fp8": qf.FP8_E4M3,
    "int8_per_channel": qf.INT8_PER_CHANNEL,
    "user_dict_mxfp8": DICT_MXFP8,
}


def _x(shape=(64, 256), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * 2.0 ** rng.integers(-6, 6, size=shape)).astype(np.float32)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_and_dequantize_sharded_input_bit_exact(name):
    """jit(quantize) and jit(dequantize) of an explicitly sharded array: the bytes and the values of
    the unsharded computation, and the scale laid out with its blocks (as scaled_sharding says)."""
    fmt = FORMATS[name]
    mesh = mesh_2x4()
    x = _x()
    sharding = NamedSharding(mesh, P("d", "m"))
    want = jsa.as_scaled_array(jnp.asarray(x), fmt=fmt)
    got = jax.jit(lambda v: jsa.as_scaled_array(v, fmt=fmt))(jax.device_put(x, sharding))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.atleast_1d(g).view(np.uint8), np.atleast_1d(w).view(np.uint8))
    assert got.data.sharding.spec == P("d", "m")
    expected = jsa.scaled_sharding(want, sharding)
    for g, e in zip(jax.tree.leaves(got.scale), jax.tree.leaves(expected.scale), strict=True):
        assert g.sharding.is_equivalent_to(e, g.ndim), (g.sharding, e)
    placed = jsa.device_put(want, sharding)
    value = jax.jit(lambda s: s.to_array(jnp.float32))(placed)
    assert value.sharding.spec == P("d", "m")
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want.to_array(jnp.float32)))


def test_scalified_step_with_replicated_weights_and_sharded_batch():
    """The scalified program is traced on avals carrying the data's sharding: the zeros of relu's
    derivative, and the weight gradient's reduction over the sharded batch, are laid out like the
    plain program's (they were unsharded, and select_n / dot_general refused the mix)."""
    mesh = mesh_2x4()
    rng = np.random.default_rng(0)
    w = jsa.as_scaled_array(jnp.asarray(rng.normal(size=(64, 32)).astype(np.float32)), fmt=qf.MXFP8)
    x = jsa.as_scaled_array(jnp.asarray(rng.normal(size=(16, 64)).astype(np.float32)), scale=np.float32(2.0))

    def loss(w, x):
        return jnp.mean(jax.nn.relu(x @ w) ** 2)

    step = jsa.scalify(jax.grad(loss))
    want = np.asarray(jax.jit(step)(w, x).to_array(jnp.float32))
    args = jsa.device_put((w, x), (NamedSharding(mesh, P()), NamedSharding(mesh, P(("d", "m")))))
    got = jax.jit(step)(*args)
    np.testing.assert_allclose(np.asarray(got.to_array(jnp.float32)), want, rtol=2e-6, atol=1e-7)


def test_logical_aval_carries_the_data_sharding():
    """scalify traces the function on the data's sharding: what jax.typeof sees inside is sharded."""
    mesh = mesh_2x4()
    sa = jsa.device_put(jsa.as_scaled_array(jnp.asarray(_x()), fmt=qf.MXFP8), NamedSharding(mesh, P("d", "m")))
    seen = []

    def f(v):
        seen.append(jax.typeof(v).sharding.spec)
        return v * 2.0

    jax.jit(jsa.scalify(f))(sa)
    assert seen == [P("d", "m")]


@pytest.mark.parametrize("fmt", [qf.MXFP8, qf.FP8_E4M3], ids=["mxfp8", "fp8"])
def test_quantized_all_gather_over_one_axis_of_an_explicit_mesh(fmt):
    """FSDP over "m" inside shard_map while "d" stays explicit: the gathered MXFP8 bytes decode with
    the blocked axis still sharded over "d"."""
    mesh = mesh_2x4()
    sa = jsa.as_scaled_array(jnp.asarray(_x()), fmt=fmt)
    placed = jsa.device_put(sa, NamedSharding(mesh, P("m", "d")))

    def body(v):
        full = jsa.scalify(lambda u: jax.lax.all_gather(u, "m", axis=0, tiled=True))(v)
        return full.to_array(jnp.float32)

    specs = jsa.scaled_sharding(sa, P("m"), mesh=mesh)
    f = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=P(), axis_names={"m"}, check_vma=False)
    got = jax.jit(f)(placed)
    assert jax.typeof(got).sharding.spec == P(None, "d")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(sa.to_array(jnp.float32)))


def test_reshard_of_a_scaled_value_moves_its_scale():
    mesh = mesh_2x4()
    sa = jsa.device_put(jsa.as_scaled_array(jnp.asarray(_x()), fmt=qf.MXFP8), NamedSharding(mesh, P("m", "d")))
    out = jax.jit(jsa.scalify(lambda u: jax.sharding.reshard(u, NamedSharding(mesh, P(None, "m")))))(sa)
    assert out.data.sharding.spec == P(None, "m") and out.scale.sharding.spec == P(None, "m")
    np.testing.assert_array_equal(np.asarray(out.to_array(jnp.float32)), np.asarray(sa.to_array(jnp.float32)))


def test_device_put_of_partition_specs():
    """PartitionSpecs (as shard_map's in_specs) are placed on ``mesh`` or on the mesh of jax.set_mesh;
    without either, a clear error says what to pass."""
    mesh = mesh_2x4()
    sa = jsa.as_scaled_array(jnp.asarray(_x()), fmt=qf.MXFP8)
    placed = jsa.device_put(sa, P("d", "m"), mesh=mesh)
    assert placed.data.sharding == NamedSharding(mesh, P("d", "m"))
    assert placed.scale.sharding == NamedSharding(mesh, P("d", "m"))
    with jax.set_mesh(mesh):
        assert jsa.device_put(sa, P("d")).scale.sharding.is_equivalent_to(NamedSharding(mesh, P("d")), 2)
    with pytest.raises(ValueError, match=r"no mesh to place them on: pass mesh="):
        jsa.device_put(sa, P("d"))


@pytest.mark.parametrize("name", ["mxfp8", "float8_rowwise", "nvfp4"])
def test_recipe_gradients_on_an_explicit_mesh(name):
    """``recipes.apply`` under ``jax.grad`` with a sharded batch and column-sharded weight: the
    backward GEMMs are transposed at their operands' shardings (it raised "cotangent type does not
    match" before), and the gradients are the unsharded program's. NVFP4 without stochastic
    rounding: its key hashes ``dy``, whose last bits depend on how XLA splits the work."""
    from scalify import recipes

    recipe = recipes.BUILTINS[name]
    if recipe.stochastic_rounding:
        recipe = recipe.replace(stochastic_rounding=())
    mesh = mesh_2x4()
    x, w = jnp.asarray(_x((64, 128), 1)), jnp.asarray(_x((128, 256), 2) / 64)
    grad = jax.jit(jax.grad(recipes.apply(lambda x, w: jnp.sum(jnp.tanh(x @ w)), recipe), argnums=(0, 1)))
    want = grad(x, w)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("d", None)))
        got = grad(xs, jax.device_put(w, NamedSharding(mesh, P(None, "m"))))
    assert got[1].sharding.spec == P(None, "m")
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_recipe_gradients_of_a_sequence_layer_with_out_sharding(name):
    """A projection of ``[batch, sequence, features]`` activations written with ``out_sharding``
    (as jax-llm-examples' models write theirs): NVFP4's weight gradient sums over batch x sequence,
    and the Hadamard transform along the tokens dropped ``dy``'s sharding from its type, so the
    transposed GEMM refused it ("cotangent type does not match"). It keeps it now; the gradients
    are the unsharded program's."""
    from scalify import recipes

    recipe = recipes.BUILTINS[name].replace(stochastic_rounding=())
    mesh = mesh_2x4()
    x, w = jnp.asarray(_x((4, 32, 64), 1)), jnp.asarray(_x((64, 96), 2) / 8)

    def loss(x, w, spec=None):
        return jnp.sum(jnp.tanh(jnp.einsum("btk,kd->btd", x, w, out_sharding=spec)))

    grad = lambda spec: jax.jit(jax.grad(recipes.apply(lambda a, b: loss(a, b, spec), recipe), argnums=(0, 1)))
    want = grad(None)(x, w)
    with jax.set_mesh(mesh):
        got = grad(P("d"))(jax.device_put(x, NamedSharding(mesh, P("d"))), w)
    assert got[0].sharding.spec == P("d", None, None)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))
