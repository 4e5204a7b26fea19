"""OTT-JAX's optimal transport solvers on scaled point clouds.

What scalify meets here is OTT's, not ours: a ``PointCloud`` geometry computes its cost matrix
from the two clouds (``|x|^2 + |y|^2 - 2 x y^T`` for the squared Euclidean cost, norms and a
matmul for the cosine cost), and Sinkhorn iterates log-sum-exp (or, in kernel mode, products
with ``exp(-C / eps)``) in a ``while_loop`` until the marginals are within a threshold, with
Anderson acceleration as an option. Its gradient is implicit by default (a lineax solve of the
optimality conditions at the solution) or unrolled through the loop. Also: the debiased Sinkhorn
divergence (three problems), low-rank Sinkhorn (mirror descent on three factors), entropic
Gromov-Wasserstein (a sequence of linear problems on quadratic costs), soft sorting and ranking
(Sinkhorn against a fixed target), and k-means (a ``while_loop`` of assignments). The scaled
operand is one of the point clouds, quantized in the format under test.

Reference: the same program in float32 on the dequantized cloud. Both programs compute the same
function of the same values; they round differently (the carriers' scales, the rules' order of
operations), and the solvers' stopping tests and the problems' conditioning decide how far that
moves the result. The bound is measured on the float32 program itself: its change when every
entry of the cloud is multiplied by ``1 + u``, ``|u| <= 2^-22`` (a few ulps, the size of the
rounding differences), over three draws; the scalified program may differ from float32 by
:data:`PROBE_FACTOR` times the largest of those changes, and never less than :data:`FLOOR`
(relative). Rounding the cloud to E4M3 moves each result by far more (``test_the_bound_detects_
element_rounding``).

One OTT path is not run: Sinkhorn on a ``PointCloud`` with ``batch_size`` (the online cost) calls
``jax.interpreters.batching.is_vmappable``, which JAX 0.10 removed; it fails in plain float32 too
(ott-jax 0.6.0). The implicit gradient of ``soft_sort.sort`` / ``ranks`` (their default) fails in
plain float32 as well (lineax reports a non-finite solve; the gradients here are unrolled,
``implicit_diff=False``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import (
    FEW_FORMATS,
    Case,
    accepts,
    as_float64,
    check_gradient_under_recipe,
    relative_distance,
)

import qformats as qf
import scalify
from scalify import recipes

pytest.importorskip("ott", reason="ott-jax is not installed (pip install -e '.[test]')")
from ott.geometry import costs, geometry, pointcloud
from ott.problems.linear import linear_problem
from ott.problems.quadratic import quadratic_problem
from ott.solvers.linear import acceleration, sinkhorn, sinkhorn_lr
from ott.solvers.quadratic import gromov_wasserstein
from ott.tools import k_means, sinkhorn_divergence, soft_sort

_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((128, 64)).astype(np.float32)
Y = (_RNG.standard_normal((96, 64)) + 0.5).astype(np.float32)

PROBE = 2.0**-22
PROBE_FACTOR = 16.0
FLOOR = 64 * float(np.finfo(np.float32).eps)  # 7.6e-6


def _linear(geom, **kw):
    return sinkhorn.Sinkhorn(**kw)(linear_problem.LinearProblem(geom)).reg_ot_cost


def _gromov(x, y):
    geom_x = pointcloud.PointCloud(x, x, scale_cost="max_cost")
    geom_y = pointcloud.PointCloud(y, y, scale_cost="max_cost")
    solver = gromov_wasserstein.GromovWasserstein(sinkhorn.Sinkhorn(), epsilon=0.05)
    return solver(quadratic_problem.QuadraticProblem(geom_x, geom_y)).reg_gw_cost


def _low_rank(x, y):
    # A pinned iteration count: low-rank Sinkhorn stops when the relative change of its cost, checked
    # every 10 iterations, falls below 1e-3, and where it crosses that threshold rounding decides
    # (measured: float32 stopped after 60 iterations in MXFP8's values and 30 in NVFP4's, the scalified
    # program after 40 in both, costs 2.8e-5 apart, which is the solver's own tolerance; pinned to 200,
    # 1.3e-7 apart).
    problem = linear_problem.LinearProblem(pointcloud.PointCloud(x, y))
    solver = sinkhorn_lr.LRSinkhorn(rank=4, epsilon=0.0, min_iterations=60, max_iterations=60)
    return solver(problem, rng=jax.random.key(0)).reg_ot_cost


# name: (scalar program of the scaled cloud x and the plain cloud y, whether its gradient is tested)
PROGRAMS = {
    "sinkhorn": (lambda x, y: _linear(pointcloud.PointCloud(x, y, epsilon=0.1)), True),
    "sinkhorn_kernel_mode": (
        lambda x, y: _linear(pointcloud.PointCloud(x / 8, y / 8, epsilon=0.5), lse_mode=False),
        True,
    ),
    "sinkhorn_cosine_cost": (
        lambda x, y: _linear(pointcloud.PointCloud(x, y, cost_fn=costs.Cosine(), epsilon=0.05)),
        True,
    ),
    "sinkhorn_cost_matrix": (lambda x, y: _linear(geometry.Geometry(cost_matrix=x @ y.T / 8, epsilon=0.5)), True),
    "sinkhorn_unrolled": (
        lambda x, y: _linear(pointcloud.PointCloud(x, y, epsilon=0.1), implicit_diff=None, max_iterations=200),
        True,
    ),
    "sinkhorn_anderson": (
        lambda x, y: _linear(
            pointcloud.PointCloud(x, y, epsilon=0.1), anderson=acceleration.AndersonAcceleration(memory=3)
        ),
        True,
    ),
    "sinkhorn_divergence": (
        lambda x, y: sinkhorn_divergence.sinkhorn_divergence(pointcloud.PointCloud, x, y, epsilon=0.1)[0],
        True,
    ),
    "low_rank_sinkhorn": (_low_rank, True),
    "gromov_wasserstein": (_gromov, True),
    "soft_sort": (
        lambda x, y: jnp.sum(soft_sort.sort(x[:, 0], epsilon=0.1, implicit_diff=False) * jnp.arange(x.shape[0])),
        False,
    ),
    "soft_rank": (
        lambda x, y: jnp.sum(soft_sort.ranks(x[:, 0], epsilon=0.1, implicit_diff=False) * x[:, 1]),
        True,
    ),
    # The assignments are discrete: the value only.
    "k_means": (lambda x, y: k_means.k_means(x, k=4, rng=jax.random.key(0)).error, False),
}
# Every registered format runs the plain Sinkhorn problem; the other programs add OTT's loops,
# accelerations and geometries around the same rules (matmul, norms, log-sum-exp, exp), so two
# block layouts and a per-channel one run them (slow lane: each case compiles four programs,
# 10-60 s on 2 cores).
EVERY_FORMAT = ("sinkhorn",)
OTHERS = [n for n in PROGRAMS if n not in EVERY_FORMAT]


def _probe_bound(fn, x, y) -> float:
    """:data:`PROBE_FACTOR` times the largest change of float32's ``fn`` when ``x`` is multiplied
    by ``1 + u``, ``u`` uniform in ``[-2^-22, 2^-22]`` (three draws); at least :data:`FLOOR`."""
    ref = as_float64(fn(x, y))
    moved = []
    for seed in range(3):
        u = np.random.default_rng(seed).uniform(-PROBE, PROBE, x.shape).astype(np.float32)
        moved.append(relative_distance(as_float64(fn(x * (1 + u), y)), ref))
    return max(PROBE_FACTOR * max(moved), FLOOR)


def _check(name, fmt_name):
    fn, with_grad = PROGRAMS[name]
    fmt = qf.get_format(fmt_name)
    if not accepts(fmt, X):
        pytest.skip(f"{fmt_name}'s layout does not accept a {X.shape} cloud (its block is larger)")
    qx = scalify.as_scaled_array(jnp.asarray(X), fmt=fmt)
    x, y = qx.to_array(jnp.float32), jnp.asarray(Y)
    pairs = [(fn, "value")] + ([(jax.grad(fn), "gradient")] if with_grad else [])
    for program, what in pairs:
        ref_fn = jax.jit(program)
        ref = as_float64(ref_fn(x, y))
        got = as_float64(jax.jit(scalify.scalify(program))(qx, y))
        assert np.isfinite(got).all(), f"{name} {what}: non-finite under {fmt_name}"
        bound = _probe_bound(ref_fn, x, y)
        assert relative_distance(got, ref) <= bound, (
            f"{name} {what}: {relative_distance(got, ref):.2e} from float32, bound {bound:.2e}"
        )


def test_sinkhorn_in_every_format(fmt_name):
    """Entropic OT cost and its implicit gradient, the scaled cloud in every registered format."""
    for name in EVERY_FORMAT:
        _check(name, fmt_name)


# The slow lane: the fast lane's time on CI's 2 cores (a clean-clone run took 74 min with them).
@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", FEW_FORMATS)
@pytest.mark.parametrize("name", OTHERS)
def test_ott_program(name, fmt_name):
    """An OTT solver or tool on the scaled cloud (value, and gradient where it has one)."""
    _check(name, fmt_name)


def test_the_bound_detects_element_rounding():
    """Rounding the cloud to E4M3 (what a rule that quantized an intermediate would do) moves the
    OT cost and its gradient by over ten times the bound."""
    fn = PROGRAMS["sinkhorn"][0]
    x, y = jnp.asarray(X), jnp.asarray(Y)
    rounded = x.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    for program in (jax.jit(fn), jax.jit(jax.grad(fn))):
        moved = relative_distance(as_float64(program(rounded, y)), as_float64(program(x, y)))
        assert moved > 10 * _probe_bound(program, x, y)


# Under a recipe the clouds are computed by a linear layer (an embedding a model learned), so the
# recipe quantizes that GEMM's operands; OTT's own products (the cost matrix of two activations
# among them) are contractions the recipe meets inside Sinkhorn's loop and gradient.
W = (_RNG.standard_normal((64, 64)) / 8).astype(np.float32)


def _embedded_ot(w, batch):
    x, y = batch
    return _linear(pointcloud.PointCloud(x @ w, y @ w, epsilon=0.1))


@pytest.mark.parametrize("recipe", [recipes.MXFP8, recipes.FLOAT8_TENSORWISE, recipes.NVFP4], ids=lambda r: r.name)
def test_embedded_ot_under_a_recipe(recipe):
    """The gradient of the OT cost between two embedded clouds in the embedding, taken inside
    ``recipes.apply`` and outside: equal bit for bit, and as far from float32's as noise at the
    recipe's rounding puts it (``check_gradient_under_recipe``)."""
    check_gradient_under_recipe(
        Case("embedded_ot", _embedded_ot, jnp.asarray(W), (jnp.asarray(X), jnp.asarray(Y))), recipe
    )
