"""lineax's linear solvers and optimistix's implicit layers on scaled operands.

What scalify meets here is lineax's and optimistix's, not ours: ``lx.linear_solve`` is an equinox
primitive of lineax's own (no rule: scalify walks its implementation), whose solvers bind JAX's
factorizations (LU, ``jnp.linalg.qr(mode="raw")``'s ``geqrf``, SVD, Cholesky) or run Krylov loops
(CG, GMRES, BiCGStab) whose matrix-vector products read the scaled matrix; its transpose rule (the
gradient) solves with the transposed operator, and GMRES solves its Hessenberg least-squares
problem by calling ``linear_solve`` again from inside ``linear_solve``. optimistix's ``fixed_point``
(a deep-equilibrium layer, Newton's method) differentiates by the implicit function theorem, a
lineax solve in the backward pass.

Two things were broken before this suite: ``geqrf`` / ``geqp3`` had no rule (lineax's QR solver,
GMRES, ``slogdet(method="qr")``), and a library primitive whose implementation binds the same
primitive again for another job was refused (GMRES).

Reference: the same program in float32 on the dequantized matrix. The tolerance is the float32
rounding of a solve amplified by the matrix's condition number: a backward-stable direct solve is
within ``cond * O(n) * eps32`` of the exact one, and both programs are; the normal equations square
the condition number. An iterative solve stops when its residual is below ``rtol * |b|``, so two
runs that round differently may stop at solutions ``cond * rtol`` apart. If any operand were
rounded to the format's elements (2**-4 for E4M3) the solution would move by far more than these
bounds (``test_tolerance_detects_element_rounding``: over 100 times the direct bound, over 10 times
the iterative one).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import accepts, cosine, flat_values

import qformats as qf
import scalify
from scalify import recipes

lx = pytest.importorskip("lineax", reason="lineax is not installed (pip install -e '.[test]')")
optx = pytest.importorskip("optimistix", reason="optimistix is not installed (pip install -e '.[test]')")

N = 64
EPS32 = float(np.finfo(np.float32).eps)
ITER_RTOL = 1e-4  # float32 Krylov solves at 1e-5 sit on their rounding floor (GMRES stagnates)

_RNG = np.random.default_rng(7)
_G = _RNG.standard_normal((N, N))
GENERAL = (_G + 16.0 * np.eye(N)).astype(np.float32)  # eigenvalues in a disc of radius ~8 around 16
SPD = (_G @ _G.T / N + np.eye(N)).astype(np.float32)
RHS = _RNG.standard_normal(N).astype(np.float32)
TARGET = _RNG.standard_normal(N).astype(np.float32)

_PSD = (lx.positive_semidefinite_tag,)
# name: (solver, matrix, operator tags, iterative, normal equations)
SOLVERS = {
    "LU": (lx.LU(), GENERAL, (), False, False),
    "QR": (lx.QR(), GENERAL, (), False, False),
    "SVD": (lx.SVD(), GENERAL, (), False, False),
    "AutoLinearSolver": (lx.AutoLinearSolver(well_posed=True), GENERAL, (), False, False),
    "Cholesky": (lx.Cholesky(), SPD, _PSD, False, False),
    "Normal": (lx.Normal(lx.Cholesky()), GENERAL, (), False, True),
    "CG": (lx.CG(rtol=ITER_RTOL, atol=ITER_RTOL), SPD, _PSD, True, False),
    "GMRES": (lx.GMRES(rtol=ITER_RTOL, atol=ITER_RTOL, restart=N), GENERAL, (), True, False),
    # On GENERAL lineax's BiCGStab reports breakdown in plain float32 too (measured at rtol 1e-4
    # to 1e-6); the symmetric matrix, untagged, is a general operator to it.
    "BiCGStab": (lx.BiCGStab(rtol=ITER_RTOL, atol=ITER_RTOL), SPD, (), True, False),
}


def _solve_loss(solver, tags):
    def loss(m, b):
        x = lx.linear_solve(lx.MatrixLinearOperator(m, tags), b, solver).value
        return jnp.sum((x - TARGET) ** 2)

    return loss


def _outcome(fn, *args):
    """``(value, None)``, or ``(None, lineax's message)`` where the solve reports a failure."""
    try:
        return jax.block_until_ready(fn(*args)), None
    except Exception as err:  # lineax's error_if: EquinoxRuntimeError, or JaxRuntimeError under jit
        found = re.search(
            r"(A linear solver returned non-finite|A form of iterative breakdown|stagnation|maximum number)", str(err)
        )
        if found is None:
            raise
        return None, found.group(1)


def _value(x):
    return np.asarray(x.to_array() if isinstance(x, scalify.ScaledArray) else x, np.float64)


def _tolerance(m, iterative, normal):
    cond = float(np.linalg.cond(np.asarray(m, np.float64)))
    if iterative:
        return 4 * cond * ITER_RTOL
    return (cond**2 if normal else cond) * N * EPS32


@pytest.mark.parametrize("name", list(SOLVERS))
def test_linear_solve_and_its_gradient(name, fmt_name):
    """``sum((solve(A, b) - t)^2)`` and its gradient in ``A`` and ``b`` (lineax's transpose rule:
    a solve with ``A^T``), ``A`` a scaled matrix, against float32 on the dequantized ``A``."""
    solver, matrix, tags, iterative, normal = SOLVERS[name]
    fmt = qf.get_format(fmt_name)
    if not accepts(fmt, matrix):
        pytest.skip(f"{fmt_name}'s layout does not accept a {N}x{N} matrix (its block is larger)")
    qm = scalify.as_scaled_array(jnp.asarray(matrix), fmt=fmt)
    m = qm.to_array()
    loss = jax.value_and_grad(_solve_loss(solver, tags), argnums=(0, 1))
    b = jnp.asarray(RHS)
    ref, ref_failure = _outcome(jax.jit(loss), m, b)
    got, got_failure = _outcome(jax.jit(scalify.scalify(loss)), qm, b)
    # MXFP4's rounding leaves SPD non-symmetric: lineax's CG returns non-finite values and
    # BiCGStab reports breakdown on the dequantized matrix in float32 too (measured).
    # The scalified program must then fail the same way, not return a number.
    assert got_failure == ref_failure
    if ref_failure is not None:
        return
    (ref_v, ref_g), (got_v, got_g) = ref, got
    tol = _tolerance(m, iterative, normal)
    np.testing.assert_allclose(_value(got_v), _value(ref_v), rtol=tol)
    for got, ref, what in zip(got_g, ref_g, ("dA", "db"), strict=True):
        ref = _value(ref)
        np.testing.assert_allclose(_value(got), ref, rtol=0, atol=tol * np.max(np.abs(ref)), err_msg=what)


def test_tolerance_detects_element_rounding():
    """The bounds are far below what rounding the matrix to E4M3 would do to the solution."""
    m = jnp.asarray(GENERAL)
    rounded = m.astype(jnp.float8_e4m3fn).astype(jnp.float32)

    def solve(a):
        return np.asarray(lx.linear_solve(lx.MatrixLinearOperator(a), jnp.asarray(RHS), lx.LU()).value)

    moved = np.max(np.abs(solve(rounded) - solve(m))) / np.max(np.abs(solve(m)))
    assert moved > 100 * _tolerance(m, False, False)
    assert moved > 10 * _tolerance(m, True, False)


# A deep-equilibrium layer: z = tanh(z W + x U), solved by Newton's method, differentiated by the
# implicit function theorem (optimistix's default adjoint; a lineax solve in the backward pass).
D, BATCH = 32, 32
_W = (_RNG.standard_normal((D, D)) * 0.3 / np.sqrt(D)).astype(np.float32)  # a contraction: unique z
_U = (_RNG.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
_X = _RNG.standard_normal((BATCH, D)).astype(np.float32)
_T = _RNG.standard_normal((BATCH, D)).astype(np.float32)
DEQ_RTOL = 1e-5


def _deq_loss(params, x, t):
    w, u = params

    def fn(z, args):
        return jnp.tanh(z @ args[0] + args[1])

    injected = x @ u
    with jax.named_scope("deq_solve"):
        z = optx.fixed_point(fn, optx.Newton(rtol=DEQ_RTOL, atol=DEQ_RTOL), jnp.zeros_like(x), args=(w, injected)).value
    return jnp.mean((z - t) ** 2)


def test_deep_equilibrium_layer(fmt_name):
    """The DEQ's loss and its implicit gradient in both scaled weights, against float32."""
    fmt = qf.get_format(fmt_name)
    if not accepts(fmt, _W):
        pytest.skip(f"{fmt_name}'s layout does not accept a {D}x{D} weight (its block is larger)")
    qparams = tuple(scalify.as_scaled_array(jnp.asarray(a), fmt=fmt) for a in (_W, _U))
    params = tuple(q.to_array() for q in qparams)
    ref_v, ref_g = jax.value_and_grad(_deq_loss)(params, _X, _T)
    got_v, got_g = jax.jit(scalify.scalify(jax.value_and_grad(_deq_loss)))(qparams, _X, _T)
    # Newton stops within rtol of the fixed point; the map is a contraction (|W| ~ 0.3), so the
    # two programs' fixed points are within a few rtol, the loss and gradients likewise.
    tol = 10 * DEQ_RTOL
    np.testing.assert_allclose(_value(got_v), _value(ref_v), rtol=tol)
    for got, ref in zip(got_g, ref_g, strict=True):
        ref = _value(ref)
        np.testing.assert_allclose(_value(got), ref, rtol=0, atol=tol * np.max(np.abs(ref)))


def test_deep_equilibrium_layer_under_a_recipe():
    """Under a recipe the solve's own contraction would be quantized, and Newton cannot reach a
    tolerance below the recipe's rounding (float8: optimistix raises "maximum number of steps");
    a high-precision scope around the solve keeps it in float32 while ``x @ U`` is quantized. The
    gradient then matches the float32 program to the recipe's rounding of that one GEMM."""
    recipe = recipes.FLOAT8_TENSORWISE.replace(high_precision_scopes=("deq_solve",))
    params = (jnp.asarray(_W), jnp.asarray(_U))
    ref_v, ref_g = jax.value_and_grad(_deq_loss)(params, _X, _T)
    got_v, got_g = jax.jit(recipes.apply(jax.value_and_grad(_deq_loss), recipe))(params, _X, _T)
    # E4M3's unit roundoff is 2**-4: one quantized GEMM feeding a contraction moves the loss and
    # gradients by a few percent at most, and by more than the float32 bound (it is quantized).
    rel = abs(float(got_v) - float(ref_v)) / abs(float(ref_v))
    assert 1e-4 < rel < 0.05
    for got, ref in zip(got_g, ref_g, strict=True):
        assert cosine(flat_values(got), flat_values(ref)) > 0.99
    with pytest.raises(Exception, match="maximum number of steps"):
        jax.jit(recipes.apply(_deq_loss, recipes.FLOAT8_TENSORWISE))(params, _X, _T).block_until_ready()


# optimistix's other solvers, with a scaled data matrix X (64 x 32) in their functions: nonlinear
# least squares ``tanh(X y) ~ t``, a regularised minimisation of the same residual, and a root of
# ``A y + 0.1 tanh(y) = c`` with ``A = X^T X / n + I``; the output is the solution and the
# gradient of ``|y|^2`` in X (optimistix's implicit adjoint: a lineax solve at the solution).
# What they add to the rules is their loops, line searches, trust regions and adjoints, so three
# formats (two block layouts and a per-channel one) run them; the rules they meet inside (matmul,
# tanh, mean) are tested in every format by the cases above and tests/scalify.
OPTX_RTOL = 1e-5
_XD = _RNG.standard_normal((64, 32)).astype(np.float32)
_TD = np.tanh(_XD @ (_RNG.standard_normal(32) * 0.3)).astype(np.float32) + np.float32(0.01) * _RNG.standard_normal(
    64
).astype(np.float32)


def _least_squares(solver):
    def f(x, t):
        res = lambda y, args: jnp.tanh(args[0] @ y) - args[1]
        return optx.least_squares(res, solver, jnp.zeros(x.shape[1]), args=(x, t), max_steps=256).value

    return f


def _minimise(solver):
    def f(x, t):
        fn = lambda y, args: jnp.mean((jnp.tanh(args[0] @ y) - args[1]) ** 2) + 1e-2 * jnp.sum(y**2)
        return optx.minimise(fn, solver, jnp.zeros(x.shape[1]), args=(x, t), max_steps=512).value

    return f


def _root_find(solver):
    def f(x, t):
        a = x.T @ x / x.shape[0] + jnp.eye(x.shape[1])
        fn = lambda y, args: args[0] @ y + 0.1 * jnp.tanh(y) - args[1][: y.shape[0]]
        return optx.root_find(fn, solver, jnp.zeros(x.shape[1]), args=(a, t), max_steps=256).value

    return f


_TOL = {"rtol": OPTX_RTOL, "atol": OPTX_RTOL}
# name: (program, bound on the solution's difference relative to its largest entry). Root finders
# and least-squares solvers stop when a step is below rtol |y| + atol and converge at least
# linearly here, so each run is within a few rtol of the exact solution: 20 rtol. Minimisers
# whose line searches compare objective values locate a minimum only to about sqrt(eps32) |y|
# (the objective is flat there to first order): 4 sqrt(eps32) ~ 1.4e-3. The implicit gradient is
# a linear function of the solution's error through the Jacobian: 5 times the bound. Measured
# worst cases over the three formats, solution / gradient: Dogleg 9.8e-5 / 4.0e-4, LM 3.0e-5 /
# 1.1e-4, GaussNewton, Newton and Chord below 2.1e-5; BFGS 3.1e-4 / 5.6e-4, NonlinearCG 3.8e-4 /
# 1.5e-3. Rounding X to E4M3 would move them by ~2**-4.
# The regularisation (1e-2) keeps the minimum well defined: with 1e-3 the objective (~1e-4) is
# within atol of flat over a region that rounding decides where the line searches stop in (a
# one-ulp change of X moved NonlinearCG's solution by 1.2e-3, the scalified run 1.4e-2 and 2.7e-2
# in MXFP8 and NVFP4, while its objective and gradient at a given point agree with float32 to 1-3e-7).
_FLAT = 4 * float(np.sqrt(EPS32))
OPTX_SOLVERS = {
    "LevenbergMarquardt": (_least_squares(optx.LevenbergMarquardt(**_TOL)), 20 * OPTX_RTOL),
    "GaussNewton": (_least_squares(optx.GaussNewton(**_TOL)), 20 * OPTX_RTOL),
    "Dogleg": (_least_squares(optx.Dogleg(**_TOL)), 20 * OPTX_RTOL),
    "BFGS": (_minimise(optx.BFGS(**_TOL)), _FLAT),
    "NonlinearCG": (_minimise(optx.NonlinearCG(**_TOL)), _FLAT),
    "Newton": (_root_find(optx.Newton(**_TOL)), 20 * OPTX_RTOL),
    "Chord": (_root_find(optx.Chord(**_TOL)), 20 * OPTX_RTOL),
}


@pytest.mark.parametrize("fmt_name", ["mxfp8", "nvfp4", "int8_per_channel"])
@pytest.mark.parametrize("name", list(OPTX_SOLVERS))
def test_optimistix_solver(name, fmt_name):
    """The solution and its implicit gradient with X scaled, against float32 on the dequantized X."""
    program, bound = OPTX_SOLVERS[name]
    qx = scalify.as_scaled_array(jnp.asarray(_XD), fmt=qf.get_format(fmt_name))
    x, t = qx.to_array(), jnp.asarray(_TD)
    grad = jax.grad(lambda x, t: jnp.sum(program(x, t) ** 2))
    for fn, got_fn, tol in ((program, scalify.scalify(program), bound), (grad, scalify.scalify(grad), 5 * bound)):
        ref = _value(jax.jit(fn)(x, t))
        got = _value(jax.jit(got_fn)(qx, t))
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.max(np.abs(ref)))
