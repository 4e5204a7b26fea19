"""amp over the shared walker: shard_map and closed_call bodies follow the policy; errors are located."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from scalify import _walk
from scalify.amp import amp, amp_stop


def _dots(jaxpr, inside=()):
    """``(enclosing primitive names, operand dtypes)`` of every dot_general, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is jax.lax.dot_general_p:
            yield inside, tuple(str(v.aval.dtype) for v in eqn.invars)
        for sub in _walk.sub_jaxprs(eqn):
            yield from _dots(getattr(sub, "jaxpr", sub), (*inside, eqn.primitive.name))


def _mesh():
    return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_body_follows_the_policy(check_vma):
    def local(x, w):
        def body(c, xi):
            return c + jnp.dot(xi, w), None

        c, _ = jax.lax.scan(body, 0.0 * x[0, : w.shape[1]], x)  # a carry varying like x
        with amp_stop():
            kept = jnp.dot(x, w)
        return jax.lax.psum(jnp.dot(x, w) + kept.sum() + c.sum(), "x")

    f = jax.shard_map(local, mesh=_mesh(), in_specs=(P("x"), P()), out_specs=P(), check_vma=check_vma)
    x = jnp.asarray(np.linspace(-1, 1, 32).reshape(4, 8), jnp.float32)
    w = jnp.asarray(np.linspace(-1, 1, 48).reshape(8, 6), jnp.float32)
    closed = jax.make_jaxpr(amp(f))(x, w)
    dots = list(_dots(closed.jaxpr))
    assert ("shard_map",) in [d[0] for d in dots]
    # the direct dot and the one in the scan body run in float16; the amp_stop one keeps float32
    assert sorted(dt for _, dt in dots) == [("float16", "float16")] * 2 + [("float32", "float32")]
    assert ("shard_map", "scan") in [d[0] for d in dots]
    out = jax.jit(amp(f))(x, w)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(f(x, w)), rtol=2e-2, atol=2e-2)


def test_closed_call_body_follows_the_policy():
    from scalify._jax_compat import bind_params, closed_call_p

    inner = jax.make_jaxpr(lambda a, b: jnp.dot(a, b))(jnp.ones((2, 3)), jnp.ones((3, 4)))

    def f(a, b):
        return bind_params(closed_call_p, [a, b], {"call_jaxpr": inner})[0]

    dots = list(_dots(jax.make_jaxpr(amp(f))(jnp.ones((2, 3)), jnp.ones((3, 4))).jaxpr))
    assert dots == [(("closed_call",), ("float16", "float16"))]


def test_policy_error_names_source_line():
    def boom(compute_dtype, original_dtypes, *args, **params):
        raise RuntimeError("policy failed")

    def f(x):
        return jnp.exp(x)  # the failing line

    with pytest.raises(RuntimeError, match="policy failed") as info:
        amp(f, amp_policy={jax.lax.exp_p: boom})(jnp.ones(3))
    lines, start = inspect.getsourcelines(f)
    line = start + next(i for i, t in enumerate(lines) if "the failing line" in t)
    (note,) = [n for n in info.value.__notes__ if "While transforming" in n]
    assert f"test_amp_walk.py:{line}" in note and "`exp`" in note and "float32[3]" in note
