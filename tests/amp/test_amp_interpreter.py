"""amp: policies, scopes, amp_stop, sub-jaxprs (jit, scan, while, cond, remat, custom rules), formats."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qformats as qf
from scalify.amp import (
    amp,
    amp_stop,
    cast_tree,
    default_amp_policy,
    fake_quantize,
    matmul_amp_policy,
    use_compute_precision,
    use_original_precision,
)

F16, BF16, F32 = "float16", "bfloat16", "float32"


# -- jaxpr inspection --------------------------------------------------------------------------------
def _subjaxprs(params):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jex.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jex.Jaxpr):
                yield x


def iter_eqns(jaxpr, path=()):
    """Yield ``(path, eqn)`` for every equation; ``path`` names the enclosing primitives."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield path, eqn
        for sub in _subjaxprs(eqn.params):
            yield from iter_eqns(sub, (*path, eqn.primitive.name))


def prim_dtypes(jaxpr, name="dot_general", inside=None):
    """Input dtypes of every ``name`` equation (only those nested inside primitive ``inside``)."""
    return [
        tuple(str(v.aval.dtype) for v in eqn.invars)
        for path, eqn in iter_eqns(jaxpr)
        if eqn.primitive.name == name and (inside is None or inside in path)
    ]


def _x(shape=(8, 8), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.5


# -- default policy ----------------------------------------------------------------------------------
def test_default_policy_matmul_in_compute_dtype_rest_in_input_precision():
    def fn(x, w):
        y = jnp.tanh(x @ w)
        return jnp.mean(y**2) + jnp.var(y)

    x, w = _x(), _x(seed=1)
    jaxpr = jax.make_jaxpr(amp(fn))(x, w)
    assert prim_dtypes(jaxpr) == [(F16, F16)]
    assert prim_dtypes(jaxpr, "tanh") == [(F32,)]
    assert all(d == (F32,) for d in prim_dtypes(jaxpr, "reduce_sum"))
    out = amp(fn)(x, w)
    assert out.dtype == jnp.float32
    ref = fn(x.astype(jnp.float16).astype(jnp.float32), w.astype(jnp.float16).astype(jnp.float32))
    np.testing.assert_allclose(out, ref, rtol=1e-2)
    # bfloat16 compute dtype
    assert prim_dtypes(jax.make_jaxpr(amp(fn, compute_dtype=jnp.bfloat16))(x, w)) == [(BF16, BF16)]


def test_decorator_form_pytrees_and_static_args():
    @amp(compute_dtype=jnp.bfloat16)
    def fn(params, x, act, scale):
        h = params["w"] @ x
        return {"y": act(h) * scale, "n": 3}

    params = {"w": _x()}
    out = fn(params, _x((8,)), jnp.tanh, 2.0)
    assert out["y"].dtype == jnp.float32 and out["y"].shape == (8,)
    assert int(out["n"]) == 3
    jitted = jax.jit(fn, static_argnums=(2, 3))(params, _x((8,)), jnp.tanh, 2.0)
    np.testing.assert_allclose(jitted["y"], out["y"], rtol=1e-2, atol=1e-2)  # XLA may fuse casts under jit


def test_grad_through_amp_keeps_param_dtype():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    g = jax.jit(jax.grad(amp(loss)))(_x(), _x(seed=1))
    g_ref = jax.grad(loss)(_x(), _x(seed=1))
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g_ref, rtol=5e-2, atol=5e-2)
    jaxpr = jax.make_jaxpr(jax.grad(amp(loss)))(_x(), _x(seed=1))
    assert prim_dtypes(jaxpr) and all(d == (F16, F16) for d in prim_dtypes(jaxpr))


# -- sub-jaxprs ---------------------------------------------------------------------------------------
def test_matmul_in_compute_dtype_inside_nested_jit_and_scan():
    @jax.jit
    def inner(a, b):
        return jax.jit(lambda u, v: u @ v)(a, b)

    def fn(x, w):
        y = inner(x, w)

        def body(c, _):
            return jnp.tanh(c @ w), None

        z, _ = lax.scan(body, y, None, length=3)
        return z.sum()

    x, w = _x(), _x(seed=1)
    plain = jax.make_jaxpr(fn)(x, w)
    assert set(prim_dtypes(plain)) == {(F32, F32)}
    jaxpr = jax.make_jaxpr(amp(fn))(x, w)
    assert prim_dtypes(jaxpr, inside="jit") == [(F16, F16)]
    assert prim_dtypes(jaxpr, inside="scan") == [(F16, F16)]
    # the nested jit keeps its name and the scan its length
    jit_eqn = next(e for _, e in iter_eqns(jaxpr) if e.primitive.name == "jit")
    assert jit_eqn.params["name"] == "inner"
    scan_eqn = next(e for _, e in iter_eqns(jaxpr) if e.primitive.name == "scan")
    assert scan_eqn.params["length"] == 3
    np.testing.assert_allclose(amp(fn)(x, w), fn(x, w), rtol=2e-2)
    # and under jit + grad
    g = jax.jit(jax.grad(amp(fn), argnums=1))(x, w)
    np.testing.assert_allclose(g, jax.grad(fn, argnums=1)(x, w), rtol=5e-2, atol=5e-2)
    gjaxpr = jax.make_jaxpr(jax.grad(amp(fn), argnums=1))(x, w)
    assert all(d == (F16, F16) for d in prim_dtypes(gjaxpr))


def test_while_cond_checkpoint_reach():
    def fn(x, w):
        y = jax.checkpoint(lambda a: jnp.sin(a @ w))(x)
        return lax.cond(y.sum() > 0, lambda a: a @ w, lambda a: a - 1.0, y)

    def loop(x, w):
        return lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    x, w = _x(), _x(seed=1)
    jaxpr = jax.make_jaxpr(amp(fn))(x, w)
    assert prim_dtypes(jaxpr, inside="remat2") or prim_dtypes(jaxpr, inside="checkpoint")
    assert set(prim_dtypes(jaxpr, inside="remat2") + prim_dtypes(jaxpr, inside="checkpoint")) == {(F16, F16)}
    assert prim_dtypes(jaxpr, inside="cond") == [(F16, F16)]
    assert prim_dtypes(jax.make_jaxpr(amp(loop))(x, w), inside="while") == [(F16, F16)]
    np.testing.assert_allclose(amp(loop)(x, w), loop(x, w), rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(amp(fn)(x, w), fn(x, w), rtol=5e-2, atol=5e-2)
    g = jax.grad(lambda w: amp(fn)(x, w).sum())(w)
    np.testing.assert_allclose(g, jax.grad(lambda w: fn(x, w).sum())(w), rtol=5e-2, atol=1e-1)


def test_custom_jvp_and_custom_vjp_rules_are_kept_and_reached():
    @jax.custom_jvp
    def f(x, w):
        return x @ w

    @f.defjvp
    def f_jvp(primals, tangents):
        x, w = primals
        tx, tw = tangents
        return f(x, w), 3.0 * (tx @ w + x @ tw)  # deliberately 3x the true derivative

    @jax.custom_vjp
    def g(x, w):
        return x @ w

    g.defvjp(lambda x, w: (g(x, w), (x, w)), lambda res, ct: (2.0 * ct @ res[1].T, 2.0 * res[0].T @ ct))

    x, w = _x(), _x(seed=1)
    for h, factor in ((f, 3.0), (g, 2.0)):
        loss = lambda w, h=h: h(x, w).sum()
        jaxpr = jax.make_jaxpr(amp(loss))(w)
        assert prim_dtypes(jaxpr) == [(F16, F16)]  # the primal inside custom_*_call
        grad = jax.grad(amp(loss))(w)
        np.testing.assert_allclose(grad, factor * jax.grad(lambda w: (x @ w).sum())(w), rtol=2e-2, atol=2e-2)
        # the rule (jvp / fwd) also runs under the policy when differentiated
        gjaxpr = jax.make_jaxpr(jax.grad(amp(loss)))(w)
        assert (F16, F16) in prim_dtypes(gjaxpr)


def test_jnp_var_and_norm_are_reached():
    def fn(x):
        return jnp.var(x, axis=0).sum() + jnp.linalg.norm(x)

    x = _x()
    plain = jax.make_jaxpr(amp(fn))(x)
    assert set(prim_dtypes(plain, "reduce_sum", inside="jit")) == {(F32,)}
    policy = {lax.reduce_sum_p: jnp.bfloat16}
    jaxpr = jax.make_jaxpr(amp(fn, amp_policy=policy))(x)
    sums = prim_dtypes(jaxpr, "reduce_sum", inside="jit")
    assert len(sums) >= 2 and set(sums) == {(BF16,)}  # inside _var and inside norm
    out = amp(fn, amp_policy=policy)(x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, fn(x), rtol=3e-2)


# -- scopes and amp_stop ----------------------------------------------------------------------------
def test_scope_policy_outermost_wins_and_reaches_nested_jit():
    def fn(x):
        with jax.named_scope("outer"):
            a = x @ x
            with jax.named_scope("inner"):
                b = jax.jit(lambda u: u @ u)(x)
        with jax.named_scope("inner"):
            c = x @ x
        d = x @ x
        return a, b, c, d

    policy = {"outer": jnp.bfloat16, "inner": use_original_precision, lax.dot_general_p: use_compute_precision}
    jaxpr = jax.make_jaxpr(amp(fn, amp_policy=policy))(_x())
    assert prim_dtypes(jaxpr) == [(BF16, BF16), (BF16, BF16), (F32, F32), (F16, F16)]


def test_amp_stop_forms_and_stop_scopes():
    def body(x):
        return x @ x

    def fn(x):
        with amp_stop():
            a = body(x)
        with amp_stop:
            b = body(x)
        c = amp_stop(body)(x)
        with jax.named_scope("amp_step"):
            d = body(x)
        with jax.named_scope("amp_default"):
            e = body(x)
        return a, b, c, d, e, body(x)

    x = _x()
    jaxpr = jax.make_jaxpr(amp(fn))(x)
    assert prim_dtypes(jaxpr) == [(F32, F32)] * 5 + [(F16, F16)]
    # amp_stop beats a user scope around it, even with a custom policy lacking the stop keys
    policy = {"user": jnp.bfloat16}

    def fn2(x):
        with jax.named_scope("user"):
            with amp_stop():
                a = x @ x
            b = jax.jit(amp_stop(body))(x)
            return a, b, x @ x

    assert prim_dtypes(jax.make_jaxpr(amp(fn2, amp_policy=policy))(x)) == [(F32, F32)] * 2 + [(BF16, BF16)]
    out = amp(amp_stop(body))(x)
    np.testing.assert_array_equal(out, body(x))


def test_amp_default_key_is_the_fallback_and_jaxamp_style_policy():
    def fn(x, w):
        return jnp.exp(x @ w) + x

    x, w = _x(), _x(seed=1)
    # the default policy keys exp (float32) and add (compute dtype) itself, so amp_default is not used
    policy = {**default_amp_policy, "amp_default": use_compute_precision}
    jaxpr = jax.make_jaxpr(amp(fn, amp_policy=policy))(x, w)
    assert prim_dtypes(jaxpr, "exp") == [(F32,)]
    assert prim_dtypes(jaxpr, "add") == [(F16, F16)]
    # matmul_amp_policy does not key them: amp_default is the fallback
    policy = {**matmul_amp_policy, "amp_default": use_compute_precision}
    jaxpr = jax.make_jaxpr(amp(fn, amp_policy=policy))(x, w)
    assert prim_dtypes(jaxpr, "exp") == [(F16,)]
    assert prim_dtypes(jaxpr, "add") == [(F16, F16)]
    jaxpr = jax.make_jaxpr(amp(fn, amp_policy=matmul_amp_policy))(x, w)
    assert prim_dtypes(jaxpr, "exp") == [(F32,)] and prim_dtypes(jaxpr, "add") == [(F32, F32)]


def test_equinox_linear_matches_manual_half_precision():
    key = jax.random.key(0)
    lin = eqx.nn.Linear(16, 8, key=key)
    x = jax.random.normal(jax.random.key(1), (16,))
    w16, b16, x16 = lin.weight.astype(jnp.float16), lin.bias.astype(jnp.float16), x.astype(jnp.float16)
    # default (jaxamp) policy: the matmul and the bias add both in float16
    np.testing.assert_array_equal(amp(lin)(x), (w16 @ x16 + b16).astype(jnp.float32))
    # matmul-only policy: the bias add in float32
    manual = (w16 @ x16).astype(jnp.float32) + lin.bias
    np.testing.assert_allclose(amp(lin, amp_policy=matmul_amp_policy)(x), manual, rtol=1e-6)
    np.testing.assert_array_equal(amp(amp_stop(lin))(x), lin(x))
    assert not np.allclose(amp(lin)(x), lin(x), rtol=0, atol=1e-7)


def test_integer_and_mixed_inputs_under_compute_policy():
    def fn(x, idx):
        y = x @ x
        z = jnp.where(y > 0, y, x)  # select_n with a bool predicate after a low-precision op
        return z[idx].sum() + jnp.take(x, idx, axis=0).sum()

    out = amp(fn, amp_policy={"amp_default": use_compute_precision})(_x(), jnp.array([0, 3]))
    assert out.dtype == jnp.float32 and np.isfinite(out)


def test_complex_values_keep_their_precision():
    """A linear recurrent unit's ``B @ u`` (real features, complex matrix) and ``exp`` of a complex
    eigenvalue: float16 has no complex form, so they keep the program's precision under jaxamp's
    policy and under every operation in low precision (jaxamp casts the complex operand to float16
    and drops its imaginary part: relative error 0.98 on this product), while the real GEMM beside
    them runs in float16. ``cast_tree`` leaves complex leaves as they are."""
    c = lax.complex(_x((8, 8), 1), _x((8, 8), 2))
    lam = lax.complex(jnp.full((8,), -0.1), jnp.linspace(0.0, 3.0, 8))

    def fn(x, c, lam):
        with jax.numpy_dtype_promotion("standard"):
            h = (x @ x) @ c
            return jnp.real(h * jnp.exp(lam * 0.5))

    def low_precision_gemm_first(x, c, lam):
        with jax.numpy_dtype_promotion("standard"):
            h = (x.astype(jnp.float16) @ x.astype(jnp.float16)).astype(jnp.float32) @ c
            return jnp.real(h * jnp.exp(lam * 0.5))

    x = _x()
    expected = low_precision_gemm_first(x, c, lam)
    for policy in (None, {"amp_default": use_compute_precision}):
        jaxpr = jax.make_jaxpr(amp(fn, amp_policy=policy))(x, c, lam)
        assert prim_dtypes(jaxpr) == [(F16, F16), (F32, "complex64")]
        assert prim_dtypes(jaxpr, "exp") == [("complex64",)]
        np.testing.assert_array_equal(amp(fn, amp_policy=policy)(x, c, lam), expected)
    assert cast_tree(jnp.float16, {"c": c, "x": x})["c"].dtype == jnp.complex64


def test_random_samplers_keep_their_precision():
    """jax.random's samplers (nested jits, which amp's policies otherwise reach) run as JAX wrote
    them under any policy: their arithmetic is their contract. With jaxamp's ``add`` in float16 a
    uniform's ``u * (max - min) + min`` rounds up to ``max`` (1 draw in 4096), so ``uniform``
    returned 1.0 and ``normal`` (``erfinv`` of a uniform on (-1, 1)) returned inf; the
    ``orthogonal`` initializer (a QR of normals) then gave NaN weights for 9 of 20 keys at 64x64,
    and PureJaxRL's PPO, amp'ed as a whole, never learned. The program's own arithmetic around a
    sample (``mean + std * eps``) follows the policy."""
    key = jax.random.PRNGKey(0)
    draws = {
        "uniform": lambda k: jax.random.uniform(k, (1 << 16,)),
        "normal": lambda k: jax.random.normal(k, (1 << 16,)),
        "truncated_normal": lambda k: jax.random.truncated_normal(k, -2.0, 2.0, (4096,)),
        "gumbel": lambda k: jax.random.gumbel(k, (4096,)),
        "bernoulli": lambda k: jax.random.bernoulli(k, 0.3, (4096,)),
    }
    for policy in (None, {lax.add_p: jnp.float16, lax.sub_p: jnp.float16, lax.mul_p: jnp.bfloat16}):
        for name, draw in draws.items():
            expected, got = jax.jit(draw)(key), jax.jit(amp(draw, amp_policy=policy))(key)
            np.testing.assert_array_equal(got, expected, err_msg=f"{name} under {policy}")
    assert float(jax.jit(amp(draws["uniform"]))(key).max()) < 1.0
    orthogonal = jax.jit(amp(lambda k: jax.nn.initializers.orthogonal()(k, (64, 64))))
    assert all(np.isfinite(orthogonal(jax.random.PRNGKey(seed))).all() for seed in range(20))

    def reparametrised(k, mean, std):
        return mean + std * jax.random.normal(k, mean.shape)

    jaxpr = jax.make_jaxpr(amp(reparametrised))(key, _x(), _x(seed=1))
    adds = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive is lax.add_p]  # not the sampler's own
    assert [tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in adds] == [(F16, F16)]


# -- dtype and format values --------------------------------------------------------------------------
def test_format_policy_fake_quantizes_matmul_inputs_along_contracted_axis():
    x = _x((4, 64))
    w = _x((64, 32), seed=1)
    f = amp(lambda a, b: a @ b, amp_policy={lax.dot_general_p: qf.MXFP8})
    xq = fake_quantize(qf.MXFP8.replace(axis=1), x)  # (jitted quantize -> dequantize)
    wq = fake_quantize(qf.MXFP8.replace(axis=0), w)
    np.testing.assert_allclose(f(x, w), xq @ wq, rtol=1e-6)
    assert not np.allclose(f(x, w), x @ w, rtol=1e-4)
    # straight-through gradient: d/dw sum(q(x) @ q(w)) = q(x)^T @ 1
    g = jax.grad(lambda w: f(x, w).sum())(w)
    np.testing.assert_allclose(g, jax.grad(lambda w: (xq @ w).sum())(w), rtol=1e-6)
    # under jit and with batch dims (einsum) too
    f2 = amp(lambda a, b: jnp.einsum("bik,bkj->bij", a, b), amp_policy={lax.dot_general_p: qf.MXFP8})
    out = jax.jit(f2)(_x((2, 4, 64)), _x((2, 64, 8), seed=2))
    assert out.shape == (2, 4, 8) and np.isfinite(out).all()


def test_format_policy_errors_clearly_when_axis_does_not_divide():
    f = amp(lambda a, b: a @ b, amp_policy={lax.dot_general_p: qf.MXFP8})
    with pytest.raises(ValueError, match=r"operand 0 of dot_general with shape \(4, 20\).*multiple of 32"):
        f(_x((4, 20)), _x((20, 32)))


def test_per_channel_and_per_tensor_formats_and_dtype_values():
    x, w = _x((4, 16)), _x((16, 8), seed=1)
    f = amp(lambda a, b: a @ b, amp_policy={lax.dot_general_p: qf.INT8_PER_CHANNEL})
    fx = qf.INT8_PER_CHANNEL.replace(axis=0)  # x's free axis: one scale per row (token)
    fw = qf.INT8_PER_CHANNEL.replace(axis=1)  # w's free axis: one scale per output channel
    ref = fake_quantize(fx, x) @ fake_quantize(fw, w)
    np.testing.assert_allclose(f(x, w), ref, rtol=1e-6)
    g = amp(lambda a: jnp.exp(a), amp_policy={lax.exp_p: qf.FP8_E4M3})(x)
    np.testing.assert_allclose(g, jnp.exp(fake_quantize(qf.FP8_E4M3, x)), rtol=1e-6)
    h = jax.make_jaxpr(amp(lambda a, b: a @ b, amp_policy={lax.dot_general_p: jnp.bfloat16}))(x, w)
    assert prim_dtypes(h) == [(BF16, BF16)]
    with pytest.raises(TypeError, match="amp_policy values"):
        amp(lambda a: a, amp_policy={lax.exp_p: 3})


def test_scopes_open_around_the_call_apply():
    f = amp(lambda a: a @ a, amp_policy={"outside": jnp.bfloat16})

    def g(x):
        with jax.named_scope("outside"):
            return f(x)

    assert prim_dtypes(jax.make_jaxpr(g)(_x())) == [(BF16, BF16)]
    assert prim_dtypes(jax.make_jaxpr(f)(_x())) == [(F32, F32)]


def test_convolution_in_compute_dtype_and_with_a_block_format():
    x = _x((2, 32, 8, 8))  # NCHW, 32 input features
    k = _x((4, 32, 3, 3), seed=1)  # OIHW

    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "SAME")

    assert prim_dtypes(jax.make_jaxpr(amp(conv))(x, k), "conv_general_dilated") == [(F16, F16)]
    f = jax.jit(amp(conv, amp_policy={lax.conv_general_dilated_p: qf.MXFP8}))
    ref = conv(fake_quantize(qf.MXFP8.replace(axis=1), x), fake_quantize(qf.MXFP8.replace(axis=1), k))
    np.testing.assert_allclose(f(x, k), ref, rtol=1e-5, atol=1e-5)
