"""Every rule, for every format: scalify(f)(scaled) == f(dequantized inputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FORMATS, check_against_dequantized, fast_jit, make_scaled

import qformats as qf
import scalify as jsa

RNG = np.random.default_rng(0)
X = (RNG.standard_normal((4, 32)) * 3).astype(np.float32)
Y = (RNG.standard_normal((4, 32)) * 0.5).astype(np.float32)

CMAT = jnp.asarray(RNG.standard_normal((32, 8)) + 1j * RNG.standard_normal((32, 8)), jnp.complex64) / 4


def _standard(f):
    """``f`` traced under JAX's default type promotion (real times complex promotes)."""

    def g(*xs):
        with jax.numpy_dtype_promotion("standard"):
            return f(*xs)

    return g


def _parts(z):
    """A complex array as its real and imaginary parts, stacked (the comparison is of reals)."""
    return jnp.stack([jnp.real(z), jnp.imag(z)])


def _bcoo(x):
    from jax.experimental import sparse

    return sparse.BCOO.fromdense(x, nse=x.size)


def _lru(x):
    """A diagonal complex linear recurrence over the rows of ``x`` (Orvieto et al.'s LRU):
    ``h_t = lambda * h_{t-1} + B x_t`` by ``associative_scan``, output ``Re(C h_t)``."""
    lam = jnp.exp(-0.1 + 1j * jnp.linspace(0.0, 3.0, 8)).astype(jnp.complex64)

    def combine(p, q):
        return q[0] * p[0], q[0] * p[1] + q[1]

    _, h = jax.lax.associative_scan(combine, (jnp.broadcast_to(lam, (x.shape[0], 8)), x @ CMAT))
    return jnp.real(h @ CMAT.T)


UNARY = {
    "neg": lambda x: -x,
    "abs": jnp.abs,
    "exp": jnp.exp,
    "log": lambda x: jnp.log(jnp.abs(x) + 1.0),
    "tanh": jnp.tanh,
    "logistic": jax.nn.sigmoid,
    "erf": jax.scipy.special.erf,
    "sqrt": lambda x: jnp.sqrt(jnp.abs(x)),
    "rsqrt": lambda x: jax.lax.rsqrt(jnp.abs(x) + 1.0),
    "square": jnp.square,
    "cube": lambda x: x**3,
    "sin_cos": lambda x: jnp.sin(x) + jnp.cos(x),
    "log1p": lambda x: jnp.log1p(jnp.abs(x)),
    "sign": jnp.sign,
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "log_softmax": jax.nn.log_softmax,
    "logsumexp": lambda x: jax.nn.logsumexp(x, axis=-1),
    "softmax": jax.nn.softmax,
    "erf_inv": lambda x: jax.scipy.special.erfinv(jnp.tanh(x) * 0.9),
    "pow": lambda x: jnp.power(jnp.abs(x) + 1.0, 1.5),
    "clip": lambda x: jnp.clip(x, -1.0, 2.0),
    "round": jnp.round,
    "astype_f16": lambda x: x.astype(jnp.float16).astype(jnp.float32),
    "isfinite": lambda x: jnp.where(jnp.isfinite(x), x, 0.0),
    "reshape": lambda x: x.reshape(8, 16),
    "reshape_flat": lambda x: x.reshape(-1),
    "transpose": lambda x: x.T,
    "slice": lambda x: x[1:3, 8:24],
    "rev": lambda x: x[::-1, ::-1],
    "broadcast": lambda x: jnp.broadcast_to(x[None], (2, 4, 32)),
    "expand_squeeze": lambda x: jnp.squeeze(x[:, None, :], 1),
    "sum_all": jnp.sum,
    "sum_0": lambda x: jnp.sum(x, axis=0),
    "sum_1": lambda x: jnp.sum(x, axis=1),
    "mean": jnp.mean,
    "var": lambda x: jnp.var(x, axis=-1),
    "max_1": lambda x: jnp.max(x, axis=1),
    "min_0": lambda x: jnp.min(x, axis=0),
    "argmax": lambda x: jnp.argmax(x, axis=-1),
    "top_k_values": lambda x: jax.lax.top_k(x, 5)[0],
    "top_k_indices": lambda x: jax.lax.top_k(x, 5)[1],
    "top_k_grad": jax.grad(lambda x: jnp.sum(jax.lax.top_k(x, 2)[0] ** 2)),
    "approx_max_k": lambda x: jax.lax.approx_max_k(x, 3)[0],
    "sort_1": lambda x: jnp.sort(x, axis=1),
    "sort_0": lambda x: jnp.sort(x, axis=0),
    "argsort": lambda x: jnp.argsort(x, axis=-1),
    "sort_with_values": lambda x: jax.lax.sort((x, x * 2.0), num_keys=1)[1],
    # F-Net's token mixing (KerasHub): real(fft2(complex(x, 0))), and its gradient
    "fnet_mixing": lambda x: jnp.real(jnp.fft.fft2(jax.lax.complex(x, jnp.zeros_like(x)))),
    "fnet_mixing_grad": jax.grad(lambda x: jnp.sum(jnp.real(jnp.fft.fft2(jax.lax.complex(x, jnp.zeros_like(x)))) ** 2)),
    "fft2_of_real": lambda x: jnp.imag(jnp.fft.fft2(x)),
    "rfft_irfft": lambda x: jnp.fft.irfft(jnp.fft.rfft(x, axis=-1) * jnp.arange(17, dtype=jnp.complex64), axis=-1),
    "complex_conj": lambda x: jnp.imag(jnp.conj(jax.lax.complex(x, x * 0.5))),
    # Real features times a complex matrix (a linear recurrent unit's B @ u and C @ h): JAX binds
    # dot_general(float32, complex64) with a complex accumulator; both parts of the product are
    # compared. Formatted operand, carrier operand, complex on the left, and the gradient; traced
    # with JAX's default ("standard") promotion, which mixes the two (the suite runs "strict").
    "complex_matmul": _standard(lambda x: _parts(x @ CMAT)),
    "complex_matmul_carrier": _standard(lambda x: _parts((x * 3.0) @ CMAT)),
    "complex_matmul_left": _standard(lambda x: _parts(CMAT.T[:, :4] @ x)),
    "complex_einsum": _standard(lambda x: _parts(jnp.einsum("bd,hd->bh", x, CMAT.T))),
    "complex_matmul_grad": _standard(jax.grad(lambda x: jnp.sum(jnp.abs(x @ CMAT) ** 2))),
    "complex_recurrence": _standard(lambda x: _lru(x)),
    # The other contractions JAX binds on a real and a complex operand: a grouped GEMM, a sparse product.
    "complex_ragged_dot": _standard(
        lambda x: _parts(
            jax.lax.ragged_dot(
                x.T, CMAT.reshape(4, 8, 8)[:, :4], jnp.array([8, 8, 8, 8]), preferred_element_type=jnp.complex64
            )
        )
    ),
    "complex_sparse_dot": _standard(lambda x: _parts(_bcoo(x) @ CMAT[:, 0])),
    "cumsum": lambda x: jnp.cumsum(x, axis=0),
    "cumsum_1": lambda x: jnp.cumsum(x, axis=1),
    "concat_self": lambda x: jnp.concatenate([x, -x], axis=0),
    "pad": lambda x: jnp.pad(x, ((1, 1), (0, 0))),
    "take": lambda x: x[jnp.array([2, 0, 3])],
    "dynamic_slice": lambda x: jax.lax.dynamic_slice(x, (1, 0), (2, 32)),
    "scalar_mul": lambda x: x * 3.0 + 1.0,
    "layer_norm": lambda x: (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5),
    "gram": lambda x: x @ x.T,
}

BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": lambda a, b: a / (jnp.abs(b) + 1.0),
    "max": jnp.maximum,
    "min": jnp.minimum,
    "where": lambda a, b: jnp.where(a > b, a, b),
    "compare": lambda a, b: (a >= b).astype(jnp.float32),
    "concat": lambda a, b: jnp.concatenate([a, b], axis=1),
    "stack": lambda a, b: jnp.stack([a, b]),
    "matmul_t": lambda a, b: a @ b.T,
}


def _check_all(fns, args, rtol=1e-5, tolerances=None):
    """Run every function of ``fns`` in one jitted scalify call and compare each output.

    One compilation per format keeps the suite fast; a failure lists every failing operator.
    """
    tolerances = tolerances or {}
    deq = [np.asarray(a) if isinstance(a, jsa.ScaledArray) else a for a in args]

    def many(*xs):
        return {name: fn(*xs) for name, fn in fns.items()}

    expected = fast_jit(many, *[jnp.asarray(d) for d in deq])
    got = fast_jit(jsa.scalify(many), *args)
    failures = []
    for name in fns:
        e, g = np.asarray(expected[name], np.float64), np.asarray(got[name], np.float64)
        tol = tolerances.get(name, rtol)
        try:
            # the magnitude of the finite values (an empty segment's -inf would make any atol pass);
            # assert_allclose itself requires infinities and NaNs in the same places
            top = float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0))
            np.testing.assert_allclose(g, e, rtol=tol, atol=tol * max(1.0, top))
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


def test_unary(fmt):
    # A cast rounds the data, not the value: with non power-of-two scales (int8 per-channel, NVFP4's
    # E4M3 block scales) the two roundings differ by up to one float16 ulp (2**-11 relative).
    _check_all(UNARY, [make_scaled(X, fmt)], tolerances={"astype_f16": 1e-3})


def test_unary_eager_sample(fmt):
    """A few operators without jit (op-by-op dispatch of the interpreter)."""
    for name in ("relu", "log_softmax", "reshape", "sum_1", "gram"):
        check_against_dequantized(UNARY[name], make_scaled(X, fmt))


def test_binary(fmt):
    _check_all(BINARY, [make_scaled(X, fmt), make_scaled(Y, fmt, scale=0.5)])


def test_binary_mixed_plain(fmt):
    _check_all(
        {k: BINARY[k] for k in ("add", "mul", "max", "where", "matmul_t")}, [make_scaled(X, fmt), jnp.asarray(Y)]
    )


# Factorizations, solves and the scatters of segment reductions on a well-conditioned matrix
# (eigenvalues in [24, 40]: the float32 results are far from any branch of the algorithms).
_A = RNG.standard_normal((32, 32)).astype(np.float32)
SQUARE = (_A @ _A.T / np.float32(32) + np.float32(24) * np.eye(32, dtype=np.float32)).astype(np.float32)
RHS = RNG.standard_normal((32, 4)).astype(np.float32)
SEGMENTS = np.repeat(np.arange(4), 8)  # segment 4 of 5 is empty: its max is -inf, its min +inf


def _gp_nll(k, y):
    """A Gaussian process's negative log likelihood (the Cholesky route of GP libraries)."""
    c = jax.scipy.linalg.cho_factor(k, lower=True)
    return 0.5 * jnp.sum(y * jax.scipy.linalg.cho_solve(c, y)) + jnp.sum(jnp.log(jnp.diagonal(c[0])))


LINALG = {
    "cholesky": lambda a, b: jnp.linalg.cholesky(a),
    "solve": jnp.linalg.solve,
    "inv": lambda a, b: jnp.linalg.inv(a),
    "slogdet": lambda a, b: jnp.linalg.slogdet(a)[1],
    "eigh_values": lambda a, b: jnp.linalg.eigh(a)[0],
    "eigh_vectors_abs": lambda a, b: jnp.abs(jnp.linalg.eigh(a)[1][:, -1]),  # the sign is arbitrary
    "svd_values": lambda a, b: jnp.linalg.svd(a, compute_uv=False),
    "norm_2": lambda a, b: jnp.linalg.norm(a, ord=2),
    "qr_r_abs": lambda a, b: jnp.abs(jnp.linalg.qr(a)[1]),
    # geqrf / geqp3 directly: lineax's QR solver (mode="raw"), slogdet(method="qr"), qr_multiply
    "qr_raw": lambda a, b: jnp.abs(jnp.linalg.qr(a, mode="raw")[0]),
    "slogdet_qr": lambda a, b: jnp.linalg.slogdet(a, method="qr")[1],
    "qr_multiply": lambda a, b: jnp.abs(jax.scipy.linalg.qr_multiply(a, b)[0]),
    "qr_multiply_pivoting": lambda a, b: jnp.abs(jax.scipy.linalg.qr_multiply(a, b.T, pivoting=True)[1]),
    "lstsq": lambda a, b: jnp.linalg.lstsq(a, b)[0],
    "solve_triangular": lambda a, b: jax.scipy.linalg.solve_triangular(jnp.tril(a), b, lower=True),
    "eigvals_abs": lambda a, b: jnp.sort(jnp.abs(jnp.linalg.eigvals(a))),
    "gp_nll": _gp_nll,
    "gp_nll_grad": jax.grad(_gp_nll),
    "solve_grad": jax.grad(lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2)),
    "segment_max": lambda a, b: jax.ops.segment_max(a, SEGMENTS, 5),
    "segment_min": lambda a, b: jax.ops.segment_min(a, SEGMENTS, 5),
    "segment_max_grad": jax.grad(lambda a, b: jnp.sum(jax.ops.segment_max(a, SEGMENTS, 4) ** 2)),
    "segment_prod": lambda a, b: jax.ops.segment_prod(a[:, :4] / 8.0, SEGMENTS, 5),
    "at_max": lambda a, b: a.at[jnp.array([3, 0, 3])].max(b[:3, :1]),
    "lax_reduce": lambda a, b: jax.lax.reduce(a, np.float32(0), lambda x, y: x + y * y, (0,)),
    # total-order comparisons: expm's lt_to, searchsorted's le_to
    "expm": lambda a, b: jax.scipy.linalg.expm(a / 32.0),
    "searchsorted": lambda a, b: jnp.searchsorted(jnp.sort(a[0]), a[1]),
}


@pytest.mark.parametrize("name", ["scale", "fp8_e4m3", "mxfp8", "nvfp4"])
def test_linalg_and_segment_reductions(name):
    """Before these rules, each raised ScalifyUnsupportedError (lu, cholesky, eigh, svd, qr,
    triangular_solve, eig, scatter-max/min/mul, reduce, lt_to, le_to). The rules dequantize or
    fold, so four layouts cover them: a carrier, per-tensor FP8 (whose E4M3 data cannot hold the
    empty segment's -inf fill), MX blocks and two-level NVFP4."""
    fmt = FORMATS[name]
    _check_all(LINALG, [make_scaled(SQUARE, fmt), make_scaled(RHS.repeat(8, axis=1), fmt)])


def _host_double(x):
    return np.asarray(x) * 2


SUBCHANNEL = np.float32(2.0) ** RNG.integers(-3, 4, (2, 32, 2)).astype(np.float32)
BITS_AND_EMPTY = {
    # bitcast_convert_type reads the value's bits; a host callback receives numpy values
    "signbit": lambda a, b: jnp.signbit(a - 0.5),
    "copysign": lambda a, b: jnp.copysign(a, b),
    "frexp": lambda a, b: jnp.frexp(a)[0] + jnp.frexp(a)[1].astype(jnp.float32),
    "ldexp": lambda a, b: jnp.ldexp(a, 3),
    "spacing": lambda a, b: jnp.spacing(a) / jnp.spacing(jnp.float32(1)),
    "pure_callback": lambda a, b: jax.pure_callback(_host_double, jax.ShapeDtypeStruct(a.shape, a.dtype), a),
    # associative_scan's last level slices out empty arrays (scale grids with a zero extent)
    "associative_scan": lambda a, b: jax.lax.associative_scan(jnp.add, a, axis=0),
    "linear_recurrence": lambda a, b: jax.lax.associative_scan(
        lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (jax.nn.sigmoid(a), b), axis=1
    )[1],
    "empty_matmul": lambda a, b: a[:, :0] @ b.T[:0, :] + jnp.concatenate([a[:0], a]).sum(),
    # a block-scaled GEMM whose scales the program supplies (sub-channels of 16 along K = 32)
    "scaled_dot": lambda a, b: jax.lax.scaled_dot(
        a, b, lhs_scale=SUBCHANNEL[0], rhs_scale=SUBCHANNEL[1].T, preferred_element_type=jnp.float32
    ),
    "scaled_dot_bf16": lambda a, b: jax.lax.scaled_dot(a, b).astype(jnp.float32),
    # the gradient of gammainc in its shape parameter (igamma_grad_a had no rule)
    "gammainc_grad_a": jax.grad(lambda a, b: jnp.sum(jax.scipy.special.gammainc(jnp.abs(a) + 0.5, 2.0))),
}


@pytest.mark.parametrize("name", ["scale", "fp8_e4m3", "int8_per_channel", "mxfp8", "nvfp4"])
def test_bits_callbacks_and_empty_arrays(name):
    """Before these rules: ScalifyUnsupportedError on bitcast_convert_type, pure_callback, igamma_grad_a and
    lax.scaled_dot, and a ZeroDivisionError from the scale grid of an empty slice (associative_scan)."""
    fmt = FORMATS[name]
    _check_all(BITS_AND_EMPTY, [make_scaled(SQUARE, fmt), make_scaled(RHS.repeat(8, axis=1), fmt)])


def _cg_loss(a, v):
    return jnp.sum(jax.scipy.sparse.linalg.cg(lambda u: a @ u, v, tol=1e-7)[0] ** 2)


def _gmres_loss(a, v):
    return jnp.sum(jax.scipy.sparse.linalg.gmres(lambda u: a @ u, v, tol=1e-7)[0] ** 2)


def _custom_solve_loss(a, v):
    def solve(_, r):
        return jnp.linalg.solve(a, r)

    def transpose_solve(_, r):
        return jnp.linalg.solve(a.T, r)

    return jnp.sum(jnp.sin(jax.lax.custom_linear_solve(lambda u: a @ u, v, solve, transpose_solve)))


# A non-symmetric, well-conditioned matrix for gmres and the custom solve (cg needs SQUARE's symmetry).
SKEWED = (SQUARE + 2.0 * RNG.standard_normal((32, 32))).astype(np.float32)
SOLVES = {"cg": (_cg_loss, SQUARE), "gmres": (_gmres_loss, SKEWED), "custom": (_custom_solve_loss, SKEWED)}


@pytest.mark.parametrize(
    "name", ["scale", "fp8_e4m3", *(pytest.param(n, marks=pytest.mark.slow) for n in ("mxfp8", "nvfp4"))]
)
def test_matrix_free_solves(name):
    """``custom_linear_solve`` (jax.scipy.sparse.linalg's cg and gmres, a user's solve), in both
    orders. ``scalify(grad(f))``: the gradient JAX builds holds a transposed solve. ``grad(scalify(f))``:
    JAX differentiates the re-emitted solve with its implicit rules (before the rule, the solve was
    inlined and the while loop inside it cannot be reverse-differentiated; gmres raised
    ScalifyUnsupportedError in both orders). The gradient of a carrier is taken on its leaves and
    mapped to the value's (``ct_v = ct_data / scale``); a formatted matrix is not differentiable
    (its data is narrow), so there only the right-hand side's. Tolerance: solves to 1e-7 residual in
    float32, measured differences up to 6e-7. The rule flattens the constants whatever their format
    (the carrier and stored FP8 run in the fast lane, MX and NVFP4 in the slow one)."""
    fmt = FORMATS[name]
    v = jnp.asarray(RNG.standard_normal(32), jnp.float32)
    for solver, (loss, m) in SOLVES.items():
        _check_solve_gradients(solver, loss, make_scaled(m, fmt), v)


def _check_solve_gradients(solver, loss, qa, v):
    def close(got, expected):
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(np.asarray(g), e, rtol=1e-5, atol=1e-5 * float(jnp.abs(e).max()), err_msg=solver)

    expected = jax.grad(loss, (0, 1))(jnp.asarray(np.asarray(qa)), v)
    close(fast_jit(jsa.scalify(jax.grad(loss, (0, 1))), qa, v), expected)

    def value(a, u):
        return jnp.asarray(jsa.scalify(loss)(a, u))

    if qa.fmt is None:
        ct_data, ct_v = fast_jit(jax.grad(lambda d, u: value(jsa.ScaledArray(d, qa.scale), u), (0, 1)), qa.data, v)
        close((ct_data / qa.scale, ct_v), expected)
    else:
        close((fast_jit(jax.grad(value, 1), qa, v),), expected[1:])


def test_matrix_free_solve_keeps_the_stored_matrix():
    """The solver's matvec gets the FP8 matrix as stored (its float8 data is an operand of the
    re-emitted custom_linear_solve), not a float32 copy made before the loop."""
    qa = jsa.as_scaled_array(jnp.asarray(SQUARE), fmt=qf.FP8_E4M3)
    v = jnp.ones(32, jnp.float32)
    eqns = jax.make_jaxpr(jsa.scalify(_cg_loss))(qa, v).jaxpr.eqns
    (solve,) = [e for e in _all_eqns(eqns) if e.primitive.name == "custom_linear_solve"]
    assert any(x.aval.dtype == qa.data.dtype for x in solve.invars), [x.aval for x in solve.invars]


def _all_eqns(eqns):
    for e in eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _all_eqns(sub.eqns)


def _weight_formats(fmt):
    """Weights (K, N): the same format, and for block formats the MX hardware layout (blocked on K)."""
    out = [fmt]
    if fmt is not None and isinstance(fmt.layout, qf.Blocked):
        out.append(fmt.replace(axis=0))
    return out


@pytest.mark.parametrize("layout", [0, 1])
def test_matmul(fmt, layout):
    wfmts = _weight_formats(fmt)
    if layout >= len(wfmts):
        pytest.skip("single layout for this format")
    w = (RNG.standard_normal((32, 64)) * 0.1).astype(np.float32)
    sw = make_scaled(w, wfmts[layout], scale=0.125)
    check_against_dequantized(lambda a, b: a @ b, make_scaled(X, fmt), sw, rtol=1e-4)


def test_blocked_dot_is_one_float32_dot():
    """MX layout on both operands, blocked along K: one float32 dot of the dequantized operands
    (exact per element), no per-block partial outputs; equal to the float32 product."""
    a = jsa.as_scaled_array(jnp.asarray(RNG.standard_normal((4, 96)), jnp.float32), fmt=qf.MXFP8)
    b = jsa.as_scaled_array(jnp.asarray(RNG.standard_normal((96, 16)), jnp.float32), fmt=qf.MXFP8.replace(axis=0))
    jaxpr = jax.make_jaxpr(jsa.scalify(lambda u, v: u @ v))(a, b)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and not dots[0].params["dimension_numbers"][1][0]
    assert dots[0].params["preferred_element_type"] == np.float32
    np.testing.assert_allclose(
        np.asarray(jsa.scalify(lambda u, v: u @ v)(a, b)), np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-4
    )


def test_embedding_lookup(fmt):
    table = (RNG.standard_normal((16, 32))).astype(np.float32)
    idx = jnp.array([[1, 5, 7], [0, 15, 3]])
    check_against_dequantized(lambda t: t[idx], make_scaled(table, fmt))


def test_conv(fmt):
    x = RNG.standard_normal((2, 8, 8, 32)).astype(np.float32)
    w = (RNG.standard_normal((3, 3, 32, 32)) * 0.1).astype(np.float32)

    def f(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    check_against_dequantized(f, make_scaled(x, fmt), make_scaled(w, fmt, scale=0.125), rtol=1e-4)


def test_pooling(fmt):
    x = RNG.standard_normal((2, 8, 8, 32)).astype(np.float32)

    def f(x):
        mx = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        avg = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
        return mx + avg

    check_against_dequantized(f, make_scaled(x, fmt))


@pytest.mark.parametrize("fmt_name", ["scale", "mxfp8"])
def test_pooling_grad(fmt_name):
    x = jnp.asarray(RNG.standard_normal((2, 8, 8, 32)).astype(np.float32))
    sx = make_scaled(x, FORMATS[fmt_name])

    def f(x):
        mx = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.sum(mx * mx)

    g = jsa.scalify(jax.grad(f))(sx)
    np.testing.assert_allclose(np.asarray(g), jax.grad(f)(jnp.asarray(np.asarray(sx))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("fmt_name", ["int8_per_channel", "mxfp8"])
def test_low_precision_carrier(dtype, fmt_name):
    """Formats on float16 / bfloat16 tensors: carrier data stays O(1), products cannot overflow."""
    fmt = FORMATS[fmt_name]
    x = jnp.asarray(RNG.standard_normal((8, 64)) * 100.0, dtype)
    w = jnp.asarray(RNG.standard_normal((64, 32)) * 100.0, dtype)
    wfmt = fmt.replace(axis=0) if isinstance(fmt.layout, qf.Blocked) else fmt
    sx, sw = jsa.as_scaled_array(x, fmt=fmt), jsa.as_scaled_array(w, fmt=wfmt)
    assert sx.dtype == dtype

    def f(a, b):
        return jax.nn.gelu(a @ b) * 2.0 + jnp.sum(a * a, axis=-1, keepdims=True)[:, :1]

    out = jax.jit(jsa.scalify(f))(sx, sw)
    assert out.dtype == dtype
    ref = f(jnp.asarray(np.asarray(sx), jnp.float32), jnp.asarray(np.asarray(sw), jnp.float32))
    got = np.asarray(out.to_array(jnp.float32))
    assert np.all(np.isfinite(got))  # the float32 reference reaches ~1e6: beyond float16's range
    rtol = 1e-2 if dtype == jnp.bfloat16 else 2e-3
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * float(np.max(np.abs(ref))))
