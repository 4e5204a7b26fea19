"""The interpreter: composition with jit / grad / vmap, sub-jaxprs, errors, configuration."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import FORMATS, check_against_dequantized, make_scaled

import qformats as qf
import scalify as jsa

RNG = np.random.default_rng(2)
X = jnp.asarray(RNG.standard_normal((4, 32)), jnp.float32)


def test_plain_inputs_behave_like_fn():
    f = lambda a, b: jnp.tanh(a) * b
    np.testing.assert_array_equal(jsa.scalify(f)(X, X), f(X, X))


def test_kwargs_pytrees_and_python_scalars():
    sx = jsa.as_scaled_array({"a": X, "b": [X * 2]}, scale=np.float32(2.0))

    def f(tree, c, *, d):
        return {"out": tree["a"] * c + tree["b"][0] * d}

    out = jsa.scalify(f)(sx, 3.0, d=0.5)
    assert isinstance(out["out"], jsa.ScaledArray)
    np.testing.assert_allclose(np.asarray(out["out"]), np.asarray(X * 3.0 + X), rtol=1e-6)


def _schedule(step):
    return 0.5 / (step + 1)


@dataclasses.dataclass(frozen=True)
class _Config:  # hashable, as jax.jit's static arguments must be; a dtype and a function inside
    width: int
    dtype: object = jnp.float32
    schedule: object = _schedule


@pytest.mark.parametrize("fmt_name", ["scale", "mxfp8"])
def test_static_arguments_reach_fun_as_they_are(fmt_name):
    """flax's examples jit their train steps with static arguments (vae's latent width, lm1b's config
    holding a dtype and a schedule): under ``jit(scalify(step), static_argnums=...)`` the step must
    see them as Python values, not tracers (a traced width cannot make a shape)."""

    def step(x, cfg, n):
        pad = jnp.zeros((x.shape[0], n), cfg.dtype)  # a shape from an int argument
        y = jnp.concatenate([x, pad], axis=1)[:, : cfg.width]
        return y * cfg.schedule(1) + jnp.asarray(n, cfg.dtype)

    cfg = _Config(width=32)
    x = make_scaled(X, FORMATS[fmt_name])
    want = step(np.asarray(x), cfg, 8)
    got = jax.jit(jsa.scalify(step), static_argnums=(1, 2))(x, cfg, 8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    # Without jit the same values reach `step` as they are, and under scalify.vmap (unmapped).
    np.testing.assert_allclose(np.asarray(jsa.scalify(step)(x, cfg, 8)), np.asarray(want), rtol=1e-6)

    def row(v, cfg, n):  # per row: a vector of length n
        return jnp.zeros((n,), cfg.dtype) + jnp.sum(v) * cfg.schedule(1)

    rows = jsa.vmap(jsa.scalify(row), in_axes=(0, None, None))(x, cfg, 8)
    want_rows = jax.vmap(row, in_axes=(0, None, None))(np.asarray(x), cfg, 8)
    np.testing.assert_allclose(np.asarray(rows), np.asarray(want_rows), rtol=1e-6)


@pytest.mark.parametrize("transform", ["scalify", "amp"])
def test_python_objects_in_the_output_come_back_as_they_are(transform):
    """A step that returns its ``eqx.Module`` returns its activation function, names and flags with
    the arrays; ``eqx.filter_jit`` passes them through, so scalify (and amp) must too (they failed:
    ``make_jaxpr`` rejects a ``str`` output). Numbers are not traced either: a Python ``bool``
    flag came back as a traced array, and equinox's BatchNorm then branched on a tracer."""

    def step(x):
        return {"y": jnp.tanh(x) * 2.0, "act": jax.nn.relu, "name": "batch", "flag": False, "n": 3, "none": None}

    wrap = jsa.scalify if transform == "scalify" else jsa.amp.amp
    x = make_scaled(X, FORMATS["mxfp8"]) if transform == "scalify" else X
    out = wrap(step)(x)
    assert out["act"] is jax.nn.relu and out["name"] == "batch" and out["flag"] is False and out["n"] == 3
    assert out["none"] is None
    np.testing.assert_allclose(np.asarray(out["y"]), np.tanh(np.asarray(x, np.float32)) * 2.0, rtol=1e-6)
    # A constant the function returns is an array, as jax.jit returns it (under amp it came back as
    # the jaxpr's literal, a Python bool, which eqx.filter_jit then held static).
    flag = wrap(lambda x: (jnp.tanh(x), jnp.array(False)))(x)[1]
    assert isinstance(flag, jax.Array) and flag.dtype == jnp.bool_ and not bool(flag)
    # Under jax.jit an object output stays an error, with or without scalify, as JAX reports it.
    with pytest.raises(TypeError, match="not a valid JAX type"):
        jax.jit(wrap(step))(x)


@jax.tree_util.register_pytree_node_class
class _ArraysOnly:
    """An output container that checks its fields when rebuilt, as a jaxtyping-annotated
    ``flax.struct`` dataclass does (RecurrentGemma's ``SamplingState``: ``Float[Array, ...]``)."""

    def __init__(self, logits, cache):
        for v in (logits, cache):
            if not isinstance(v, jax.Array):
                raise TypeError(f"expected a jax.Array field, got {type(v).__name__}")
        self.logits, self.cache = logits, cache

    def tree_flatten(self):
        return (self.logits, self.cache), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


@pytest.mark.parametrize("fmt_name", ["scale", "mxfp8", "nvfp4"])
def test_dequantize_outputs_for_a_container_of_arrays_only(fmt_name):
    """A decoding step returning its state in a container that accepts ``jax.Array`` fields only:
    plain ``scalify`` cannot rebuild it with ScaledArray leaves and says what to do;
    ``dequantize_outputs=True`` returns plain float32 arrays equal to float32's on the dequantized
    weights (under jax.jit too, whose own output rebuild runs the container's check again)."""
    w = make_scaled(X.T @ X, FORMATS[fmt_name])  # (32, 32)
    h = jnp.asarray(np.random.default_rng(2).standard_normal((4, 32)), jnp.float32)

    def step(w, h):
        logits = jnp.tanh(h @ w)
        return _ArraysOnly(logits, h + logits)

    with pytest.raises(TypeError, match=r"scalify\(.*step\).*expected a jax.Array field.*dequantize_outputs=True"):
        jax.jit(jsa.scalify(step))(w, h)
    want = step(jnp.asarray(w.to_array(jnp.float32)), h)
    for run in (jsa.scalify(step, dequantize_outputs=True), jax.jit(jsa.scalify(step, dequantize_outputs=True))):
        got = run(w, h)
        assert isinstance(got, _ArraysOnly) and got.logits.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got.cache), np.asarray(want.cache), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt_name", ["scale", "mxfp8", "int8_per_channel"])
def test_collectives_over_a_vmap_axis_name(fmt_name):
    """``jax.vmap(f, axis_name="batch")`` with ``pmean`` / ``pmax`` / ``pmin`` over that name (batch
    statistics, as equinox's and flax's BatchNorm compute them) reaches the jaxpr as the collective
    over a positional axis: it is the array reduction over that axis (it failed: the rule took
    every axis for a mesh axis)."""

    def f(x):
        def row(v):
            mean = jax.lax.pmean(jnp.mean(v), "batch")
            return (v - mean) * jax.lax.pmax(jnp.max(v), "batch") + jax.lax.pmin(v, "batch")

        return jax.vmap(row, axis_name="batch")(x)

    check_against_dequantized(f, make_scaled(X, FORMATS[fmt_name]))


def test_scalar_outputs_convert_to_python_numbers():
    """A step's loss comes back as a 0-d ScaledArray: ``loss.item()`` and ``float(loss)`` give its
    value (equinox's train_rnn prints ``loss.item()``); arithmetic on it outside scalify is an error
    that names the fix."""
    loss = jax.jit(jsa.scalify(lambda x: jnp.mean(x**2)))(make_scaled(X, FORMATS["mxfp8"]))
    want = float(np.mean(np.asarray(make_scaled(X, FORMATS["mxfp8"]), np.float32).astype(np.float64) ** 2))
    assert isinstance(loss, jsa.ScaledArray)
    assert loss.item() == pytest.approx(want, rel=1e-6) and float(loss) == pytest.approx(want, rel=1e-6)
    assert int(jsa.as_scaled_array(jnp.float32(3.75))) == 3
    ops = (lambda v: 0 + v, lambda v: v / 2, lambda v: -v, lambda v: v @ v, lambda v: np.ones(()) * v, lambda v: v < 1)
    for op in ops:
        with pytest.raises(TypeError, match=r"no arithmetic outside scalify .*scalify\.scalify.*to_array"):
            op(loss)


def _library_primitive():
    """A primitive as a library defines one (equinox's ``maybe_set`` in its loops): an
    implementation in jnp, an abstract evaluation, no scalify rule."""
    from jax.extend.core import Primitive

    prim = Primitive("library_axpy")
    prim.def_impl(lambda a, x, y: a * x + jnp.tanh(y))
    prim.def_abstract_eval(lambda a, x, y: jax.core.ShapedArray(x.shape, x.dtype))
    return prim


@pytest.mark.parametrize("fmt_name", ["scale", "mxfp8"])
def test_a_library_primitive_runs_through_its_implementation(fmt_name):
    """diffrax's solvers write their outputs with equinox's ``maybe_set`` primitive, which has no
    scalify rule: its implementation (JAX code) is walked with the rules instead."""
    prim = _library_primitive()
    f = lambda x, y: prim.bind(jnp.float32(3.0), x, y) * 2.0
    check_against_dequantized(lambda x: f(x, x + 1.0), make_scaled(X, FORMATS[fmt_name]))


def test_a_library_primitive_that_calls_itself():
    """lineax's GMRES calls ``linear_solve`` (with another solver) inside ``linear_solve``: an
    implementation that binds its own primitive with other parameters is walked at every level
    (it was refused before). One that binds itself with the same parameters, as JAX's own
    primitives do, is not expanded forever: it raises the error naming the fix."""
    from jax.extend.core import Primitive

    prim = Primitive("library_recursive")
    prim.def_impl(lambda x, *, depth: x * 2.0 if depth == 0 else prim.bind(jnp.tanh(x), depth=depth - 1) + x)
    prim.def_abstract_eval(lambda x, *, depth: jax.core.ShapedArray(x.shape, x.dtype))
    check_against_dequantized(lambda x: prim.bind(x, depth=3), make_scaled(X, FORMATS["mxfp8"]))

    loop = Primitive("library_loop")
    loop.def_impl(lambda x, *, tag: loop.bind(x, tag=tag))  # never terminates as JAX code
    loop.def_abstract_eval(lambda x, *, tag: jax.core.ShapedArray(x.shape, x.dtype))
    with pytest.raises(jsa.ScalifyUnsupportedError, match=r"no rule for primitive `library_loop`"):
        jax.jit(jsa.scalify(lambda x: loop.bind(x, tag="a")))(make_scaled(X, FORMATS["mxfp8"]))


def test_a_primitive_without_implementation_still_names_the_fix():
    from jax.extend.core import Primitive

    prim = Primitive("opaque_op")  # no def_impl: nothing to walk
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    with pytest.raises(jsa.ScalifyUnsupportedError, match=r"no rule for primitive `opaque_op`.*register_rule"):
        jax.jit(jsa.scalify(prim.bind))(make_scaled(X, FORMATS["mxfp8"]))


@pytest.mark.parametrize("fmt_name", ["scale", "mxfp8", "int8_per_channel"])
def test_nested_jit_cond_while_scan_remat(fmt_name):
    sx = make_scaled(X, FORMATS[fmt_name])

    @jax.jit
    def inner(v):
        return jnp.tanh(v) * 2.0 + v

    def f(v):
        v = inner(v)
        v = jax.lax.cond(jnp.sum(v) > 0, lambda a: a * 2.0, lambda a: -a, v)
        v = jax.lax.fori_loop(0, 3, lambda i, c: c * 0.5 + 1.0, v)
        v, ys = jax.lax.scan(lambda c, row: (c + row, c * row), v[0], v)
        v = jax.checkpoint(lambda t: jnp.sin(t) * t)(v)
        return v, ys

    check_against_dequantized(f, sx, rtol=1e-5)
    check_against_dequantized(jax.jit(f), sx, rtol=1e-5)


@pytest.mark.parametrize("fmt_name", ["mxfp8", "int8_per_channel"])
@pytest.mark.parametrize("how", ["offload_policy", "memory_space"])
def test_device_put_moves_data_and_scale(fmt_name, how):
    """``jax.device_put`` inside the function: a remat policy that offloads its named residuals to
    host memory (MaxText's ``offload`` policies), and a round trip through host memory written out.
    It had no rule (``ScalifyUnsupportedError``) for a scaled operand."""
    from jax.ad_checkpoint import checkpoint_name

    # Its own generator: drawn from the module's RNG, the weights depended on which tests ran
    # before in the same process (an xdist worker's share).
    w = make_scaled(jnp.asarray(np.random.default_rng(5).standard_normal((32, 32)), jnp.float32), FORMATS[fmt_name])
    if how == "offload_policy":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["proj"],
            offload_src="device",
            offload_dst="pinned_host",
        )
        block = jax.checkpoint(lambda w, x: jnp.tanh(checkpoint_name(x @ w, "proj")) @ w, policy=policy)
        f = jax.grad(lambda w, x: jnp.sum(block(w, block(w, x)) ** 2))
        # The gradient of two chained blocks sums K=32 products four times over, in another order
        # than the float32 program, and int8's per-channel scales (amax / 127) are not powers of two,
        # so its carrier rescales round too. Measured over 30 weight draws and three inputs, as the
        # smallest tolerance this check passes with: at most 2.8e-5 for int8 per channel, 1.3e-6 for
        # MXFP8.
        rtol = 1e-4
    else:

        def f(w, x):
            host = jax.device_put(w, jax.memory.Space.Host)
            return jnp.tanh(x @ jax.device_put(host, jax.memory.Space.Device))

        rtol = 1e-5
    check_against_dequantized(jax.jit(f), w, X, rtol=rtol, atol=rtol)


def test_checkpoint_name_is_kept_on_data_and_scale(capsys):
    """``checkpoint_name`` on a scaled value names its data and its scale, so a remat policy that
    saves that name (``save_only_these_names``, MaxText's and flax's policies) saves both, under
    ``jax.grad(scalify(f))``. It ran through its implementation, which drops the name: nothing
    was saved by name and the policy recomputed it."""
    from jax.ad_checkpoint import checkpoint_name

    w = make_scaled(jnp.asarray(RNG.standard_normal((32, 32)), jnp.float32), FORMATS["mxfp8"])
    policy = jax.checkpoint_policies.save_only_these_names("proj")
    block = jax.checkpoint(lambda w, x: jnp.tanh(checkpoint_name(x @ w, "proj")) @ w, policy=policy)
    loss = lambda w, x: jnp.sum(block(w, x) ** 2)
    jax.ad_checkpoint.print_saved_residuals(jsa.scalify(loss), w, X)
    named = [line for line in capsys.readouterr().out.splitlines() if "named 'proj'" in line]
    assert len(named) == 2 and any("f32[4,32]" in line for line in named), named
    check_against_dequantized(jax.jit(jax.grad(loss)), w, X, rtol=1e-5)


def test_nested_jit_kept_in_program():
    sx = make_scaled(X, None)
    inner = jax.jit(lambda v: v * 2.0)
    jaxpr = jax.make_jaxpr(jsa.scalify(lambda v: inner(v) + 1.0))(sx)
    assert any(e.primitive.name in ("jit", "pjit") for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("factor", [3.0, 0.0])
def test_nested_jit_with_literal_operands(factor):
    """A literal operand of a nested jit (an unhashable ndarray subclass in the jaxpr) is baked into
    the interpreted body as a static scalar: a power-of-two split for 3.0, a zero fill for 0.0."""
    x = jsa.as_scaled_array(jnp.asarray(RNG.standard_normal((4, 8)), jnp.float32), scale=np.float32(2.0))

    def f(v):
        return jax.jit(lambda a, b: a * b + jnp.where(a > 0, a, b))(v, np.float32(factor))

    ref = f(x.to_array())
    for wrap in (lambda g: g, jax.jit):
        out = wrap(jsa.scalify(f))(x)
        np.testing.assert_allclose(np.asarray(out.to_array()), np.asarray(ref), rtol=1e-6)


def test_jit_outside_and_inside():
    sx = make_scaled(X, None)
    f = lambda v: jax.nn.softmax(v) * v
    a = jax.jit(jsa.scalify(f))(sx)
    b = jsa.scalify(jax.jit(f))(sx)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(a), f(np.asarray(sx)), rtol=1e-5, atol=1e-6)


def test_vmap_both_orders():
    sx = make_scaled(X, None)
    f = lambda v: jnp.sum(jnp.exp(v) * v)
    ref = jax.vmap(f)(np.asarray(sx))
    np.testing.assert_allclose(np.asarray(jsa.scalify(jax.vmap(f))(sx)), ref, rtol=1e-5)
    # Per-tensor scale shared by the batch: map the data only.
    out = jax.vmap(jsa.scalify(f), in_axes=(jsa.ScaledArray(0, None),))(sx)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5)


def _custom_pair():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 42.0 * t[0]))

    @jax.custom_vjp
    def g(x):
        return x * 1.0

    g.defvjp(lambda x: (x, None), lambda _, ct: (ct * 7.0,))
    return f, g


def test_custom_jvp_and_vjp_rules_kept_with_plain_operands():
    f, g = _custom_pair()
    sx = make_scaled(X, None)
    grads = jsa.scalify(jax.grad(lambda v: jnp.sum(f(v) + g(v))))(sx)
    np.testing.assert_allclose(np.asarray(grads), np.full((4, 32), 49.0), rtol=1e-6)
    # Under scalify with scaled operands: the primal bodies are interpreted.
    out = jsa.scalify(lambda v: f(v) + g(v))(sx)
    np.testing.assert_allclose(np.asarray(out), np.sin(np.asarray(sx)) + np.asarray(sx), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_through_scalify_keeps_custom_rules(jit):
    f, g = _custom_pair()
    h = jsa.scalify(lambda v: f(v) + g(v))

    def loss(x):
        return jnp.sum(jsa.asarray(h(jsa.as_scaled_array(x, scale=np.float32(2.0)))))

    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    # The true derivative would be cos(x) + 1; the custom rules say 42 + 7.
    np.testing.assert_allclose(np.asarray(grad(X)), np.full((4, 32), 49.0), rtol=1e-6)


def test_grad_with_respect_to_carrier_leaves_follows_the_chain_rule():
    f, g = _custom_pair()
    sx = jsa.as_scaled_array(X, scale=np.float32(4.0))
    grads = jax.grad(lambda s: jnp.sum(jsa.asarray(jsa.scalify(lambda v: f(v) + g(v))(s))))(sx)
    # v = data * scale: d/d data = 49 * scale, d/d scale = sum(49 * data).
    np.testing.assert_allclose(np.asarray(grads.data), np.full((4, 32), 49.0 * 4.0), rtol=1e-6)
    np.testing.assert_allclose(float(grads.scale), 49.0 * float(np.sum(np.asarray(sx.data))), rtol=1e-5)


def test_grad_through_scalify_matches_plain_grad_with_jax_nn_rules():
    # relu's custom JVP gives 0 at exactly 0 (max(x, 0) differentiated would give 0.5).
    x = X.at[0, 0].set(0.0)
    w = jnp.asarray(RNG.standard_normal((32, 8)), jnp.float32)

    def model(x, w):
        h = jax.nn.relu(x) + jax.nn.gelu(x) + jax.nn.silu(x)
        return jnp.sum(jax.nn.log_softmax(h @ w) ** 2) + jax.nn.logsumexp(h)

    def scaled_loss(x, w):
        return jsa.asarray(jsa.scalify(model)(jsa.as_scaled_array(x, scale=np.float32(2.0)), w))

    ref = jax.grad(model, argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(scaled_loss, argnums=(0, 1)))(x, w)
    for r, o in zip(ref, got, strict=True):
        # float32 arithmetic in a different order: relative 1e-5 of the largest gradient.
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
    assert float(got[0][0, 0]) == pytest.approx(float(ref[0][0, 0]), rel=1e-5)


def test_custom_vjp_with_scaled_residuals_and_two_operands():
    @jax.custom_vjp
    def mul(x, y):
        return x * y

    mul.defvjp(lambda x, y: (x * y, (x, y)), lambda r, ct: (ct * r[1] * 3.0, jnp.sum(ct * r[0])))
    c = np.float32(0.3)

    def loss(x, y):
        return jnp.sum(
            jsa.asarray(jsa.scalify(lambda v, u: mul(v, jnp.sin(u)))(jsa.as_scaled_array(x, scale=np.float32(0.5)), y))
        )

    gx, gy = jax.grad(loss, argnums=(0, 1))(X, c)
    np.testing.assert_allclose(np.asarray(gx), np.full((4, 32), 3.0 * np.sin(c)), rtol=1e-6)
    np.testing.assert_allclose(float(gy), float(jnp.sum(X)) * np.cos(c), rtol=1e-5)


def test_logsumexp_jit_finite_and_correct():
    x = jnp.asarray([1000.0, 1001.0, -5.0], jnp.float32)
    sx = jsa.as_scaled_array(x, scale=np.float32(512.0))
    out = jax.jit(jsa.scalify(jax.nn.logsumexp))(sx)
    np.testing.assert_allclose(float(np.asarray(out)), float(jax.nn.logsumexp(x)), rtol=1e-6)
    out = jsa.scalify(jax.nn.log_softmax)(sx)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), jax.nn.log_softmax(x), rtol=1e-5, atol=1e-5)


def test_closed_over_prng_key():
    """A key captured by the program (a module-level ``jax.random.key``) is a constant of its jaxpr:
    a PRNG key has no NumPy form, and static-operand detection must pass it by (it raised
    TypeError). The samplers run on the dequantized values, as in float32."""
    key = jax.random.key(3)
    alpha = jnp.asarray(np.random.default_rng(8).uniform(0.5, 4.0, size=(64, 32)), jnp.float32)
    sx = jsa.as_scaled_array(alpha, fmt=qf.MXFP8)
    programs = {
        "noise": lambda v: v * jax.random.normal(key, v.shape),
        "dropout": lambda v: jnp.where(jax.random.bernoulli(key, 0.9, v.shape), v / 0.9, 0.0),
        "gamma": lambda v: jax.random.gamma(key, v),
    }
    for name, f in programs.items():
        out = jsa.scalify(f)(sx)
        ref = np.asarray(f(sx.to_array()))
        # gamma's rejection sampler runs ~30 float32 ops per draw: allow their rounding (1e-5)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6, err_msg=name)


def test_scaled_values_written_into_a_mutable_ref():
    """A ``jax.ref.Ref`` holds plain values of its declared dtype. A carrier (what scalify's
    arithmetic returns) is stored as its value, by ``r[...] = v`` (swap), ``r[...] += v``
    (addupdate) and an indexed write: the float32 program's result, exactly (data times a power of
    two). A formatted value is refused with the explicit way out (it would be widened silently).
    The ref among a nested jit's operands is not read as a static operand (that raised an index
    ValueError from ``np.asarray(ref)``)."""

    def f(v):
        r = jax.new_ref(jnp.zeros_like(v))
        r[...] = v * 2
        r[...] += v
        r[0] = v[1] * 3
        return r[...]

    def store(v):
        r = jax.new_ref(jnp.zeros_like(v))
        r[...] = v
        return r[...]

    sx = jsa.as_scaled_array(X, scale=np.float32(2.0))
    qx = jsa.as_scaled_array(X, fmt=qf.MXFP8)
    for g in (f, jax.jit(f)):
        np.testing.assert_array_equal(np.asarray(jsa.scalify(g)(sx)), np.asarray(f(sx.to_array())))
    for g in (store, jax.jit(store)):
        msg = r"`swap` would store a mxfp8 ScaledArray in a jax.ref of float32.*dequantize"
        with pytest.raises(jsa.ScalifyUnsupportedError, match=msg):
            jsa.scalify(g)(qx)
    out = jsa.scalify(lambda v: store(jsa.ops.dequantize(v)))(qx)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(qx.to_array()))


def test_unsupported_primitive_error_message():
    sx = jsa.as_scaled_array(X, fmt=qf.MXFP8)
    with pytest.raises(jsa.ScalifyUnsupportedError) as info:
        jsa.scalify(lambda v: jax.ffi.ffi_call("my_kernel", jax.ShapeDtypeStruct(v.shape, v.dtype))(v))(sx)
    msg = str(info.value)
    assert "primitive `ffi_call`" in msg and "mxfp8" in msg and "scalify.ops.dequantize" in msg


@pytest.mark.parametrize("fmt", [qf.MXFP8, None], ids=["mxfp8", "carrier"])
def test_a_scaled_array_converted_inside_a_trace_names_the_fix(fmt):
    """A ScaledArray captured by a closure (a Hugging Face model's ``model.params = scaled``) or
    handed to ``jax.jit`` without scalify reaches ``jnp.asarray`` (as flax's ``promote_dtype``
    calls it) inside the trace, where no NumPy value exists. JAX's own error pointed into
    ScaledArray.__array__; ours says to pass it as an argument of the scalified function, and that
    way gives the dequantized program's value."""
    w = jsa.as_scaled_array(X, fmt=fmt) if fmt else jsa.as_scaled_array(X, scale=np.float32(2.0))
    v = jnp.ones((X.shape[0],), jnp.float32)

    def layer(v, w):
        return v @ jnp.asarray(w)

    for fn in (jsa.scalify(lambda v: layer(v, w)), jax.jit(jsa.scalify(lambda v: layer(v, w)))):
        with pytest.raises(TypeError, match=r"captured by a closure.*Pass it as an argument"):
            fn(v)
    with pytest.raises(TypeError, match=r"without scalify must be wrapped: `jax.jit\(scalify.scalify\(fn\)\)`"):
        jax.jit(layer)(v, w)
    got = jax.jit(jsa.scalify(layer))(v, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(v) @ np.asarray(w), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(w)), np.asarray(w.to_array()))  # eager still converts


def test_explicit_dequantize_is_the_way_forward():
    sx = jsa.as_scaled_array(X, fmt=qf.MXFP8)
    q = jsa.scalify(lambda v: jnp.linalg.qr(jsa.ops.dequantize(v).T)[0])(sx)
    np.testing.assert_allclose(np.asarray(q), np.linalg.qr(np.asarray(sx).T)[0], atol=1e-4)


def test_rounding_modes():
    a = jsa.as_scaled_array(jnp.ones(4, jnp.float32), scale=np.float32(3.0))
    b = jsa.as_scaled_array(jnp.ones(4, jnp.float32), scale=np.float32(3.0))
    add = jsa.scalify(jnp.add)
    expected = {jsa.Pow2RoundMode.DOWN: 4.0, jsa.Pow2RoundMode.UP: 8.0, jsa.Pow2RoundMode.NONE: np.sqrt(18.0)}
    for mode, scale in expected.items():
        with jsa.ScalifyConfig(rounding_mode=mode):
            out = add(a, b)
        np.testing.assert_allclose(float(out.scale), scale, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out), 2.0, rtol=1e-6)
    with jsa.ScalifyConfig(rounding_mode=jsa.Pow2RoundMode.STOCHASTIC):
        out = add(a, b)
    assert float(out.scale) in (4.0, 8.0)
    np.testing.assert_allclose(np.asarray(out), 2.0, rtol=1e-6)


def test_keep_format_and_dot_output_format():
    sx = jsa.as_scaled_array(X, fmt=qf.MXFP8)
    with jsa.ScalifyConfig(keep_format=True):
        out = jsa.scalify(lambda v: -v)(sx)
    assert out.fmt == qf.MXFP8
    np.testing.assert_allclose(np.asarray(out), -np.asarray(sx))
    out = jsa.scalify(lambda v: -v)(sx)
    assert out.fmt is None and out.data.dtype == np.float32
    w = jsa.as_scaled_array(jnp.asarray(RNG.standard_normal((32, 8)), jnp.float32), fmt=qf.MXFP8.replace(axis=0))
    with jsa.ScalifyConfig(dot_output_format=qf.FP8_E4M3):
        out = jsa.scalify(jnp.matmul)(sx, w)
    assert out.fmt == qf.FP8_E4M3


def test_quantize_inside_program_changes_format():
    def f(v):
        q = jsa.ops.quantize(v * 2.0, qf.MXFP8)
        return q, jsa.ops.quantize(q, "nvfp4")

    q, n = jsa.scalify(f)(make_scaled(X, None))
    assert q.fmt == qf.MXFP8 and n.fmt == qf.NVFP4
    ref = qf.MXFP8.dequantize(*qf.MXFP8.quantize(X * 2.0))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(ref))
    # Plain input, inside a nested jit: still a ScaledArray.
    q2 = jsa.scalify(jax.jit(lambda v: jsa.ops.quantize(v, qf.MXFP8)))(X)
    assert isinstance(q2, jsa.ScaledArray) and q2.fmt == qf.MXFP8


def test_dynamic_rescale_ops():
    sx = jsa.as_scaled_array(X * 100.0, scale=np.float32(1.0))
    for name in ("max", "l1", "l2"):
        op = getattr(jsa.ops, f"dynamic_rescale_{name}")
        out = jsa.scalify(op)(sx)
        np.testing.assert_allclose(np.asarray(out), np.asarray(sx), rtol=1e-6)
        assert float(out.scale) > 1.0
        assert op(X) is X
    # _grad twins: identity forward, rescale backward.
    sg = jsa.as_scaled_array(X * 100.0, scale=np.float32(1.0))
    loss = lambda v: jnp.sum(jsa.ops.dynamic_rescale_max_grad(v) * jax.lax.stop_gradient(v))
    g = jsa.scalify(jax.grad(loss))(sg)
    assert isinstance(g, jsa.ScaledArray)  # the cotangent (= v) is scaled, then rescaled
    np.testing.assert_allclose(np.asarray(g), np.asarray(sg), rtol=1e-6)
    assert float(g.scale) > 64.0 and 1.0 <= float(np.max(np.abs(g.data))) < 2.0


def test_dynamic_rescale_per_block():
    sx = jsa.as_scaled_array(X, fmt=qf.MXFP8)
    out = jsa.scalify(jsa.ops.dynamic_rescale_max)(sx)
    assert out.scale.shape == (4, 1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(sx), rtol=1e-6)


def test_cast_ml_dtype_and_grad():
    sx = jsa.as_scaled_array(jnp.asarray([17.0, 19.0, 1000.0]), scale=np.float32(1.0))
    out = jsa.scalify(lambda v: jsa.ops.cast_ml_dtype(v, ml_dtypes.float8_e4m3fn))(sx)
    # The data is cast to e4m3 (1000 saturates to 448); leaving the program, data outside
    # [2^-7, 2^7] (448) is settled (a power of two moves to the scale), which keeps the value.
    np.testing.assert_array_equal(np.asarray(out), [16.0, 20.0, 448.0])
    with jsa.ScalifyConfig(renormalize="static"):
        out = jsa.scalify(lambda v: jsa.ops.cast_ml_dtype(v, ml_dtypes.float8_e4m3fn))(sx)
    np.testing.assert_array_equal(np.asarray(out.data), [16.0, 20.0, 448.0])
    g = jax.grad(lambda v: jnp.sum(jsa.ops.cast_ml_dtype_grad(v, ml_dtypes.float8_e4m3fn) * 17.0))(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(g), [16.0, 16.0, 16.0])


def test_debug_scale_stats(capsys):
    jsa.ops.scale_stats_log.clear()
    sx = jsa.as_scaled_array(X, scale=np.float32(4.0))
    out = jax.jit(jsa.scalify(lambda v: jsa.ops.debug_scale_stats(v * 2.0, "act")))(sx)
    jax.effects_barrier()
    assert isinstance(out, jsa.ScaledArray)
    (entry,) = jsa.ops.scale_stats_log
    assert entry["name"] == "act" and entry["scale_min"] == entry["scale_max"] == 8.0
    assert "[scalify] act" in capsys.readouterr().out


def test_scaled_array_api():
    sa = jsa.as_scaled_array(jnp.arange(64, dtype=jnp.float32).reshape(2, 32), fmt=qf.NVFP4)
    assert sa.shape == (2, 32) and sa.dtype == np.float32 and sa.ndim == 2 and sa.size == 64
    assert sa.data.shape == (2, 16)
    assert np.asarray(sa).shape == (2, 32)
    assert "ScaledArray(data=" in repr(sa) and "scale=" in repr(sa)
    leaves = jax.tree.leaves(sa)
    assert len(leaves) == 3  # data, block scale, tensor scale
    by_name = jsa.as_scaled_array(X, fmt="mxfp8")
    assert by_name.fmt == qf.MXFP8
    with pytest.raises(ValueError, match="not both"):
        jsa.as_scaled_array(X, scale=1.0, fmt=qf.MXFP8)


@pytest.mark.parametrize("fmt_name", ["scale", "nvfp4"])
def test_while_loop_with_scaled_carry(fmt_name):
    sx = make_scaled(X, FORMATS[fmt_name])

    def f(v):
        def cond(c):
            i, a = c
            return (i < 4) & (jnp.max(jnp.abs(a)) < 1e6)

        def body(c):
            i, a = c
            return i + 1, a * 3.0 + 1.0

        return jax.lax.while_loop(cond, body, (0, v))[1]

    check_against_dequantized(f, sx, rtol=1e-5)
