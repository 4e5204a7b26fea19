"""Additive rules: operands are brought to a common scale (per block), then data is summed.

Per-tensor operands follow jax-scalify: the common scale of ``a + b`` is ``sqrt(sa**2 + sb**2)``
rounded to a power of two; the rescaled data are summed in float32 and rounded to the carrier dtype
once (a power-of-two rescale is exact in float32, so this is the carrier-dtype sum without the extra
roundings of rescaling in the carrier first). Sums over ``n`` terms (reduce_sum, cumsum,
reduce_window_sum) accumulate in float32 and divide by a power of two near ``sqrt(n)`` before the
one rounding, so the result cannot overflow the carrier dtype.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify._jax_compat import add_any_p, bind_eqn, bind_eqn_with, lax_primitive, p
from scalify._registry import register_rule, register_when_imported
from scalify._rules_common import (
    F32,
    align,
    combine_l2,
    dequant,
    fold,
    is_runtime_plain,
    is_scaled,
    measured,
    note_bound,
    operand_bound,
    per_tensor,
    promote,
    requant_blocks,
    settle,
    sqrt_rescale,
    times,
    wide,
)
from scalify._scaled_array import ScaledArray, block_of, cast


def _add(eqn, *xs):
    if any(is_runtime_plain(x) for x in xs) and not wide(_carrier_dtype(xs, eqn.outvars[0].aval.dtype)):
        # A plain runtime operand gets scale 1 (its magnitude is unknown at trace time), which in
        # a narrow carrier (float16) swamps small-scale operands (flushed to zero) or lets a large
        # plain value overflow: add the values in float32 and re-quantize per block instead. A
        # float32 or bfloat16 carrier holds both at scale 1 as the plain program does.
        _, s = align([x for x in xs if is_scaled(x)], combine_l2)
        (value,) = bind_eqn(eqn, [dequant(x) for x in xs])
        grid = () if jnp.ndim(s) == 0 or jnp.ndim(value) == 0 else tuple(jnp.shape(s))
        return requant_blocks(value, grid, eqn.outvars[0].aval.dtype)
    out_dtype = eqn.outvars[0].aval.dtype
    if not jnp.issubdtype(out_dtype, jnp.floating):
        datas, s = align(list(xs), combine_l2)
        return ScaledArray(bind_eqn(eqn, datas)[0], s)
    # The aligned operands are summed in float32 and rounded once: a power-of-two rescale is exact
    # in float32, so this is the carrier-dtype sum of the rescaled values without the two extra
    # roundings (and without their underflow) of rescaling in the carrier dtype first.
    datas, s = align(list(xs), combine_l2, dtype=F32)
    out = ScaledArray(cast(bind_eqn(eqn, datas)[0], _carrier_dtype(xs, out_dtype)), s)
    bounds = [operand_bound(x) for x in xs]
    if all(b is not None for b in bounds):
        # Each operand is shifted by s_i / s <= 1 (<= 2 with unrounded scales): |a + b| <= 2 (ha + hb).
        note_bound(out, 2.0 * sum(bounds))
    return out


def _carrier_dtype(xs, out_dtype):
    """The data dtype of the first scaled operand (the carrier the sum returns to)."""
    for x in xs:
        if is_scaled(x):
            return x.data.dtype
    return out_dtype


register_rule(
    [p.add_p, p.sub_p, add_any_p],
    "additive",
    "common scale sqrt(sa^2+sb^2) rounded to a power of two, per block when blocks line up "
    "(else folded to per-tensor); rescaled data summed in float32, rounded once to the carrier. "
    "With a plain (non-static) operand: float32 sum re-quantized per block (scale = block amax "
    "rounded to 2^k).",
)(_add)


def _prescaled_sum(eqn, x: ScaledArray, n: int, scale=None, reduce=None) -> ScaledArray:
    """A sum over ``n`` terms scaled by ``1/r`` (``r`` = 2^k ~ sqrt(n)); scale * r. Under the measured
    policy (``ScalifyConfig(renormalize="amax")``, the default) the result is then settled when its
    amax leaves the window.

    Floating data is accumulated in float32 and the scaled sum rounded once to the carrier dtype,
    so the accumulation cannot overflow it whatever ``n``. Integer data is summed as it is.
    ``reduce(data)`` binds the sum (default: ``eqn`` itself).
    """
    reduce = reduce or (lambda data: bind_eqn(eqn, [data])[0])
    scale = x.scale if scale is None else scale
    # Integer data sums exactly (a division would truncate it); at most 3 terms (r = 1) are summed
    # in the carrier dtype, like the plain program.
    r = sqrt_rescale(n) if jnp.issubdtype(x.data.dtype, jnp.floating) else 1.0
    if r == 1.0:
        return ScaledArray(reduce(x.data), scale)
    scale = times(scale, r)
    out = reduce(cast(x.data, F32))
    out = lax.mul(out, np.float32(1.0 / r))
    if measured():
        # Cancellation (a gradient's sum over the batch) can leave the sum far below sqrt(n) times
        # its terms: the measured amax corrects the static allowance when it leaves the window.
        return settle(out, scale, x.data.dtype)
    return ScaledArray(cast(out, x.data.dtype), scale)


@register_rule(
    [p.reduce_sum_p],
    "additive",
    "data summed in float32 (n > 3 terms), times 2^-k ~ 1/sqrt(n), rounded once to the carrier; scale * 2^k. "
    "Block scales kept when blocks span the reduced axes (per-channel), else folded to per-tensor.",
)
def _reduce_sum(eqn, x):
    axes = tuple(eqn.params["axes"])
    if not per_tensor(x) and not all(x.scale.shape[a] == 1 for a in axes):
        x = fold(x)
    scale = x.scale if per_tensor(x) else jnp.squeeze(x.scale, axis=axes)
    n = math.prod(x.data.shape[a] for a in axes)
    return _prescaled_sum(eqn, x, n, scale, functools.partial(_unit_free_sum, eqn))


def _unit_free_sum(eqn, data):
    """``reduce_sum`` of ``eqn`` on ``data``, bound with the size-1 axes squeezed out (then put back).

    The same sum; the squeeze and its inverse are free reshapes. XLA's CPU runtime (YNNPACK
    reductions, jax 0.10) runs a sum whose operand has a size-1 axis ten times slower or worse:
    ``sum(a * b, -1)`` over (1, 8, 16, 256, 256), softmax's backward in flax NNX attention, took
    121 ms, and 5.6 ms on the same data as (8, 16, 256, 256). The float32 program escapes it there
    because XLA fuses that sum into the attention GEMM before it; the scalified one cannot.
    """
    axes = tuple(eqn.params["axes"])
    units = [a for a in range(data.ndim) if data.shape[a] == 1]
    if not units or eqn.params.get("out_sharding") is not None:
        return bind_eqn(eqn, [data])[0]
    kept = [a for a in range(data.ndim) if a not in units]
    new_axes = tuple(i for i, a in enumerate(kept) if a in axes)
    (out,) = bind_eqn_with(eqn, [lax.squeeze(data, units)], axes=new_axes)
    # Output axes are the operand's unreduced ones; the unit axes among them come back.
    left = [a for a in range(data.ndim) if a not in axes]
    return lax.expand_dims(out, [i for i, a in enumerate(left) if a in units])


@register_rule(
    [p.cumsum_p],
    "additive",
    "like reduce_sum along the scanned axis (block scales kept if they span it, else folded).",
)
def _cumsum(eqn, x):
    axis = eqn.params["axis"]
    if not per_tensor(x) and x.scale.shape[axis] != 1:
        x = fold(x)
    return _prescaled_sum(eqn, x, x.data.shape[axis])


@register_rule(
    [p.reduce_window_sum_p],
    "additive",
    "per-tensor (blocks folded): data pre-scaled by ~1/sqrt(window size), summed; scale * 2^k.",
)
def _reduce_window_sum(eqn, x):
    return _prescaled_sum(eqn, fold(x), math.prod(eqn.params["window_dimensions"]))


@register_rule(
    [p.concatenate_p],
    "additive",
    "same block shape on every operand: data and block scales concatenated; else common scale (max).",
)
def _concatenate(eqn, *xs):
    dim = eqn.params["dimension"]
    ps = [promote(x, zero_adopts=False) for x in xs]
    blocks = {block_of(tuple(q.scale.shape), tuple(q.data.shape)) for q in ps if not per_tensor(q)}
    if not any(per_tensor(q) for q in ps) and len(blocks) == 1:
        (data,) = bind_eqn(eqn, [q.data for q in ps])
        return _max_bound(ScaledArray(data, jnp.concatenate([q.scale for q in ps], axis=dim)), xs)
    ps = [fold(q) for q in ps]
    datas, s = align(ps)
    return _max_bound(ScaledArray(bind_eqn(eqn, datas)[0], s), xs)


def _max_bound(out, xs):
    """``out`` with the largest of its operands' data bounds: the data are placed side by side,
    each on its own block scale or shifted right to the largest scale (:func:`combine_max`)."""
    bounds = [operand_bound(x) for x in xs]
    return note_bound(out, max(bounds)) if all(b is not None for b in bounds) else out


_stack_p = lax_primitive("stack")
if _stack_p is not None:

    @register_rule(_stack_p, "additive", "same block shape: data and block scales stacked; else common scale (max).")
    def _stack(eqn, *xs):
        axis = eqn.params["axis"]
        ps = [promote(x, zero_adopts=False) for x in xs]
        blocks = {block_of(tuple(q.scale.shape), tuple(q.data.shape)) for q in ps if not per_tensor(q)}
        if not any(per_tensor(q) for q in ps) and len(blocks) == 1:
            (data,) = bind_eqn(eqn, [q.data for q in ps])
            return _max_bound(ScaledArray(data, jnp.stack([q.scale for q in ps], axis=axis)), xs)
        datas, s = align([fold(q) for q in ps])
        return _max_bound(ScaledArray(bind_eqn(eqn, datas)[0], s), xs)


_scatter_sub_p = lax_primitive("scatter-sub")


@register_rule(
    [p.scatter_add_p, p.scatter_p] + ([_scatter_sub_p] if _scatter_sub_p is not None else []),
    "additive",
    "operand and updates folded to per-tensor and brought to a common scale (l2 for scatter-add, "
    "max for scatter); indices plain.",
)
def _scatter(eqn, operand, indices, updates):
    combine = None if eqn.primitive in (p.scatter_p, p.scatter_max_p, p.scatter_min_p) else combine_l2
    ops = [fold(q) if isinstance(q, ScaledArray) else q for q in (operand, updates)]
    datas, s = align(ops, combine) if combine else align(ops)
    return ScaledArray(bind_eqn(eqn, [datas[0], indices, datas[1]])[0], s)


# max(sa * a, su * u) = s * max(a * sa / s, u * su / s) for a positive common scale s: data selected,
# not computed, so the scatter above serves, under the property that makes it right here.
register_rule(
    [p.scatter_max_p, p.scatter_min_p],
    "commuting",
    "operand and updates folded to per-tensor and brought to a common scale (max), then scatter-max/min "
    "of data (jax.ops.segment_max, x.at[i].max); indices plain.",
)(_scatter)


def _sparse_sums(eqn, *operands):
    """Stored values ``v = d * s`` written to dense or deduplicated (``bcoo_todense``,
    ``bcoo_sum_duplicates``): each output entry is a sum of stored values (none: zero), so with ``s``
    per-tensor ``f(d * s) = f(d) * s``. The block scale is folded first (stored values have no dense
    block layout); the sums run in float32 and are settled (duplicates cannot overflow the carrier)."""
    (x,) = [fold(o) for o in operands if is_scaled(o)]
    ins = [cast(x.data, F32) if is_scaled(o) else o for o in operands]
    outs = [
        settle(o, x.scale, v.aval.dtype) if jnp.issubdtype(o.dtype, jnp.floating) else o
        for o, v in zip(bind_eqn(eqn, ins), eqn.outvars, strict=True)
    ]
    return outs if eqn.primitive.multiple_results else outs[0]


def _register_sparse_sums():
    from jax.experimental import sparse

    register_rule(
        [
            sparse.bcoo_todense_p,
            sparse.bcoo_sum_duplicates_p,
            sparse.bcsr_todense_p,
            sparse.coo_todense_p,
            sparse.csr_todense_p,
        ],
        "additive",
        "jax.experimental.sparse (rule registered once it is imported): stored values to dense or deduplicated "
        "(duplicate indices sum): the scale folded to per-tensor and kept, the sums in float32, settled.",
    )(_sparse_sums)


register_when_imported("jax.experimental.sparse", _register_sparse_sums)
