"""amp and scalify compose in both orders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalify.amp import amp

try:
    from scalify import as_scaled_array, scalify
except ImportError:  # pragma: no cover - only while the scalify interpreter is not merged
    pytest.skip("scalify.scalify / scalify.as_scaled_array are not importable yet", allow_module_level=True)


def _f(x, w):
    return jnp.tanh(x @ w) * 2.0


def _dots(closed):
    return [tuple(str(v.aval.dtype) for v in e.invars) for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("order", ["amp(scalify(f))", "scalify(amp(f))"])
def test_amp_and_scalify_compose(order):
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8))
    sx, sw = as_scaled_array(x, scale=2.0), as_scaled_array(w, scale=0.5)
    fn = amp(scalify(_f)) if order == "amp(scalify(f))" else scalify(amp(_f))
    out = fn(sx, sw)
    assert type(out).__name__ == "ScaledArray"
    ref16 = _f(x.astype(jnp.float16).astype(jnp.float32), w.astype(jnp.float16).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(out), ref16, rtol=1e-2, atol=1e-2)
    assert _dots(jax.make_jaxpr(fn)(sx, sw)) == [("float16", "float16")]
    jitted = jax.jit(fn)(sx, sw)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(out), rtol=1e-2, atol=1e-2)
