"""Scale-commuting rules: the operation acts on ``data`` and the scale (layout) is carried along.

Correct because ``f(data * s) == f(data) * s`` for these ops with ``s > 0`` (sign-preserving
elementwise ops) or because they only move elements (the block layout moves with them, see
:func:`scalify._rules_common.structural`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify._jax_compat import bind_eqn, bind_eqn_with, lax_primitive, lax_primitives, name_p, p
from scalify._registry import register_rule, register_when_imported
from scalify._rules_common import (
    F32,
    align,
    decoded,
    dequant,
    fold,
    moves_as_stored,
    per_tensor,
    renormalize,
    structural,
)
from scalify._scaled_array import ScaledArray, expand_scale, normalize_scale


def _data_only(eqn, x, *rest):
    (data,) = bind_eqn(eqn, [x.data, *rest])
    return ScaledArray(data, x.scale)


register_rule(
    [p.neg_p, p.abs_p, p.copy_p, p.reduce_precision_p, p.real_p],
    "commuting",
    "f(data), scale kept (positive scales commute; reduce_precision rounds the data mantissa).",
)(_data_only)


@register_rule(p.stop_gradient_p, "commuting", "stop_gradient on data and scale.")
def _stop_gradient(eqn, x):
    from jax import lax

    return ScaledArray(lax.stop_gradient(x.data), lax.stop_gradient(x.scale))


@register_rule(
    [
        p.reshape_p,
        p.transpose_p,
        p.broadcast_in_dim_p,
        p.squeeze_p,
        p.slice_p,
        p.rev_p,
        *lax_primitives("tile", "split", "unstack"),
    ],
    "commuting",
    "data moved; block scales moved with the same op (layout inferred statically, any block layout); "
    "per-tensor formats keep their codes and format.",
    raw=True,
)
def _move(eqn, x, *rest):
    if x.fmt is not None and moves_as_stored(x, [v.aval.shape for v in eqn.outvars]):
        datas = bind_eqn(eqn, [x.data, *rest])
        outs = [ScaledArray(d, x.scale, fmt=x.fmt, dtype=x.dtype) for d in datas]
        return outs if eqn.primitive.multiple_results else outs[0]
    return structural(eqn, decoded(x), *rest)


@register_rule(
    p.convert_element_type_p,
    "commuting",
    "float->wider float: data cast, scale kept; float->narrower float: a power of two per block moved "
    "from data into the scale first (never overflows); float->int/bool: dequantize then cast (plain output).",
)
def _convert(eqn, x):
    new = eqn.params["new_dtype"]
    if not jnp.issubdtype(new, jnp.floating):
        return bind_eqn(eqn, [dequant(x)])[0]
    if jnp.finfo(new).max >= jnp.finfo(x.data.dtype).max:
        return _data_only(eqn, x)
    # Narrowing (float32 -> float16, say): the data may exceed the new range although the value
    # is fine. Renormalise each scale block by its amax rounded to a power of two (exact).
    return renormalize(x.data, x.scale, new)


@register_rule(p.sign_p, "commuting", "sign(data) (scales are positive); plain output.")
def _sign(eqn, x):
    return jnp.sign(x.data)


@register_rule(p.is_finite_p, "commuting", "is_finite(data) & is_finite(scale); plain bool output.")
def _is_finite(eqn, x):
    return lax.bitwise_and(lax.is_finite(x.data), lax.is_finite(expand_scale(x.scale, x.data.shape)))


def _gather_like(eqn, x, *rest):
    """Data-dependent data movement: per-tensor scale kept, block scales gathered alongside."""
    if not isinstance(x, ScaledArray):
        raise TypeError(f"{eqn.primitive.name}: scaled indices are not supported; pass plain integer indices.")
    scaled_fill = _scaled_fill(eqn)
    if per_tensor(x) and not scaled_fill:
        return _data_only(eqn, x, *rest)
    (data,) = bind_eqn(eqn, [x.data, *rest])
    scale = normalize_scale(x.scale, x.data.shape)
    moved = None if scaled_fill or eqn.primitive is not p.gather_p else _gathered_scale(eqn, scale, x.data.shape, rest)
    if moved is None:
        moved = _sliced_scale(eqn, scale, x.data.shape, rest)
    return ScaledArray(data, moved)


def _scaled_fill(eqn) -> bool:
    """Whether out-of-bounds entries of a filling gather would be wrong on the operand's scale:
    the data is filled with the fill value, so the value is ``fill * scale`` unless the fill is
    0, +-inf or NaN (the default), which any positive scale leaves as they are."""
    if eqn.primitive is not p.gather_p or lax.GatherScatterMode.from_any(eqn.params["mode"]) != (
        lax.GatherScatterMode.FILL_OR_DROP
    ):
        return False
    fill = eqn.params["fill_value"]
    return fill is not None and bool(np.isfinite(fill)) and fill != 0


def _at_resolution(scale, shape, axes):
    """``scale`` expanded to one entry per element along ``axes`` (its blocks kept elsewhere)."""
    for a in axes:
        if scale.shape[a] != shape[a]:
            scale = jnp.repeat(scale, shape[a] // scale.shape[a], axis=a)
    return scale


def _gathered_scale(eqn, scale, shape, rest):
    """The block grid of ``gather(x)``, at the resolution the gather needs and no finer.

    An indexed operand axis along which the scale is constant (a per-channel table gathered by
    row) keeps size 1 and its index component becomes 0: when every indexed axis is such, the
    output grid has size 1 along the index batch axes (the gathered rows of a per-column scale
    share its (1, d) grid instead of a full-size one). Other indexed axes are expanded to one
    scale per element; a slice along a free axis keeps its blocks when it spans whole blocks.
    Out-of-bounds entries get scale 1 (a fill of -inf stays -inf). None: batched gathers (taken at
    full resolution by :func:`_sliced_scale`'s fallback).
    """
    (indices,) = rest
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    if dn.operand_batching_dims:
        return None
    indexed = set(dn.start_index_map)
    constant = all(scale.shape[a] == 1 for a in indexed)
    ragged = [a for a in range(len(shape)) if a not in indexed and sizes[a] % (shape[a] // scale.shape[a])]
    scale = _at_resolution(scale, shape, ragged if constant else sorted(indexed) + ragged)
    new_sizes = tuple(
        1 if a in indexed and constant else sizes[a] // (shape[a] // scale.shape[a]) for a in range(len(shape))
    )
    if constant:
        # The scale does not depend on the indices: one all-zero index per output, batch axes of size 1.
        indices = jnp.zeros((1,) * (indices.ndim - 1) + indices.shape[-1:], indices.dtype)
    (out,) = bind_eqn_with(eqn, [scale, indices], slice_sizes=new_sizes, fill_value=1.0)
    return out


def _sliced_scale(eqn, scale, shape, rest):
    """The block grid of ``dynamic_slice(x)`` (or of a batched or filling gather): axes along which
    the scale is constant keep size 1 (start 0, size 1), the others are taken at one scale per
    element. A gather's out-of-bounds entries get scale 1, so a filled value is the fill value."""
    if eqn.primitive is p.dynamic_slice_p and len(rest) == len(shape):
        varying = [a for a in range(len(shape)) if scale.shape[a] != 1]
        scale = _at_resolution(scale, shape, varying)
        starts = [i if a in varying else jnp.zeros_like(i) for a, i in enumerate(rest)]
        sizes = tuple(n if a in varying else 1 for a, n in enumerate(eqn.params["slice_sizes"]))
        return lax.dynamic_slice(scale, starts, sizes)
    full = jnp.broadcast_to(expand_scale(scale, shape), shape)
    params = {"fill_value": 1.0} if "fill_value" in eqn.params else {}
    (out,) = bind_eqn_with(eqn, [full, *rest], **params)
    return out


register_rule(
    [p.gather_p, p.dynamic_slice_p],
    "commuting",
    "per-tensor: data gathered, scale kept; block scales: gathered with the data, at one scale per element only "
    "along indexed axes the scale varies on (a per-channel table's rows keep its (1, d) grid); out-of-bounds "
    "fills get scale 1.",
)(_gather_like)


@register_rule(
    [p.dynamic_update_slice_p],
    "additive",
    "operand and update brought to a common scale (max), then data updated.",
)
def _dynamic_update_slice(eqn, operand, update, *idx):
    if isinstance(operand, ScaledArray) and not per_tensor(operand):
        operand = fold(operand)
    if isinstance(update, ScaledArray) and not per_tensor(update):
        update = fold(update)
    (d_op, d_up), s = align([operand, update])
    return ScaledArray(bind_eqn(eqn, [d_op, d_up, *idx])[0], s)


@register_rule([p.pad_p], "commuting", "data padded with padding_value / scale (folded to per-tensor first).")
def _pad(eqn, x, pad_value):
    if not isinstance(x, ScaledArray):
        return bind_eqn(eqn, [x, dequant(pad_value, jnp.result_type(x))])[0]
    x = fold(x)
    pv = (dequant(pad_value) / x.scale).astype(x.data.dtype)
    return ScaledArray(bind_eqn(eqn, [x.data, pv])[0], x.scale)


def _argrule(eqn, x):
    if per_tensor(x):
        return bind_eqn(eqn, [x.data])[0]
    # argmax's params carry the operand's index dtype only; computing on float32 values is fine.
    return bind_eqn(eqn, [dequant(x).astype(x.data.dtype)])[0]


register_rule(
    [p.argmax_p, p.argmin_p], "commuting", "per-tensor: on data; blocks: on the dequantized value. Plain output."
)(_argrule)


def _constant_along(x: ScaledArray, axis: int) -> ScaledArray:
    """``x`` with one scale along ``axis`` (its own when a block spans the axis, else folded).

    Positive scales preserve order, so ranking ``data`` along an axis of constant scale ranks the
    values; folding rescales by powers of two, exact up to underflow as in :func:`fold`.
    """
    return x if per_tensor(x) or x.scale.shape[axis] == 1 else fold(x)


@register_rule(
    [p.top_k_p, *lax_primitives("approx_top_k")],
    "commuting",
    "ranked on data (scale constant along the axis: blocks spanning it kept, else folded); "
    "values keep the scale, indices plain.",
)
def _top_k(eqn, x):
    axis = eqn.params.get("axis", eqn.params.get("reduction_dimension", -1)) % x.data.ndim
    x = _constant_along(x, axis)
    values, indices = bind_eqn(eqn, [x.data])
    return ScaledArray(values, x.scale), indices


@register_rule(
    p.sort_p,
    "commuting",
    "keys ranked on data (scale constant along the sorted axis: blocks spanning it kept, else folded); "
    "every operand permuted with its scale kept.",
)
def _sort(eqn, *xs):
    dim = eqn.params["dimension"]
    xs = [_constant_along(x, dim) if isinstance(x, ScaledArray) else x for x in xs]
    outs = bind_eqn(eqn, [x.data if isinstance(x, ScaledArray) else x for x in xs])
    return [ScaledArray(o, x.scale) if isinstance(x, ScaledArray) else o for o, x in zip(outs, xs, strict=True)]


def _cmp(eqn, *xs):
    datas, _ = align(list(xs), dtype=F32, finite=True)
    return bind_eqn(eqn, datas)[0]


register_rule(
    [
        *(p.eq_p, p.ne_p, p.lt_p, p.le_p, p.gt_p, p.ge_p),
        # the total-order comparisons (-0 < +0, NaNs ordered): a positive power-of-two rescale keeps
        # signs, zeros and NaNs, so their order too
        *lax_primitives("eq_to", "lt_to", "le_to"),
    ],
    "commuting",
    "operands brought to a common scale (max) in float32, then compared. Plain bool output.",
)(_cmp)


def _maxmin(eqn, *xs):
    datas, s = align(list(xs))
    return ScaledArray(bind_eqn(eqn, datas)[0], s)


register_rule(
    [p.max_p, p.min_p],
    "commuting",
    "operands brought to a common scale (max of scales; equal scales: data untouched), then max/min of data.",
)(_maxmin)


@register_rule(p.clamp_p, "commuting", "bounds and operand brought to a common scale (max), clamp on data.")
def _clamp(eqn, lo, x, hi):
    (dlo, dx, dhi), s = align([lo, x, hi])
    return ScaledArray(bind_eqn(eqn, [dlo, dx, dhi])[0], s)


@register_rule(p.select_n_p, "commuting", "cases brought to a common scale (max), predicate plain.")
def _select_n(eqn, pred, *cases):
    if isinstance(pred, ScaledArray):
        pred = dequant(pred)
    datas, s = align(list(cases), finite=True)
    return ScaledArray(bind_eqn(eqn, [pred, *datas])[0], s)


@register_rule(
    [p.reduce_max_p, p.reduce_min_p, p.cummax_p, p.cummin_p, p.reduce_window_max_p, p.reduce_window_min_p],
    "commuting",
    "on data; block scales kept when blocks span the reduced axes, else folded to per-tensor first.",
)
def _reduce_max(eqn, x):
    axes = eqn.params.get("axes")
    if axes is None:
        axes = (eqn.params["axis"],) if "axis" in eqn.params else None
    if per_tensor(x):
        return _data_only(eqn, x)
    if axes is not None and all(x.scale.shape[a] == 1 for a in axes):
        (data,) = bind_eqn(eqn, [x.data])
        scale = x.scale
        if eqn.primitive in (p.reduce_max_p, p.reduce_min_p):
            scale = jnp.squeeze(scale, axis=tuple(axes))
        return ScaledArray(data, scale)
    return _data_only(eqn, fold(x))


@register_rule(
    [p.select_and_scatter_add_p, p.select_and_gather_add_p],
    "commuting",
    "max-pool backward / JVP: cotangent (tangent) data moved, scale kept (per-tensor); selection on operand data.",
)
def _max_pool_transport(eqn, moved, operand):
    """Max pooling's derivatives move ``moved``'s elements to where ``operand`` had its maxima."""
    if isinstance(operand, ScaledArray):
        operand = fold(operand).data  # the selection only compares, so one common scale is exact
    if not isinstance(moved, ScaledArray):
        return bind_eqn(eqn, [moved, operand])[0]
    moved = fold(moved)
    return ScaledArray(bind_eqn(eqn, [moved.data, operand])[0], moved.scale)


_barrier = lax_primitive("optimization_barrier")
if _barrier is not None:

    @register_rule(_barrier, "commuting", "barrier over the data and scale leaves of every operand.")
    def _optimization_barrier(eqn, *xs):
        flat, tree = jax.tree.flatten(list(xs))
        return jax.tree.unflatten(tree, list(_barrier.bind(*flat)))


@register_rule(
    name_p, "commuting", "checkpoint_name on the data and on the scale: a remat policy that saves the name saves both."
)
def _checkpoint_name(eqn, x):
    (data,) = bind_eqn(eqn, [x.data])
    (scale,) = bind_eqn(eqn, [x.scale])
    return ScaledArray(data, scale)


def _sparse_moves(eqn, *operands):
    """A sparse layout change that moves stored values without arithmetic (dense to sparse,
    extracting at indices, transposing, sorting the indices): ``f(d * s) = f(d) * s`` for a
    per-tensor ``s``, zeros filling what is not stored. A block scale is folded first (stored values
    have no dense block layout); indices stay plain."""
    (x,) = [fold(o) for o in operands if isinstance(o, ScaledArray)]
    ins = [x.data if isinstance(o, ScaledArray) else o for o in operands]
    outs = [ScaledArray(o, x.scale) if jnp.issubdtype(o.dtype, jnp.floating) else o for o in bind_eqn(eqn, ins)]
    return outs if eqn.primitive.multiple_results else outs[0]


def _register_sparse_moves():
    from jax.experimental import sparse

    register_rule(
        [
            sparse.bcoo_fromdense_p,
            sparse.bcoo_extract_p,
            sparse.bcoo_transpose_p,
            sparse.bcoo_sort_indices_p,
            sparse.bcsr_fromdense_p,
            sparse.bcsr_extract_p,
            sparse.coo_fromdense_p,
            sparse.csr_fromdense_p,
        ],
        "commuting",
        "jax.experimental.sparse (rule registered once it is imported): stored values moved (dense to sparse, "
        "extract, transpose, sort indices): on data, the scale folded to per-tensor and kept; indices plain.",
    )(_sparse_moves)


register_when_imported("jax.experimental.sparse", _register_sparse_moves)
