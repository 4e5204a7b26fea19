"""scalify of a function that calls jax.shard_map on ScaledArray operands: the body is scalified per
shard, the scale leaves get their specs from the data's (replicated when one element, split with the
data when each shard holds whole blocks), and the body's collectives take the scaled rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dist_common import AXES, mesh_2x4
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qformats as qf
import scalify as jsa

X_SPEC, W_SPEC = P("d", "m"), P("m", None)
# fp16 / fp8 per-tensor and MXFP8 (blocks of 32 along the last axis: x's sharded one holds 64 / shard)
FORMATS = {"fp16": qf.FP16, "fp8_e4m3": qf.FP8_E4M3, "mxfp8": qf.MXFP8}
CASES = [(f, a) for f in FORMATS for a in AXES]


def _raw(shape_x=(16, 256), shape_w=(256, 32)):
    """Rows of x of magnitudes 2**-4 .. 2**3 (each row block gets its own scale), w ~ 1/sqrt(K)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape_x) * 2.0 ** np.arange(-4, 4).repeat(shape_x[0] // 8)[:, None], jnp.float32)
    w = jnp.asarray(rng.normal(size=shape_w) / np.sqrt(shape_w[0]), jnp.float32)
    return x, w


def _operands(fmt, mesh):
    """x and w quantized in ``fmt`` and laid out as the in_specs say (data and scale leaves)."""
    x, w = _raw()
    sx, sw = jsa.as_scaled_array(x, fmt=fmt), jsa.as_scaled_array(w, fmt=fmt)
    return jsa.device_put(sx, X_SPEC, mesh=mesh), jsa.device_put(sw, W_SPEC, mesh=mesh)


def _quantization_bound(fmt, x, w):
    """Each element is rounded to ``mbits`` mantissa bits (relative error <= 2**-(mbits+1)), so each
    product x_ik w_kj is off by at most 2**-mbits |x_ik w_kj| (plus the subnormal floor of the
    smallest rows, far below this)."""
    return 2.0**-fmt.element.mbits * float(np.max(np.abs(np.asarray(x)) @ np.abs(np.asarray(w))))


def _dequantized(*xs):
    return [x.to_array(jnp.float32) for x in xs]


@pytest.mark.parametrize("fmt_name,axes", CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_matmul_and_psum_body(fmt_name, axes):
    fmt, mesh = FORMATS[fmt_name], mesh_2x4(axes)
    sx, sw = _operands(fmt, mesh)

    def body(x, w):  # this shard's rows of x times its rows of w, summed over "m"
        return jax.lax.psum(x @ w, "m")

    def f(x, w):
        return jax.shard_map(body, mesh=mesh, in_specs=(X_SPEC, W_SPEC), out_specs=P("d", None))(x, w)

    out = jax.jit(jsa.scalify(f))(sx, sw)
    assert isinstance(out, jsa.ScaledArray) and out.shape == (16, 32)
    got = np.asarray(out.to_array(jnp.float32))
    # against the same program in float32 on the dequantized inputs: the scalified one computes on
    # those values exactly (power-of-two scales), so only float32 summation order may differ
    want = np.asarray(jax.jit(f)(*_dequantized(sx, sw)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.max(np.abs(want))))
    # against float32 on the unquantized inputs: within the format's precision
    x, w = _raw()
    np.testing.assert_allclose(got, np.asarray(x @ w), rtol=0, atol=_quantization_bound(fmt, x, w))
    # the shard_map takes the data and scale leaves (not dequantized operands) and returns both
    (eqn,) = [e for e in jax.make_jaxpr(jsa.scalify(f))(sx, sw).eqns if e.primitive.name == "shard_map"]
    assert (len(eqn.invars), len(eqn.outvars)) == (4, 2)


@pytest.mark.parametrize("fmt_name,axes", CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_elementwise_body(fmt_name, axes):
    fmt, mesh = FORMATS[fmt_name], mesh_2x4(axes)
    sx, _ = _operands(fmt, mesh)

    def f(x):
        return jax.shard_map(lambda v: -v * 3.0, mesh=mesh, in_specs=X_SPEC, out_specs=X_SPEC)(x)

    out = jsa.scalify(f)(sx)
    assert isinstance(out, jsa.ScaledArray)
    want = np.asarray(f(*_dequantized(sx)))
    # negation and a power-of-two-times-1.5 product are exact on the carrier: float32 roundoff only
    np.testing.assert_allclose(np.asarray(out.to_array(jnp.float32)), want, rtol=1e-6)
    # the output's scale is the grid of the shards' scales, laid out like the data
    assert out.scale.ndim == 2


@pytest.mark.parametrize("axes", AXES)
def test_block_split_by_a_shard_is_an_error(axes):
    """64 columns over the 4 shards of "m": 16 per shard, which would split MXFP8's 32-blocks."""
    mesh = mesh_2x4(axes)
    x = jsa.as_scaled_array(jnp.ones((16, 64), jnp.float32), fmt=qf.MXFP8)
    # the data laid out as in_specs says (explicit axes check it); jsa.device_put would refuse too
    place = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    x = jsa.ScaledArray(place(x.data, X_SPEC), place(x.scale, P()), fmt=x.fmt)

    def f(v):
        return jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=X_SPEC, out_specs=X_SPEC)(v)

    with pytest.raises(ValueError, match=r"shard_map operand 0.*axis 1 over 'm'.*block of 32.*at most 2 devices"):
        jsa.scalify(f)(x)


def _layer(kind: str):
    """A data-parallel layer on a shard of the tokens: a dense projection or an expert bank of two
    experts (``lax.ragged_dot``, each shard's 32 tokens in groups of 12 and 20)."""
    from jax import lax

    if kind == "dense":
        return lambda x, w: jnp.sum(jnp.tanh(x @ w))
    sizes = jnp.asarray([12, 20], jnp.int32)
    return lambda x, w: jnp.sum(jnp.tanh(lax.ragged_dot(x, w, sizes)))


@pytest.mark.parametrize("kind", ["dense", "grouped"])
@pytest.mark.parametrize("name", ["mxfp8", "float8_tensorwise"])
def test_recipe_gradient_of_a_shard_map_step_with_replicated_weights(kind, name):
    """``jax.grad(recipes.apply(loss))`` of a ``shard_map`` body with tokens sharded 8 ways and the
    weight replicated: the backward GEMMs bind primitives directly, which got no ``pvary`` for the
    replicated weight ("dot_general requires varying manual axes to match" / "ragged_dot ...",
    then a gradient typed unlike its input). The weight's gradient is now summed over the shards:
    equal to the same recipe on each shard's tokens in turn, summed."""
    from scalify import recipes

    mesh = jax.make_mesh((8,), ("d",))
    layer = _layer(kind)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 64)), jnp.float32)
    shape = (64, 32) if kind == "dense" else (2, 64, 32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(shape) * 0.1, jnp.float32)
    per_shard = jax.jit(jax.grad(recipes.apply(layer, name), argnums=(0, 1)))
    parts = [per_shard(x[i * 32 : (i + 1) * 32], w) for i in range(8)]
    want_dx, want_dw = jnp.concatenate([p[0] for p in parts]), sum(p[1] for p in parts)
    with jax.set_mesh(mesh):
        body = jax.shard_map(lambda a, b: jax.lax.psum(layer(a, b), "d"), in_specs=(P("d"), P()), out_specs=P())
        dx, dw = jax.jit(jax.grad(recipes.apply(body, name), argnums=(0, 1)))(
            jax.device_put(x, P("d")), jax.device_put(w, P())
        )
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(want_dx))
    np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-5, atol=1e-6 * float(np.abs(want_dw).max()))
