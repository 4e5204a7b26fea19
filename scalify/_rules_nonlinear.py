"""Nonlinear rules: the simplest exact rule that keeps values in range, else dequantize-compute-requantize.

* bounded outputs (tanh, logistic, erf, sin, ...): computed on the float32 value, output scale 1
  (a float16 carrier is re-quantized on its amax: at scale 1 small results would be subnormal);
* log: ``log(data) + log(scale)``; roots and integer powers act on data and scale separately;
* everything else (exp, pow, erf_inv, ...): the value is computed in float32 and re-quantized to a
  per-tensor carrier whose scale is the output's absolute max rounded to a power of two, so the
  result can never overflow the carrier dtype.
"""

from __future__ import annotations

import jax.lax.linalg as linalg
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify._jax_compat import bind_eqn, host_callback_ps, lax_primitives, p, ref_write_ps
from scalify._pow2 import pow2_round
from scalify._registry import ScalifyUnsupportedError, register_rule, register_when_imported
from scalify._rules_common import (
    F32,
    bound_of,
    dequant,
    note_bound,
    product_bound,
    renormalize,
    requant,
    rescale,
    safe_scale,
    unit,
    wide,
)
from scalify._scaled_array import ScaledArray, cast, expand_scale


def _prims(*names, module=p):
    return [getattr(module, n) for n in names if hasattr(module, n)]


def _out_dtype(eqn):
    return eqn.outvars[0].aval.dtype


def _f32_eval(eqn, *xs):
    outs = bind_eqn(eqn, [dequant(x) for x in xs])
    return outs[0]


@register_rule(
    _prims(
        "tanh_p",
        "logistic_p",
        "erf_p",
        "erfc_p",
        "sin_p",
        "cos_p",
        "atan_p",
        "asin_p",
        "acos_p",
        "bessel_i0e_p",
        "bessel_i1e_p",
    ),
    "nonlinear",
    "bounded output: f(value) in float32, output carrier with scale 1 (float16: scale = amax rounded to 2^k).",
)
def _bounded(eqn, *xs):
    # |f| <= 1 for tanh, logistic, erf, sin, cos, bessel_i*e; <= 2 for erfc; <= pi for atan/asin/acos.
    return _unit(_f32_eval(eqn, *xs), _out_dtype(eqn), bound=4.0)


def _unit(v, dtype, bound=None):
    """Carrier with scale 1 of a bounded float32 result; a narrow carrier (float16) is re-quantized
    on its amax instead: at scale 1 its subnormals hold ``tanh(1e-5)`` to two digits and flush
    ``tanh(2^-30)`` (or ``log(1 + 2^-30)``) to 0, which the float32 value keeps."""
    return unit(v, dtype, bound) if wide(dtype) else requant(v, dtype)


@register_rule(
    p.log_p,
    "nonlinear",
    "log(data) + log(scale) in float32; output carrier with scale 1 (float16: scale = amax rounded to 2^k).",
)
def _log(eqn, x):
    val = lax.add(lax.log(cast(x.data, F32)), expand_scale(lax.log(x.scale), x.data.shape))
    return _unit(val, _out_dtype(eqn))


@register_rule(
    p.log1p_p,
    "nonlinear",
    "log1p(value) in float32; output carrier with scale 1 (float16: scale = amax rounded to 2^k).",
)
def _log1p(eqn, x):
    return _unit(_f32_eval(eqn, x), _out_dtype(eqn))


def _root(eqn, x, fn, power):
    """``f(data)`` with scale ``f(scale)`` rounded to a power of two, the remainder (in ``[1, 2)``)
    folded into the data. ``|data|^power`` bounds the result's data (``power`` >= 0); a negative
    power (rsqrt) has no bound, so its output, typically small (one value per row of a norm), is
    renormalised: the products it feeds then need no pass over their larger operand."""
    s_exact = fn(x.scale)
    s_new = safe_scale(pow2_round(s_exact))
    (data,) = bind_eqn(eqn, [x.data])
    out = ScaledArray(rescale(data, lax.div(s_exact, s_new)), s_new)
    if power < 0:
        return renormalize(cast(out.data, F32), out.scale, out.data.dtype)
    hi = bound_of(x)
    return out if hi is None else note_bound(out, 2.0 * max(hi, 1.0) ** power)


register_rule(p.sqrt_p, "nonlinear", "sqrt(data), scale sqrt(scale) rounded to 2^k (remainder folded into data).")(
    lambda eqn, x: _root(eqn, x, lax.sqrt, 0.5)
)
register_rule(
    p.rsqrt_p,
    "nonlinear",
    "rsqrt(data), scale rsqrt(scale) rounded to 2^k (remainder folded into data), renormalised (amax to 2^k).",
)(lambda eqn, x: _root(eqn, x, lambda s: lax.div(np.float32(1.0), lax.sqrt(s)), -0.5))
register_rule(p.cbrt_p, "nonlinear", "cbrt(data), scale cbrt(scale) rounded to 2^k (remainder folded into data).")(
    lambda eqn, x: _root(eqn, x, lax.cbrt, 1.0 / 3.0)
)


def _power(eqn, x, n: int, scale_fn):
    """``data**n`` with scale ``scale_fn(scale) = scale**n``; the data bound goes to the n-th power.

    Data of unknown magnitude (an input carrier, ``data = x / 2^k`` for any ``k``), or whose n-th
    power could leave the carrier's range, is renormalised first (each block's amax, a power of
    two, moved into the scale: exact), as ``mul`` does for ``a * a``: ``data**3`` of float16 data
    261 overflows, and ``scale**3`` of scale 2^63 is float32 Inf next to data that underflowed.
    A negative power is computed in float32 and renormalised (small data have huge reciprocals).
    """
    dtype = x.data.dtype
    if jnp.issubdtype(dtype, jnp.floating):
        hi = bound_of(x)
        if n < 0 or (n >= 2 and (hi is None or max(hi, 1.0) ** n > product_bound(dtype))):
            x = renormalize(cast(x.data, F32), x.scale, dtype)
        if n < 0:
            (q,) = bind_eqn(eqn, [cast(x.data, F32)])
            return renormalize(q, scale_fn(x.scale), dtype)
    (data,) = bind_eqn(eqn, [x.data])
    out = ScaledArray(data, scale_fn(x.scale))
    hi = bound_of(x)
    return out if hi is None or n < 0 else note_bound(out, max(hi, 1.0) ** n)


@register_rule(p.integer_pow_p, "nonlinear", "data**n, scale**n (exact for power-of-two scales).")
def _integer_pow(eqn, x):
    y = eqn.params["y"]
    return _power(eqn, x, y, lambda s: lax.integer_pow(s, y))


@register_rule(p.square_p, "nonlinear", "data**2, scale**2.")
def _square(eqn, x):
    return _power(eqn, x, 2, lambda s: lax.mul(s, s))


@register_rule(
    _prims("complex_p", "fft_p", "imag_p", "conj_p"),
    "nonlinear",
    "complex values (lax.complex, FFTs, imag, conj): computed from the float32 operands, plain complex64 "
    "output (complex dtypes have no narrow form to carry); real/abs of it are plain.",
)
def _complex(eqn, *xs):
    return _f32_eval(eqn, *xs)


_GENERIC = _prims(
    "exp_p",
    "exp2_p",
    "expm1_p",
    "pow_p",
    "erf_inv_p",
    "sinh_p",
    "cosh_p",
    "tan_p",
    "asinh_p",
    "acosh_p",
    "atanh_p",
    "atan2_p",
    "lgamma_p",
    "digamma_p",
    "floor_p",
    "ceil_p",
    "round_p",
    "rem_p",
    "nextafter_p",
    "cumprod_p",
    "cumlogsumexp_p",
    "reduce_prod_p",
    "reduce_window_p",
    "igamma_p",
    "igammac_p",
    "igamma_grad_a_p",
    "polygamma_p",
    "zeta_p",
    "regularized_incomplete_beta_p",
    "random_gamma_grad_p",
)


# Factorizations and solves: their outputs are new values (eigenvalues, factors, solutions) with
# ranges of their own, so no scale carries over; several have several outputs (eigh: vectors and
# values; lu: factors, pivots, permutation). The generic variadic reduce is here too: its
# computation is an arbitrary jaxpr, typed in the program's dtype.
_FACTORIZATIONS = _prims(
    "cholesky_p",
    "cholesky_update_p",
    "eig_p",
    "eigh_p",
    "hessenberg_p",
    "householder_product_p",
    "lu_p",
    "ormqr_p",
    "qr_p",
    "schur_p",
    "svd_p",
    "symmetric_product_p",
    "triangular_solve_p",
    "tridiagonal_p",
    "tridiagonal_solve_p",
    module=linalg,
) + lax_primitives(  # not exported by jax.lax.linalg; bound by jnp.linalg.qr(mode="raw") (lineax's QR
    # solver), slogdet(method="qr") and jax.scipy.linalg.qr_multiply (geqp3 with pivoting=True)
    "geqrf",
    "geqp3",
)


@register_rule(
    _FACTORIZATIONS + _prims("scatter_mul_p", "reduce_p"),
    "nonlinear",
    "dequantize, compute in float32 (reduce: in the program's dtype, which its computation is typed in), "
    "re-quantize each floating output: per-tensor carrier, scale = amax rounded to 2^k; integer "
    "(pivots) and complex (eig) outputs plain.",
)
def _dequantized_outputs(eqn, *xs):
    """``f(values)`` for every output of ``eqn``: ``requant(out)`` for a floating output, else ``out``."""
    typed = eqn.primitive is p.reduce_p
    dtypes = [v.aval.dtype if typed and jnp.issubdtype(v.aval.dtype, jnp.floating) else F32 for v in eqn.invars]
    outs = bind_eqn(eqn, [dequant(x, d) for x, d in zip(xs, dtypes, strict=True)])
    outs = [
        requant(o, v.aval.dtype) if jnp.issubdtype(o.dtype, jnp.floating) else o
        for o, v in zip(outs, eqn.outvars, strict=True)
    ]
    return outs if eqn.primitive.multiple_results else outs[0]


register_rule(
    _GENERIC,
    "nonlinear",
    "dequantize, compute in float32, re-quantize: per-tensor carrier, scale = amax rounded to 2^k.",
)(_dequantized_outputs)


def _register_sparse_solve():
    from jax.experimental.sparse import linalg as sparse_linalg

    register_rule(
        [sparse_linalg.spsolve_p],
        "nonlinear",
        "jax.experimental.sparse (rule registered once it is imported): spsolve, a sparse direct solve, is not linear "
        "in the matrix: dequantize, solve in float32, re-quantize (per-tensor carrier, scale = amax rounded to 2^k).",
    )(_dequantized_outputs)


register_when_imported("jax.experimental.sparse", _register_sparse_solve)


@register_rule(
    [p.bitcast_convert_type_p, *host_callback_ps, *lax_primitives("scaled_dot")],
    "nonlinear",
    "on the values: operands dequantized to the program's dtype, plain outputs. bitcast_convert_type "
    "(jnp.signbit, copysign, frexp, ldexp, spacing) reads the bits of the value, which a scale does not "
    "multiply; a host callback (jax.pure_callback, io_callback) receives numpy arrays, which carry no scale; "
    "lax.scaled_dot is a block-scaled GEMM whose scales the program supplies itself (its operands are the values "
    "they scale, its output type the program's).",
)
def _on_values(eqn, *xs):
    """``f(values)``, each operand as the value the program holds, in the program's dtype."""
    outs = bind_eqn(eqn, [dequant(x, v.aval.dtype) for x, v in zip(xs, eqn.invars, strict=True)])
    return outs if eqn.primitive.multiple_results else outs[0]


@register_rule(
    ref_write_ps,
    "nonlinear",
    "a jax.ref holds plain values of its declared dtype: a carrier is stored as its value (data times its "
    "power-of-two scale, exact); a formatted value is refused (dequantize it to store it in high precision).",
    raw=True,
)
def _write_ref(eqn, ref, value, *indexers):
    """``ref[idx] = value`` (swap, which returns the old value) or ``ref[idx] += value`` (addupdate).

    A carrier is what scalify's arithmetic produces (an optimizer's update of a float32 parameter
    held in a ref, a gradient accumulated into one): the float32 program stores that value, and the
    carrier's value is exact in float32. A formatted value (FP8/MX/NVFP4 codes) stored in a plain ref
    would be silently widened, so it is refused with the explicit way to do it."""
    if not isinstance(value, ScaledArray) or any(isinstance(i, ScaledArray) for i in indexers):
        raise ScalifyUnsupportedError(f"`{eqn.primitive.name}` received a scaled ref index: indices must be integers")
    if value.fmt is not None:
        raise ScalifyUnsupportedError(
            f"`{eqn.primitive.name}` would store a {value.fmt.name} ScaledArray in a jax.ref of "
            f"{eqn.invars[0].aval.inner_aval.dtype}, which holds plain values: its {value.fmt.name} codes "
            "would be widened silently. Store `scalify.ops.dequantize(x)` to keep the value in high "
            "precision, or keep the quantized value out of the ref (return it, or carry it through a loop)."
        )
    return bind_eqn(eqn, [ref, dequant(value, eqn.invars[1].aval.dtype), *indexers])
