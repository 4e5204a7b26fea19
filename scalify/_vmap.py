"""``scalify.vmap``: ``jax.vmap`` whose axes are logical axes of ScaledArrays.

``jax.vmap`` maps every pytree leaf, so ``in_axes=0`` on a per-tensor ScaledArray also maps its 0-d
scale (and fails). Here ``in_axes``/``out_axes`` name one logical axis per ScaledArray, and each
child gets the physical axis that stands for it:

* ``data``: the same axis (packed formats pack along their block axis, which is never mapped);
* each scale leaf: that axis where the scale grid has one scale per index along it (per-channel on
  that axis, blocks along another axis), ``None`` where the scale does not vary along it (a 0-d
  per-tensor scale, NVFP4's tensor scale; a grid axis of size 1 is squeezed first). Mapping an
  axis that is split into blocks of several elements (the block axis of MX or NVFP4) is an error.

Inside ``fun`` each item is a ScaledArray of the same format, with its ``axis`` field moved to
stay on the same data axis. One case has no such format: mapping the channel axis of a per-channel
format leaves one scale per item; those items are passed in carrier form (value-exact).

Outputs: a formatted item output is stacked back into its format when the stacked scale is that
format's scale grid (block layouts mapped along a non-block axis); otherwise (per-tensor or
per-channel formats, NVFP4's tensor scale: each item has its own scale, which no single
per-tensor scale can represent) it is returned in carrier form with one scale per item, value-exact.
Carrier outputs keep a rank-matched scale grid.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from scalify._scaled_array import (
    ScaledArray,
    is_scaled_leaf,
    is_traced_leaf,
    normalize_scale,
    split_leaves,
    to_carrier,
)


def _norm(axis, ndim, what):
    if axis is None:
        return None
    if not isinstance(axis, int | np.integer) or not -ndim <= axis < ndim:
        raise ValueError(f"scalify.vmap: {what} has {ndim} dimension(s); axis {axis!r} is out of range.")
    return int(axis) % ndim


def _move_format_axis(fmt, rank, mapped, *, remove: bool):
    """``fmt`` for the item (``remove``: data of ``rank`` loses axis ``mapped``) or the stacked array
    (axis ``mapped`` inserted into data of ``rank``), so it still scales the same data axes.

    ``None`` when the format scales along the mapped axis (:meth:`qformats.ScaledFormat.reindex`).
    """
    return fmt.reindex(rank, remove=mapped) if remove else fmt.reindex(rank, insert=mapped)


def _matches(fmt, shape, data_shape, scale_tree, scale_shapes) -> bool:
    """Whether ``fmt`` quantizes ``shape`` into data of ``data_shape`` and scale leaves of ``scale_shapes``
    (flat, in the order of the treedef ``scale_tree``)."""
    try:
        d, s = jax.eval_shape(fmt.quantize, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
    except (ValueError, TypeError):
        return False
    leaves, tree = jax.tree.flatten(s)
    return (
        tuple(d.shape) == tuple(data_shape)
        and tree == scale_tree
        and [tuple(x.shape) for x in leaves] == [tuple(x) for x in scale_shapes]
    )


def _insert(shape, a, n):
    return (*shape[:a], n, *shape[a:])


def _drop(shape, a):
    return tuple(shape[:a]) + tuple(shape[a + 1 :])


def _carrier_in(sa: ScaledArray, a: int, n: int, what: str):
    """Physical (item-form) ScaledArray and its axes for a carrier ``sa`` mapped along ``a``."""
    data = sa.data if isinstance(sa.data, jax.Array | np.ndarray) else jnp.asarray(sa.data)
    scale = sa.scale
    if np.ndim(scale) == 0:
        return ScaledArray(data, scale), ScaledArray(a, None)
    scale = normalize_scale(jnp.asarray(scale), data.shape)
    if scale.ndim == 0:
        return ScaledArray(data, scale), ScaledArray(a, None)
    g = scale.shape[a]
    if g == n:
        return ScaledArray(data, scale), ScaledArray(a, a)
    if g == 1:
        return ScaledArray(data, jnp.squeeze(scale, a)), ScaledArray(a, None)
    raise ValueError(
        f"scalify.vmap: {what} has scale blocks of {n // g} elements along the mapped axis {a} (data "
        f"shape {tuple(data.shape)}, scale shape {tuple(scale.shape)}); a block cannot be split between "
        f"batch items. Map another axis."
    )


def _prepare_in(sa: ScaledArray, axis, what: str):
    """``(item_form, axes)``: a ScaledArray holding the batched leaves with the *item* format in its
    metadata, and a matching ScaledArray of physical axes for ``jax.vmap``."""
    shape = sa.shape
    if axis is None:
        return sa, jax.tree.map(lambda _: None, sa)
    a = _norm(axis, len(shape), what)
    n = shape[a]
    fmt = sa.fmt
    if fmt is None:
        return _carrier_in(sa, a, n, what)
    block = fmt.block_shape(shape)
    if 1 < block[a] < n:
        raise ValueError(
            f"scalify.vmap: {what} is {fmt.name}, whose blocks of {block[a]} elements lie along the mapped "
            f"axis {a} (shape {shape}); a block cannot be split between batch items. Map another axis, or "
            f"quantize with fmt.replace(axis=...) so the blocks lie along an axis that is not mapped."
        )
    item_fmt = _move_format_axis(fmt, len(shape), a, remove=True)
    if item_fmt is None:
        # Per-channel on the mapped axis: one scale per item, which the format cannot hold.
        return _carrier_in(to_carrier(sa), a, n, what)
    data_shape = tuple(np.shape(sa.data))
    if len(data_shape) != len(shape) or data_shape[a] != n:
        raise ValueError(
            f"scalify.vmap: {what} ({fmt.name}) stores data of shape {data_shape} for logical shape {shape}; "
            f"its axis {a} is packed and cannot be mapped. Map another axis."
        )
    leaves, tree = jax.tree.flatten(sa.scale)
    item_leaves, leaf_axes = [], []
    for leaf in leaves:
        s = tuple(np.shape(leaf))
        if len(s) == 0:
            item_leaves.append(leaf)
            leaf_axes.append(None)
        elif len(s) == len(shape) and s[a] == n and block[a] == 1:
            item_leaves.append(leaf)
            leaf_axes.append(a)
        elif len(s) == len(shape) and s[a] == 1:
            item_leaves.append(jnp.squeeze(leaf, a))
            leaf_axes.append(None)
        else:
            raise ValueError(
                f"scalify.vmap: {what} ({fmt.name}) has a scale leaf of shape {s}, which is neither 0-d nor a "
                f"block grid of rank {len(shape)}; scalify.vmap cannot tell how it maps along axis {a}."
            )
    item_scale = jax.tree.unflatten(tree, item_leaves)
    item_shapes = [
        _drop(np.shape(x), ax) if ax is not None else np.shape(x) for x, ax in zip(item_leaves, leaf_axes, strict=True)
    ]
    if not _matches(item_fmt, _drop(shape, a), _drop(data_shape, a), tree, item_shapes):
        return _carrier_in(to_carrier(sa), a, n, what)
    return (
        ScaledArray(sa.data, item_scale, fmt=item_fmt, dtype=sa._dtype),
        ScaledArray(a, jax.tree.unflatten(tree, leaf_axes), fmt=item_fmt, dtype=sa._dtype),
    )


def _broadcast_prefix(axes, tree, what):
    """Per-leaf axes (ScaledArrays are leaves) from a pytree prefix ``axes`` of ``tree``."""
    try:
        return jax.tree.map(
            lambda ax, sub: jax.tree.map(lambda _: ax, sub, is_leaf=is_scaled_leaf),
            axes,
            tree,
            is_leaf=lambda x: x is None,
        )
    except ValueError as e:
        raise ValueError(
            f"scalify.vmap: {what} must be an int, None, or a pytree prefix of the arguments with one int/None "
            f"per ScaledArray (a logical axis). ({e})"
        ) from None


@functools.cache
def _carrier_plan(fmt, dtype, shape):
    """Avals of the carrier form of an item output in ``fmt`` (for the physical out axes)."""
    return jax.eval_shape(
        lambda: to_carrier(ScaledArray(*fmt.quantize(jnp.zeros(shape, jnp.float32)), fmt=fmt, dtype=dtype))
    )


def _eval_shape(f, args):
    """``jax.eval_shape(f, *args)`` with only the ShapeDtypeStruct leaves abstract: the others (a
    Python int used as a shape, a config) reach ``f`` as they are, as under ``jax.vmap``."""
    avals, rebuild = split_leaves(args, keep=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return jax.eval_shape(lambda *a: f(*rebuild(a)), *avals)


def vmap(fun, in_axes=0, out_axes=0, *, axis_name=None, axis_size=None, spmd_axis_name=None):
    """``jax.vmap`` in logical axes: each ScaledArray in ``in_axes``/``out_axes`` takes one int or None.

    ``in_axes`` and ``out_axes`` are ints, ``None``, or pytree prefixes of the arguments / outputs in
    which a ScaledArray is a leaf (its logical axis). Keyword arguments are mapped along axis 0, as in
    ``jax.vmap``. See the module docstring (and ``docs/io.md``) for how the data and every scale leaf
    are mapped, and when an output comes back in carrier form. Works with ``scalify.scalify(fun)``
    inside or outside, and under ``jit``.
    """

    @functools.wraps(fun)
    def batched(*args, **kwargs):
        ax_args = tuple(in_axes) if isinstance(in_axes, list | tuple) else (in_axes,) * len(args)
        if len(ax_args) != len(args):
            raise ValueError(f"scalify.vmap: in_axes has {len(ax_args)} entries for {len(args)} positional arguments.")
        leaf_axes = _broadcast_prefix((ax_args, {k: 0 for k in kwargs}), (args, kwargs), "in_axes")
        flat, tree = jax.tree.flatten((args, kwargs), is_leaf=is_scaled_leaf)
        flat_axes = tree.flatten_up_to(leaf_axes)
        phys, phys_axes = [], []
        for i, (x, ax) in enumerate(zip(flat, flat_axes, strict=True)):
            if isinstance(x, ScaledArray):
                p, pa = _prepare_in(x, ax, f"ScaledArray argument #{i} (shape {x.shape})")
            else:
                p, pa = x, ax
            phys.append(p)
            phys_axes.append(pa)
        pargs = jax.tree.unflatten(tree, phys)
        paxes = jax.tree.unflatten(tree, phys_axes)

        # The item function's output structure decides the physical out axes.
        def item_avals(x, ax):
            if not is_traced_leaf(x):
                return x
            if ax is None:
                return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
            return jax.ShapeDtypeStruct(_drop(np.shape(x), ax), jnp.result_type(x))

        avals = jax.tree.map(item_avals, pargs, paxes, is_leaf=lambda x: x is None)
        sizes = {
            np.shape(x)[ax]
            for x, ax in zip(jax.tree.leaves(pargs), jax.tree.flatten(pargs)[1].flatten_up_to(paxes), strict=True)
            if ax is not None
        }
        if axis_size is not None:
            sizes.add(axis_size)
        if len(sizes) != 1:
            raise ValueError(
                f"scalify.vmap: the mapped axes have sizes {sorted(sizes)}; they must all have one size"
                + ("" if sizes else " (no argument is mapped: pass axis_size)")
                + "."
            )
        (batch,) = sizes
        out_item = _eval_shape(lambda a, k: fun(*a, **k), avals)
        out_flat, out_tree = jax.tree.flatten(out_item, is_leaf=is_scaled_leaf)
        out_leaf_axes = out_tree.flatten_up_to(_broadcast_prefix(out_axes, out_item, "out_axes"))
        plans = []  # per output leaf: (kind, physical axes, logical axis, batched format)
        for o, ax in zip(out_flat, out_leaf_axes, strict=True):
            if not isinstance(o, ScaledArray):
                plans.append(("leaf", ax, ax, None))
                continue
            if ax is None:
                plans.append(("none", jax.tree.map(lambda _: None, o), None, None))
                continue
            r = len(o.shape)
            a = _norm(ax, r + 1, f"out_axes for an output of shape {o.shape}")
            fmt = o.fmt
            if fmt is not None:
                big = _move_format_axis(fmt, r, a, remove=False)
                leaves, stree = jax.tree.flatten(o.scale)
                stacked = [_insert(x.shape, a, batch) for x in leaves]
                shape = _insert(o.shape, a, batch)
                dshape = _insert(o.data.shape, a, batch)
                ok = big is not None and all(x.ndim == r for x in leaves)
                if ok and _matches(big, shape, dshape, stree, stacked):
                    axes = ScaledArray(a, jax.tree.unflatten(stree, [a] * len(leaves)), fmt=fmt, dtype=o._dtype)
                    plans.append(("stack", axes, a, big))
                    continue
                o = _carrier_plan(fmt, o.dtype, tuple(o.shape))
            scalar = math.prod(o.scale.shape) == 1 or o.scale.ndim == 0
            plans.append(("carrier", ScaledArray(a, 0 if scalar else a), a, scalar))

        def item(a, k):
            outs = jax.tree.leaves(fun(*a, **k), is_leaf=is_scaled_leaf)
            res = []
            for o, (kind, *_rest) in zip(outs, plans, strict=True):
                if kind == "carrier" and o.fmt is not None:
                    o = to_carrier(o)
                elif kind == "carrier":
                    o = ScaledArray(o.data, normalize_scale(jnp.asarray(o.scale), o.data.shape))
                res.append(o)
            return res

        outs = jax.vmap(
            item,
            in_axes=tuple(paxes),
            out_axes=[p[1] for p in plans],
            axis_name=axis_name,
            axis_size=axis_size,
            spmd_axis_name=spmd_axis_name,
        )(*pargs)
        final = []
        for o, (kind, _, a, extra) in zip(outs, plans, strict=True):
            if kind == "stack":
                o = ScaledArray(o.data, o.scale, fmt=extra, dtype=o._dtype)
            elif kind == "carrier" and extra:
                # 0-d item scales stacked along axis 0: a rank-matched grid with the batch on axis a.
                grid = [1] * o.data.ndim
                grid[a] = o.scale.shape[0]
                o = ScaledArray(o.data, o.scale.reshape(grid))
            final.append(o)
        return jax.tree.unflatten(out_tree, final)

    return batched
