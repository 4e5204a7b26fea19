"""``jax.experimental.sparse`` under scalify: BCOO / BCSR / COO / CSR products, layout changes,
sums of duplicates and the sparse direct solve, with a scaled dense operand or scaled stored values.

Each program is compared with the same program in float32 on the dequantized values. The rules
either move stored values (exact: the data are not touched), sum them in float32 (exact here: the
sums of at most two values of an 8-bit grid are representable), or run the one float32 product or
solve the float32 program runs on the same values, so the results agree to float32 rounding of the
output settle; the tolerance below (1e-6 relative) is that rounding, well under one step of any
8-bit grid (2^-3 relative for e4m3, 2^-7 for int8).

The rules are registered when the program itself has imported ``jax.experimental.sparse`` (it
imports scipy, which ``import scalify`` does not pay for); a subprocess checks both halves.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.experimental.sparse as sparse
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.sparse import linalg as sparse_linalg

import qformats as qf
import scalify as jsa

RNG = np.random.default_rng(5)
N = 64
# a diagonally dominant sparse matrix (about 10% of entries off the diagonal): spsolve is well posed
M = jnp.asarray(RNG.normal(size=(N, N)) * (RNG.random((N, N)) < 0.1) + 4.0 * np.eye(N), jnp.float32)
X = jnp.asarray(RNG.normal(size=(N, 32)), jnp.float32)
BCOO, BCSR = sparse.BCOO.fromdense(M), sparse.BCSR.fromdense(M)
COO, CSR = sparse.COO.fromdense(M), sparse.CSR.fromdense(M)
NSE = 600  # stored entries for matrices built from the scaled operand (it is dense: the rest are cut)

# name -> program of the scaled dense operand v; each holds the primitive(s) in its name
PROGRAMS = {
    "bcoo_dot_general": lambda v: BCOO @ v,
    "bcoo_dot_general_rhs": lambda v: v.T @ BCOO,
    "bcsr_dot_general": lambda v: BCSR @ v,
    "coo_matmat": lambda v: COO @ v,
    "coo_matvec": lambda v: COO @ v[:, 0],
    "csr_matmat": lambda v: CSR @ v,
    "csr_matvec": lambda v: CSR @ v[:, 0],
    "bcoo_fromdense_transpose_todense": lambda v: sparse.BCOO.fromdense(v, nse=NSE).T.todense(),
    "bcsr_fromdense_todense": lambda v: sparse.BCSR.fromdense(v, nse=NSE).todense(),
    "coo_fromdense_todense": lambda v: sparse.COO.fromdense(v, nse=NSE).todense(),
    "csr_fromdense_todense": lambda v: sparse.CSR.fromdense(v, nse=NSE).todense(),
    "bcoo_extract": lambda v: sparse.bcoo_extract(BCOO, v @ v.T).todense(),
    "bcsr_extract": lambda v: sparse.bcsr_extract(BCSR.indices, BCSR.indptr, v @ v.T),
    "bcoo_spdot_general": lambda v: (BCOO @ sparse.BCOO.fromdense(v, nse=NSE)).todense(),
    "bcoo_dot_general_sampled": lambda v: sparse.bcoo_dot_general_sampled(
        v, v.T, BCOO.indices, dimension_numbers=(((1,), (0,)), ((), ()))
    ),
    "bcoo_sum_duplicates": lambda v: _doubled(sparse.BCOO.fromdense(v, nse=NSE)).sum_duplicates(nse=NSE).todense(),
    "bcoo_sort_indices": lambda v: _doubled(sparse.BCOO.fromdense(v, nse=NSE)).sort_indices().todense(),
    "spsolve": lambda v: sparse_linalg.spsolve(CSR.data, CSR.indices, CSR.indptr, v[:, 0]),
    "sparsify": lambda v: sparse.sparsify(lambda a, u: jnp.tanh(a @ u))(BCOO, v),
}


def _doubled(a):
    """``a`` with every stored entry stored twice (duplicate indices, reversed order)."""
    return sparse.BCOO(
        (jnp.concatenate([a.data, a.data[::-1]]), jnp.concatenate([a.indices, a.indices[::-1]])), shape=a.shape
    )


FORMATS = {
    "carrier": lambda x: jsa.as_scaled_array(x, scale=np.float32(4.0)),
    "fp8_e4m3": lambda x: jsa.as_scaled_array(x, fmt=qf.FP8_E4M3),
    "int8_per_channel": lambda x: jsa.as_scaled_array(x, fmt=qf.INT8_PER_CHANNEL),
    "mxfp8": lambda x: jsa.as_scaled_array(x, fmt=qf.MXFP8),
    "nvfp4": lambda x: jsa.as_scaled_array(x, fmt=qf.NVFP4),
}


def _dense(out):
    return np.asarray(out.to_array() if isinstance(out, jsa.ScaledArray) else out)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", PROGRAMS)
def test_sparse_program_matches_float32_on_dequantized_values(name, fmt):
    f, xs = PROGRAMS[name], FORMATS[fmt](X)
    out = jsa.scalify(f)(xs)
    ref = np.asarray(f(xs.to_array()))
    # a float result stays scaled (a scalified program's values stay in the scaled world)
    assert isinstance(out, jsa.ScaledArray), type(out)
    np.testing.assert_allclose(_dense(out), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8_per_channel"])
def test_scaled_stored_values(fmt):
    """The matrix's stored values are the scaled operand (a quantized sparse weight)."""
    data = FORMATS[fmt](BCOO.data)

    def f(d, v):
        a = sparse.BCOO((d, BCOO.indices), shape=BCOO.shape)
        return a @ v, (a.T @ v).sum(), sparse_linalg.spsolve(d, CSR.indices, CSR.indptr, v[:, 0])

    # spsolve reads d as CSR data: BCOO.fromdense and CSR.fromdense of M store the same entries in
    # the same (row-major) order
    np.testing.assert_array_equal(np.asarray(BCOO.data), np.asarray(CSR.data))
    out = jsa.scalify(f)(data, X)
    ref = f(data.to_array(), X)
    for o, r in zip(out, ref, strict=True):
        r = np.asarray(r)
        np.testing.assert_allclose(_dense(o), r, rtol=1e-6, atol=1e-6 * np.abs(r).max())


def test_gradients_through_a_sparse_product():
    """scalify of the gradient, and the gradient of a scalified program, of ``sum(tanh(A @ v))``."""

    def loss(v):
        return jnp.tanh(BCOO @ v).sum()

    xs = FORMATS["carrier"](X)
    ref = np.asarray(jax.grad(loss)(xs.to_array()))
    g = jsa.scalify(jax.grad(loss))(xs)
    assert isinstance(g, jsa.ScaledArray)
    np.testing.assert_allclose(_dense(g), ref, rtol=1e-6, atol=1e-6)

    def scalified_loss(data):
        out = jsa.scalify(loss)(jsa.ScaledArray(data, xs.scale))
        return out.to_array() if isinstance(out, jsa.ScaledArray) else out

    g_data = jax.grad(scalified_loss)(xs.data)
    # d loss / d data = (d loss / d v) * scale
    np.testing.assert_allclose(np.asarray(g_data), ref * np.float32(xs.scale), rtol=1e-6, atol=1e-6)


def test_rules_are_registered_only_once_the_program_imports_sparse():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np, jax.numpy as jnp
        import scalify, qformats as qf
        assert "jax.experimental.sparse" not in sys.modules, "import scalify imported jax.experimental.sparse"
        from jax.experimental import sparse
        a = sparse.BCOO.fromdense(jnp.eye(4))
        x = scalify.as_scaled_array(jnp.arange(4 * 32.0).reshape(4, 32), fmt=qf.MXFP8)
        out = scalify.scalify(lambda v: a @ v)(x)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
