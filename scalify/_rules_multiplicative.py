"""Multiplicative rules: scales multiply (mul, div, dot_general, conv_general_dilated).

Contractions with an operand in a ``qformats`` format run one of the strategies of
``scalify/_contraction.py`` (``ScalifyConfig(contraction=...)``). Contractions of carriers only, under
``"auto"``:

* no operand has a block boundary along a contracted axis (per-tensor, per-channel on a free axis):
  the scales factor out of the sum, ``out = dot(dA, dB) / r`` with scale ``grid(sA) x grid(sB) * r``
  where ``r`` is a power of two near ``sqrt(K)`` (jax-scalify's growth allowance); the dot accumulates
  in float32 and is rounded to the carrier dtype once, after the division;
* a scale that varies along a contracted axis (MX and NVFP4 blocks, two per-channel scales meeting
  on the contracted axis of a backward pass): both operands are dequantized to float32 (exact:
  element times power-of-two or E4M3 scale), contracted by one float32 ``dot_general`` and
  re-quantized per-tensor (``ScalifyConfig.dot_output_format`` re-quantizes into a format instead).
  Nothing of size K/block times the output is materialised. Float32 and bfloat16 carriers fold such
  a scale to per-tensor instead (exact in float32's range), which keeps the data bound, so the
  contraction is the plain GEMM of the data with nothing measured after it;
* float32 and bfloat16 carriers whose scales both vary along free axes fold the one with fewer
  scales: the output keeps one operand's grid, not their outer product (a scale per element).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify import _contraction
from scalify._config import get_config
from scalify._jax_compat import bind_eqn, bind_eqn_with, lax_primitive, p
from scalify._pow2 import is_pow2
from scalify._registry import register_rule, register_when_imported
from scalify._rules_common import (
    F32,
    _grid_shapes_compatible,
    bound_of,
    dequant,
    fold,
    is_runtime_plain,
    is_scaled,
    measured,
    note_bound,
    per_tensor,
    product_bound,
    promote,
    renormalize,
    settle,
    split_static,
    sqrt_rescale,
    static_scalar,
    times,
    wide,
)
from scalify._scaled_array import ScaledArray, cast, to_carrier

# Equation parameters hold NumPy dtypes (other interpreters, such as amp, read them as dtypes).
_F32_DTYPE = np.dtype(np.float32)


def _promoted(a, b):
    """Both operands as carriers whose block grids broadcast (folded to per-tensor if they do not)."""
    pa, pb = promote(a, zero_adopts=False), promote(b, zero_adopts=False)
    if _grid_shapes_compatible([pa, pb]) is None:
        pa, pb = fold(pa), fold(pb)
    return pa, pb


def _binary(eqn, a, b, op_scale):
    pa, pb = _promoted(a, b)
    (data,) = bind_eqn(eqn, [pa.data, pb.data])
    return ScaledArray(data, op_scale(pa.scale, pb.scale))


def _binary_f32(eqn, pa, pb, op_scale):
    """``(op(data_a, data_b) in float32, op_scale(scales) as a grid)`` of promoted operands."""
    q = eqn.primitive.bind(cast(pa.data, F32), cast(pb.data, F32))
    return q, _grid_of(op_scale(pa.scale, pb.scale), q.ndim)


def _renormalized(x):
    """``x`` renormalised per block (data bound 2), from its float32 data."""
    return renormalize(x.data.astype(F32), x.scale, x.data.dtype)


def _bounded_factors(a, b, limit: float):
    """The factors of a carrier product with known data bounds whose product is at most ``limit``:
    an operand of unknown magnitude is renormalised (bound 2) first; an operand with a known bound
    above 2 only if the product would still exceed ``limit`` (each renormalising is one reduction
    over the operand)."""
    a = _renormalized(a) if bound_of(a) is None else a
    b = _renormalized(b) if bound_of(b) is None else b
    if bound_of(a) * bound_of(b) > limit and bound_of(a) > 2.0:
        a = _renormalized(a)
    if bound_of(a) * bound_of(b) > limit and bound_of(b) > 2.0:
        b = _renormalized(b)
    return a, b


@register_rule(
    p.mul_p,
    "multiplicative",
    "data * data, scale * scale (block grids broadcast; static scalars split exactly into 2^k). Two "
    "runtime scaled operands are renormalised per block first, so their data product stays in range.",
    keeps_format=True,
)
def _mul(eqn, a, b):
    for x, y in ((a, b), (b, a)):
        v = static_scalar(y)
        if is_scaled(x) and v is not None and v != 0.0 and np.isfinite(v) and _same_shape(eqn, x):
            return _times_static(x, v)
    if is_scaled(a) and is_scaled(b) and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        # Data of unknown magnitude (an input, or drifted) would underflow or overflow when
        # multiplied (g * g in Adam): data 1e-25 with scale 1e20 gives data 0 and scale inf. Moving
        # each block's amax (a power of two) into the scale is exact; operands whose data bound is
        # known (settled, decoded, bounded functions) need no pass over the data when the product's
        # bound stays small.
        a, b = _bounded_factors(a, b, product_bound(jnp.result_type(a.data.dtype, b.data.dtype)))
        return note_bound(_binary(eqn, a, b, lax.mul), bound_of(a) * bound_of(b))
    out_dtype = eqn.outvars[0].aval.dtype
    if jnp.issubdtype(out_dtype, jnp.floating) and not wide(out_dtype) and any(is_runtime_plain(x) for x in (a, b)):
        # A plain runtime operand has scale 1 and a magnitude unknown at trace time: in a narrow
        # carrier its product with the other's data overflows (float16: plain 2^15 times data 4)
        # or flushes. As for a quotient: the product in float32, renormalised per block.
        return renormalize(*_binary_f32(eqn, *_promoted(a, b), lax.mul), out_dtype)
    return _binary(eqn, a, b, lax.mul)


@register_rule(
    p.div_p,
    "multiplicative",
    "data / data in float32, scale / scale (block grids broadcast); the quotient is renormalised per "
    "block (amax rounded to 2^k moved into the scale) so it cannot overflow the carrier dtype.",
    keeps_format=True,
)
def _div(eqn, a, b):
    pa, pb = _promoted(a, b)
    out_dtype = eqn.outvars[0].aval.dtype
    v = static_scalar(b)
    if is_scaled(a) and v is not None and v != 0.0 and np.isfinite(v) and _same_shape(eqn, a):
        return _times_static(a, 1.0 / v) if is_pow2(v) else _over_static(a, v)
    if not jnp.issubdtype(out_dtype, jnp.floating) or v not in (None, 0.0):
        # A static divisor is split into 2^k * [1, 2): the data at most halves, nothing to renormalise.
        (data,) = bind_eqn(eqn, [pa.data, pb.data])
        return ScaledArray(data, lax.div(pa.scale, pb.scale))
    q, scale = _binary_f32(eqn, pa, pb, lax.div)
    if wide(out_dtype):
        # The float32 quotient is the carrier's data as it is (a pass to renormalise it would only
        # protect a narrow carrier's range).
        return ScaledArray(cast(q, out_dtype), scale)
    return renormalize(q, scale, out_dtype)


def _same_shape(eqn, x: ScaledArray) -> bool:
    """Whether ``x``'s data already has the output shape (no implicit broadcast of ``x``)."""
    aval = eqn.outvars[0].aval
    return tuple(x.data.shape) == tuple(aval.shape) and jnp.issubdtype(aval.dtype, jnp.floating)


def _times_static(x: ScaledArray, v: float) -> ScaledArray:
    """``x * v`` for a static ``v = m * 2^e`` (``1 <= |m| < 2``): data * m, scale * 2^e.

    A power of two (``m = 1``) only touches the scale; the mantissa is a single carrier-dtype
    multiply, as in the plain program.
    """
    m, e = split_static(v)
    data = x.data if m == 1.0 else lax.mul(x.data, np.asarray(m, x.data.dtype))
    out = ScaledArray(data, times(x.scale, e))
    hi = bound_of(x)
    return out if hi is None else note_bound(out, hi * abs(m))


def _over_static(x: ScaledArray, v: float) -> ScaledArray:
    """``x / v`` for a static ``v = m * 2^e``: data / m, scale / 2^e (the data at most halves)."""
    m, e = split_static(v)
    data = lax.div(x.data, np.asarray(m, x.data.dtype))
    return ScaledArray(data, times(x.scale, 1.0 / e))


def _grid_of(scale, ndim):
    """A broadcast scale as 0-d or rank-matched (size-1 grids collapse to 0-d)."""
    scale = jnp.asarray(scale, F32)
    if scale.ndim == 0 or scale.size == 1:
        return scale.reshape(())
    return scale.reshape((1,) * (ndim - scale.ndim) + tuple(scale.shape))


def _grid(x: ScaledArray):
    s = x.scale
    return s.reshape((1,) * x.data.ndim) if s.ndim == 0 else s


def _finish(value_f32, dtype):
    """Per-tensor carrier of a float32 contraction result: scale 1, settled (a power of two moves
    into the scale only when the amax leaves the window), or re-quantized into ``dot_output_format``."""
    return _contraction.output_format(settle(value_f32, jnp.ones((), F32), dtype), dtype)


def _dequant_dot(eqn, a, b, *rest):
    """``eqn``'s contraction (``dot_general``, ``ragged_dot_general`` with its group sizes in
    ``rest``) of the dequantized operands, accumulated in float32."""
    params = dict(eqn.params, preferred_element_type=_F32_DTYPE)
    out = eqn.primitive.bind(dequant(a), dequant(b), *rest, **params)
    return _finish(out, eqn.outvars[0].aval.dtype)


def _bounded_operands(eqn, a: ScaledArray, b: ScaledArray):
    """Under the measured policy, a float32 / bfloat16 contraction's operands of unknown data bound
    (a plain input, a drifted carrier) are renormalised first when together they are smaller than
    the output: passes over the operands instead of a settling pass over the output, and the
    output's bound is then static (:func:`_contracted`). The gradient of an RNN's weight, accumulated from
    ``(batch, in)`` slices into an ``(in, out)`` sum, measures the slice, not the sum."""
    out = eqn.outvars[0].aval
    dtype = _carrier(eqn, a, b)
    if not (measured() and jnp.issubdtype(dtype, jnp.floating) and wide(dtype)):
        return a, b

    unknown = [bound_of(x) is None and jnp.issubdtype(x.data.dtype, jnp.floating) for x in (a, b)]
    if sum(x.data.size for x, u in zip((a, b), unknown, strict=True) if u) >= out.size:
        return a, b
    return tuple(_renormalized(x) if u else x for x, u in zip((a, b), unknown, strict=True))


# Largest static data bound a float32 / bfloat16 contraction output keeps without measuring:
# half of float32's exponent range above 1. Its consumers check bounds again (a product of two
# such outputs renormalises them first, a sum divides by its growth allowance).
_WIDE_CONTRACTION_BOUND = 2.0**64


def _contracted(eqn, a: ScaledArray, b: ScaledArray, k: int, r: float, scale, out_dtype) -> ScaledArray:
    """The carrier of ``eqn`` (a dot or convolution of ``k`` products per output) on the data of
    ``a`` and ``b`` with scale ``scale``.

    The float32 accumulator is divided by the growth allowance ``r`` (2^k near sqrt(K), jax-scalify's
    static estimate) and the scale multiplied by it; under ``ScalifyConfig(renormalize="amax")``
    (the default) the result is then settled on its measured amax when that leaves the window
    (correlated or cancelling terms make the static estimate drift). A float32 or bfloat16 output
    whose data bound follows from the operands' (``k * |a| * |b|`` at most 2^64)
    needs neither: it is the plain float32 contraction of the data, the scale is the scales'
    product, cancellation can only shrink the data (which float32's range holds), and nothing
    stands between the contraction and its consumer (a transposed gradient accumulated in a loop
    is one GEMM and one add, as in the float32 program, instead of four passes).
    """
    ha, hb = bound_of(a), bound_of(b)
    static = ha is not None and hb is not None and k * ha * hb <= _WIDE_CONTRACTION_BOUND
    if static and measured() and jnp.issubdtype(out_dtype, jnp.floating) and wide(out_dtype):
        # No allowance either: the contraction then feeds its consumer directly, so XLA folds a
        # transpose of it into the GEMM as it does in the float32 program.
        data, _ = _contract(eqn, a.data, b.data, 1.0)
        return note_bound(ScaledArray(cast(data, out_dtype), scale), k * ha * hb)
    data, applied = _contract(eqn, a.data, b.data, r, keep_f32=measured())
    if measured() and jnp.issubdtype(data.dtype, jnp.floating):
        return settle(data, times(scale, applied), out_dtype)
    return ScaledArray(data, times(scale, applied))


def _contract(eqn, da, db, r: float, keep_f32: bool = False):
    """``(data, r)``: ``eqn`` (a dot or convolution) on the data, divided by the growth allowance
    ``r`` (2^k), and the allowance actually applied (the caller multiplies the scale by it).

    A floating result is accumulated in float32 and rounded once after the division (or kept in
    float32 with ``keep_f32``): the allowance then guards the carrier dtype against the sum's
    growth, instead of being applied to an already rounded (possibly overflowed) carrier-dtype
    result. An integer result is exact as it is and would be truncated by the division: no allowance.
    """
    dtype = eqn.params.get("preferred_element_type") or jnp.result_type(da.dtype, db.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return bind_eqn(eqn, [da, db])[0], 1.0
    if r == 1.0 and not keep_f32:
        return bind_eqn(eqn, [da, db])[0], 1.0
    (acc,) = bind_eqn_with(eqn, [da, db], preferred_element_type=_F32_DTYPE)
    acc = acc if r == 1.0 else lax.mul(acc, np.float32(1.0 / r))
    return (acc if keep_f32 else cast(acc, dtype)), r


def _complex_valued(eqn) -> bool:
    """Whether a contraction reads or writes complex values (``B @ u`` of a complex recurrence with
    real features ``u``: JAX binds ``dot_general``, ``ragged_dot_general`` and the sparse products
    on a complex64 and a float32 operand with a complex64 accumulator; a convolution takes one
    dtype, so a real ScaledArray never meets a complex kernel there)."""
    return any(jnp.issubdtype(v.aval.dtype, jnp.complexfloating) for v in (*eqn.invars, *eqn.outvars))


def _complex_contraction(eqn, *operands):
    """A contraction with a complex operand or output, on the float32 values of the scaled operands
    with the equation's own parameters (its complex accumulator): plain complex output, as every
    complex value under ``scalify`` (complex dtypes have no narrow form to carry). The real-valued
    strategies accumulate in float32, which would drop the imaginary part."""
    values = [x.to_array(F32) if isinstance(x, ScaledArray) else x for x in operands]
    outs = bind_eqn(eqn, values)
    return outs if eqn.primitive.multiple_results else outs[0]


@register_rule(
    p.dot_general_p,
    "multiplicative",
    "operands in a format: ScalifyConfig.contraction's strategy (dequantize / native / scaled_dot: values exact "
    "in bf16 or f32, one GEMM with f32 accumulation, factors constant along K scale the output). Carriers: "
    "dot(data) accumulated in float32, /2^k, rounded once; scales multiplied (grid outer product) * 2^k; settled "
    "on the measured amax outside [2^-7, 2^7] (float32 / bf16 with operand bounds known: the plain dot of the data, "
    "no allowance, no settle); float32 / bf16 carriers fold a scale varying along a contracted axis, and the "
    "operand with fewer free scales when both vary along free axes, to per-tensor first; narrower carriers with a "
    "scale varying along a contracted axis: one float32 dot of the dequantized operands. A complex operand or "
    "output (real features times a complex matrix): the float32 values, the equation's own accumulator, plain "
    "complex output.",
    raw=True,
)
def _dot_general_rule(eqn, a, b):
    if _complex_valued(eqn):
        return _complex_contraction(eqn, a, b)
    how = _strategy(a, b)
    if how is not None:
        return _contraction.dot(eqn, a, b, how)
    return _dot_general(eqn, _as_carrier(a), _as_carrier(b))


def _strategy(a, b, *, conv: bool = False):
    """The contraction strategy for these operands; None for carriers under ``"auto"`` (which
    keep jax-scalify's rule)."""
    if get_config().contraction == "auto" and not (_contraction.formatted(a) or _contraction.formatted(b)):
        return None
    return _contraction.strategy(a, b, conv=conv)


def _as_carrier(x):
    return to_carrier(x) if isinstance(x, ScaledArray) else x


def _folded_grids(eqn, a: ScaledArray, b: ScaledArray):
    """The operands of a float32 / bfloat16 carrier contraction with the block grids it cannot
    factor out of the sum folded to per-tensor (data times ``s / max s``: exact in float32 above its
    subnormals, and the data bound stays). Narrow carriers keep them (:func:`_dequant_dot`).

    * A scale that varies along a contracted axis (activations that kept an MX embedding's blocks,
      the batch axes of a weight gradient) cannot leave the sum: folded, the contraction is still
      the plain GEMM of the data, its output scale a product of the factors and its data bound
      known, where dequantizing both operands would lose the bound and measure the output.
    * Two scales that both vary along free axes (per-channel activations times a per-channel
      weight, and their weight gradient) would give the output one scale per element (their outer
      product), which every consumer would then align, measure and carry like data: the operand
      with the fewer free scales is folded, the output keeps the other's grid.
    """
    dtype = _carrier(eqn, a, b)
    if not (jnp.issubdtype(dtype, jnp.floating) and wide(dtype)):
        return a, b
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a = fold(a) if any(jnp.ndim(a.scale) and a.scale.shape[i] != 1 for i in lc) else a
    b = fold(b) if any(jnp.ndim(b.scale) and b.scale.shape[j] != 1 for j in rc) else b
    if per_tensor(a) or per_tensor(b):
        return a, b
    free_a = math.prod(n for i, n in enumerate(a.scale.shape) if i not in (*lc, *lb))
    free_b = math.prod(n for i, n in enumerate(b.scale.shape) if i not in (*rc, *rb))
    if free_a == 1 or free_b == 1:
        return a, b
    return (fold(a), b) if free_a <= free_b else (a, fold(b))


def _dot_general(eqn, a, b):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    a, b = promote(a, zero_adopts=False), promote(b, zero_adopts=False)
    a, b = _bounded_operands(eqn, *_folded_grids(eqn, a, b))
    out_dtype = eqn.outvars[0].aval.dtype
    k = math.prod(a.data.shape[i] for i in lc)
    r = sqrt_rescale(k)
    if per_tensor(a) and per_tensor(b):
        return _contraction.output_format(
            _contracted(eqn, a, b, k, r, lax.mul(a.scale, b.scale), _carrier(eqn, a, b)), out_dtype
        )
    ga, gb = _grid(a), _grid(b)
    # Batch grids must agree (or broadcast from 1).
    bshape_a, bshape_b = list(ga.shape), list(gb.shape)
    for i, j in zip(lb, rb, strict=True):
        m, n = ga.shape[i], gb.shape[j]
        if m != n and 1 not in (m, n):
            return _dequant_dot(eqn, a, b)
        bshape_a[i] = bshape_b[j] = max(m, n)
    ga, gb = jnp.broadcast_to(ga, bshape_a), jnp.broadcast_to(gb, bshape_b)
    if any(ga.shape[i] != 1 or gb.shape[j] != 1 for i, j in zip(lc, rc, strict=True)):
        # Blocks along the contracted axis: element x block scale is exact in float32 for every
        # built-in codec (power-of-two and E4M3 scales), so the float32 dot of the dequantized
        # operands is the blocked sum up to accumulation order, in one GEMM and without the
        # per-block partial outputs (K/32 copies of the output) that summing block by block needs.
        return _dequant_dot(eqn, a, b)
    scale = lax.dot_general_p.bind(ga, gb, **dict(eqn.params, preferred_element_type=_F32_DTYPE))
    return _contraction.output_format(_contracted(eqn, a, b, k, r, scale, _carrier(eqn, a, b)), out_dtype)


@register_rule(
    p.conv_general_dilated_p,
    "multiplicative",
    "operands in a format: ScalifyConfig.contraction's strategy (non-scalar factors multiplied into the values, "
    "one convolution with f32 accumulation, scalar factors scale the output). Carriers: folded to per-tensor; "
    "conv(data) in float32 / 2^k with 2^k ~ sqrt(kernel fan-in), rounded once; scale product * 2^k.",
    raw=True,
)
def _conv_rule(eqn, lhs, rhs):
    how = _strategy(lhs, rhs, conv=True)
    if how is not None:
        return _contraction.conv(eqn, lhs, rhs, how)
    return _conv(eqn, _as_carrier(lhs), _as_carrier(rhs))


def _conv(eqn, lhs, rhs):
    lhs, rhs = fold(promote(lhs, zero_adopts=False)), fold(promote(rhs, zero_adopts=False))
    lhs, rhs = _bounded_operands(eqn, lhs, rhs)
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec
    fan_in = math.prod(rhs.data.shape) // rhs.data.shape[rhs_spec[0]]
    r = sqrt_rescale(fan_in)
    return _contracted(eqn, lhs, rhs, fan_in, r, lax.mul(lhs.scale, rhs.scale), _carrier(eqn, lhs, rhs))


def _carrier(eqn, a: ScaledArray, b: ScaledArray):
    """The carrier dtype of a contraction's output: the requested accumulator type, else the
    operands' data dtype (promoted), as the plain program on the data would return."""
    return eqn.params.get("preferred_element_type") or jnp.result_type(a.data.dtype, b.data.dtype)


_ragged_dot_p = lax_primitive("ragged_dot_general")
if _ragged_dot_p is not None:

    @register_rule(
        _ragged_dot_p,
        "multiplicative",
        "a grouped GEMM (lax.ragged_dot: a mixture of experts' expert bank): operands dequantized in float32, "
        "one ragged_dot with f32 accumulation (the blocked sum up to accumulation order), settled.",
    )
    def _ragged_dot(eqn, lhs, rhs, group_sizes):
        """``ragged_dot_general`` of the dequantized operands: each element times its block scale is
        exact in float32 for every built-in codec, so this is the blocked sum per group up to the
        order of float32 accumulation."""
        if isinstance(group_sizes, ScaledArray):
            group_sizes = dequant(group_sizes)
        if _complex_valued(eqn):
            return _complex_contraction(eqn, lhs, rhs, group_sizes)
        return _dequant_dot(eqn, lhs, rhs, group_sizes)


def _sparse_dot(eqn, *operands):
    """A contraction with a sparse operand (``jax.experimental.sparse``: BCOO / BCSR / COO / CSR
    matrix times dense, sparse times sparse, sampled products) of the dequantized operands,
    accumulated in float32: stored values and indices are the matrix's operands, the product is
    bilinear in the stored values and the dense operand, so this is the blocked sum up to the order
    of float32 accumulation. The sparse outputs' indices stay plain."""
    if _complex_valued(eqn):
        return _complex_contraction(eqn, *operands)
    changes = {"preferred_element_type": _F32_DTYPE} if "preferred_element_type" in eqn.params else {}
    outs = bind_eqn_with(eqn, [dequant(x) for x in operands], **changes)
    outs = [
        _finish(o, v.aval.dtype) if jnp.issubdtype(o.dtype, jnp.floating) else o
        for o, v in zip(outs, eqn.outvars, strict=True)
    ]
    return outs if eqn.primitive.multiple_results else outs[0]


def _register_sparse_dots():
    from jax.experimental import sparse

    register_rule(
        [
            sparse.bcoo_dot_general_p,
            sparse.bcsr_dot_general_p,
            sparse.bcoo_spdot_general_p,
            sparse.bcoo_dot_general_sampled_p,
            sparse.coo_matvec_p,
            sparse.coo_matmat_p,
            sparse.csr_matvec_p,
            sparse.csr_matmat_p,
        ],
        "multiplicative",
        "jax.experimental.sparse (rule registered once it is imported): a sparse matrix's product (BCOO / BCSR / "
        "COO / CSR times dense, sparse times sparse, sampled): the stored values and the dense operand "
        "dequantized in float32, one product with f32 accumulation, settled; indices plain.",
    )(_sparse_dot)


register_when_imported("jax.experimental.sparse", _register_sparse_dots)
