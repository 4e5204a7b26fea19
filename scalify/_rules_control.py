"""Rules for primitives with sub-jaxprs: the sub-jaxprs are interpreted with the same rule table.

* ``jit`` / ``closed_call``: re-emitted as a nested ``jax.jit`` of the interpreted body;
* ``checkpoint`` (remat): re-emitted as ``jax.checkpoint`` (same policy) of the interpreted body,
  by the walker's description of it (:data:`scalify._walk.HIGHER_ORDER`);
* ``custom_jvp_call`` / ``custom_vjp_call``: with plain operands they are bound unchanged; with
  scaled operands they are re-emitted as ``jax.custom_jvp`` / ``jax.custom_vjp`` over the carrier
  leaves, with the interpreted primal and the user's derivative rule (also interpreted), so
  ``grad(scalify(f))`` keeps custom rules;
* ``cond`` / ``while`` / ``scan``: re-emitted as ``lax.switch`` / ``lax.while_loop`` / ``lax.scan``
  over interpreted bodies. A loop-carried or branch output that is scaled anywhere is carried as a
  per-tensor carrier (data in the logical dtype, 0-d float32 scale) so every branch and iteration
  agrees on its type;
* ``shard_map``: re-emitted as ``jax.shard_map`` of the interpreted body; each ScaledArray operand's
  scale leaves get specs from its block grid, outputs leave as carriers (see the section below).

Where each primitive keeps its sub-jaxprs, operand counts and options is the walker's
:data:`scalify._walk.HIGHER_ORDER`; these rules read them only through it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qformats as qf
from scalify._config import get_config
from scalify._interpreter import WALK, eval_closed, eval_jaxpr, scalify
from scalify._jax_compat import (
    add_any_p,
    closed_call_p,
    cond_p,
    custom_jvp_call_p,
    custom_jvp_jaxpr,
    custom_vjp_bwd,
    custom_vjp_call_p,
    custom_vjp_fwd_jaxpr,
    jit_p,
    linear_solve_p,
    remat_p,
    scan_p,
    shard_map_p,
    traced_with_hoisted_consts,
    while_p,
)
from scalify._registry import register_rule
from scalify._rules_common import (
    F32,
    align,
    bound_of,
    carried,
    dequant,
    fold,
    loop_bound,
    loop_entry,
    note_bound,
    note_fill,
    static_scalar,
)
from scalify._scaled_array import ScaledArray, block_of, expand_scale, is_scaled_leaf, to_carrier
from scalify._sharding import scaled_sharding
from scalify._walk import bind_params, derivative_rule, jaxprs, operand_groups, options, rebuild

_JIT_CACHE: dict = {}


def _static_literal(x) -> bool:
    """A concrete scalar operand (a literal such as ``jnp.where``'s ``0.0``), not an array input."""
    return not isinstance(x, (ScaledArray, jax.Array)) and np.ndim(x) == 0


class _FillArg(NamedTuple):
    """An operand known to hold one static value everywhere (``zeros_like``, a mask's fill)."""

    value: float
    shape: tuple
    dtype: str

    def build(self):
        """The fill rebuilt inside the nested body, and recorded there as a fill."""
        x = lax.full(self.shape, self.value, np.dtype(self.dtype))
        note_fill(x, self.value)
        return x


def _static_arg(x):
    """The baked form of a static operand of a nested jit: a literal scalar, or a known fill."""
    if _static_literal(x):
        return x
    v = static_scalar(x)
    if v is not None and not isinstance(x, ScaledArray):
        return _FillArg(v, tuple(x.shape), np.dtype(x.dtype).str)
    return None


def _static_key(v):
    if isinstance(v, _FillArg):
        return v
    # Literals may be unhashable ndarray subclasses: key on dtype and value.
    return (np.asarray(v).dtype.str, np.asarray(v).item())


def _cached_jit(closed, name, statics=(), bounds=()):
    """``jax.jit`` of the interpreted ``closed`` jaxpr; ``statics`` ((index, value) pairs) are baked
    in, so a literal operand or a fill stays static inside the body (a zero fill adopts scales);
    ``bounds`` (one per dynamic operand: its data bound or None) stay known inside too."""
    key = (id(closed), get_config(), tuple((i, _static_key(v)) for i, v in statics), bounds)
    hit = _JIT_CACHE.get(key)
    if hit is not None and hit[0] is closed:
        return hit[1]
    n = len(closed.jaxpr.invars)

    def body(*args):
        for a, hi in zip(args, bounds, strict=False):
            if hi is not None:
                note_bound(a, hi)
        dynamic = iter(args)
        fixed = {i: v.build() if isinstance(v, _FillArg) else v for i, v in statics}
        return eval_closed(closed, *(fixed[i] if i in fixed else next(dynamic) for i in range(n)))

    body.__name__ = str(name)
    fn = jax.jit(body)
    if len(_JIT_CACHE) > 1024:
        _JIT_CACHE.clear()
    _JIT_CACHE[key] = (closed, fn)
    return fn


@register_rule([jit_p], "control", "nested jit of the interpreted body (stays a jit in the output program).", raw=True)
def _jit(eqn, *args):
    baked = [_static_arg(a) for a in args]
    statics = tuple((i, b) for i, b in enumerate(baked) if b is not None)
    dynamic = [a for a, b in zip(args, baked, strict=True) if b is None]
    bounds = tuple(bound_of(a) if isinstance(a, ScaledArray) and a.fmt is None else None for a in dynamic)
    (body,) = jaxprs(eqn)
    return _cached_jit(body, options(eqn)["name"] or "scalified", statics, bounds)(*dynamic)


@register_rule([closed_call_p], "control", "interpreted body inlined.", raw=True)
def _closed_call(eqn, *args):
    (body,) = jaxprs(eqn)
    return eval_closed(body, *args)


# -- custom derivative rules ------------------------------------------------------------------------
# The scalified call is re-emitted as a jax.custom_jvp / jax.custom_vjp over the flat carrier leaves,
# so `grad(scalify(f))` uses the user's rule. A carrier leaf pair (d, s) stands for v = d * s:
#   tangent      t_v  = t_d * s + d * t_s
#   cotangent    ct_d = ct_v * s,  ct_s = sum over each block of ct_v * d
# and a scaled output (d_o, s_o) has tangent (t_v / s_o, 0) and logical cotangent ct_v = ct_d / s_o:
# the output scale is a piecewise-constant (power-of-two) function of the inputs, derivative zero.


def _flatten_operands(args):
    carriers = [to_carrier(a) if isinstance(a, ScaledArray) else a for a in args]
    leaves, treedef = jax.tree.flatten(carriers)
    return leaves, treedef


def _carrier_outputs(outs):
    return [to_carrier(o) if isinstance(o, ScaledArray) else o for o in outs]


def _differentiable(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _logical_tangent(x, t):
    """Tangent of the value of ``x`` from the tangents of its leaves."""
    if not isinstance(x, ScaledArray):
        return t
    shape = x.data.shape
    v = t.data.astype(F32) * expand_scale(x.scale, shape) + x.data.astype(F32) * expand_scale(t.scale, shape)
    return v.astype(x.dtype)


def _leaf_tangent(o, t):
    """Tangent of output ``o``'s leaves for the value tangent ``t`` (the scale is held fixed)."""
    t = dequant(t) if isinstance(t, ScaledArray) else t
    if not isinstance(o, ScaledArray):
        if not _differentiable(o):
            return np.zeros(jnp.shape(o), jax.dtypes.float0)
        return jnp.asarray(t).astype(jnp.result_type(o))
    data = (jnp.asarray(t, F32) / expand_scale(o.scale, o.data.shape)).astype(o.data.dtype)
    return ScaledArray(data, jnp.zeros_like(o.scale))


def _leaf_cotangent(x, ct):
    """Cotangents of ``x``'s leaves for the value cotangent ``ct`` (None: a zero cotangent)."""
    if not _differentiable(x.data if isinstance(x, ScaledArray) else x):
        return None
    ct = dequant(ct)
    if not isinstance(x, ScaledArray):
        return ct.astype(jnp.result_type(x))
    shape = x.data.shape
    ct_d = (ct * expand_scale(x.scale, shape)).astype(x.data.dtype)
    prod, grid = ct * x.data.astype(F32), jnp.shape(x.scale)
    ct_s = jnp.sum(prod) if len(grid) == 0 else qf.block_reduce(prod, block_of(grid, prod.shape), jnp.sum)
    return ScaledArray(ct_d, ct_s.astype(x.scale.dtype))


def _conform(o, like):
    """``o`` with the type of ``like`` (plain or a carrier with the same scale grid)."""
    if not isinstance(like, ScaledArray):
        return dequant(o, like.dtype) if isinstance(o, ScaledArray) else o
    if isinstance(o, ScaledArray):
        o = to_carrier(o)
        if o.scale.shape == like.scale.shape and o.data.dtype == like.data.dtype:
            return o
        o = dequant(o)
    return ScaledArray(jnp.asarray(o).astype(like.data.dtype), jnp.ones(like.scale.shape, F32))


def _flat_primal(eqn, args):
    """``(leaves, treedef, body)``: the operands' carrier leaves and the interpreted primal on them."""
    leaves, treedef = _flatten_operands(args)
    (primal,) = jaxprs(eqn)

    def body(*flat):
        return _carrier_outputs(eval_closed(primal, *treedef.unflatten(flat)))

    return leaves, treedef, body


def _custom_jvp(eqn, args):
    nc = len(operand_groups(eqn, args)[0])
    (jvp_rule,) = derivative_rule(eqn)
    leaves, treedef, body = _flat_primal(eqn, args)
    fn = jax.custom_jvp(body)

    @fn.defjvp
    def _(primal_leaves, tangent_leaves):
        outs = fn(*primal_leaves)
        xs = treedef.unflatten(list(primal_leaves))[nc:]
        ts = treedef.unflatten(list(tangent_leaves))[nc:]
        zeros = [not _differentiable(x.data if isinstance(x, ScaledArray) else x) for x in xs]
        jaxpr, consts, out_zeros = custom_jvp_jaxpr(jvp_rule, zeros)
        nz = [_logical_tangent(x, t) for x, t, z in zip(xs, ts, zeros, strict=True) if not z]
        res = eval_jaxpr(jaxpr, consts, *xs, *nz)
        nz_out = iter(res[len(out_zeros) :])
        tangents = [
            _leaf_tangent(o, jnp.zeros(o.shape, o.dtype) if z else next(nz_out))
            for o, z in zip(outs, out_zeros, strict=True)
        ]
        return outs, tangents

    return fn(*leaves)


def _custom_vjp(eqn, args):
    nc = len(operand_groups(eqn, args)[0])
    fwd_rule, bwd_rule, out_trees = derivative_rule(eqn)
    leaves, treedef, body = _flat_primal(eqn, args)
    fn = jax.custom_vjp(body)

    def fwd(*flat):
        xs = treedef.unflatten(list(flat))
        primals = xs[nc:]
        nonzeros = [_differentiable(x) for x in primals]
        jaxpr, consts, n_res, input_fwds = custom_vjp_fwd_jaxpr(fwd_rule, out_trees, nonzeros)
        outs = eval_jaxpr(jaxpr, consts, *primals)
        computed = iter(outs[:n_res])
        res = [next(computed) if f is None else primals[f] for f in input_fwds]
        like = jax.eval_shape(body, *flat)
        outs = [_conform(o, lk) for o, lk in zip(_carrier_outputs(outs[n_res:]), like, strict=True)]
        return outs, (res, list(flat), outs)

    def bwd(saved, cts):
        res, flat, outs = saved
        xs = treedef.unflatten(flat)
        cts_v = [
            (c.data.astype(F32) / expand_scale(o.scale, o.data.shape)).astype(o.dtype)
            if isinstance(o, ScaledArray)
            else c
            for o, c in zip(outs, cts, strict=True)
        ]
        in_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs[nc:]]
        user_bwd = scalify(lambda *a: custom_vjp_bwd(bwd_rule, a[: len(res)], a[len(res) :], in_avals))
        cts_in = user_bwd(*res, *cts_v)
        leaf_cts = [None] * nc + [_leaf_cotangent(x, c) for x, c in zip(xs[nc:], cts_in, strict=True)]
        flat_cts = []
        for x, c in zip(xs, leaf_cts, strict=True):
            if isinstance(x, ScaledArray):
                flat_cts += [None, None] if c is None else [c.data, c.scale]
            else:
                flat_cts.append(c)
        return tuple(flat_cts)

    fn.defvjp(fwd, bwd)
    return fn(*leaves)


@register_rule(
    [custom_jvp_call_p],
    "control",
    "re-emitted as a jax.custom_jvp of the interpreted primal; the JVP rule is interpreted on scaled primals.",
    raw=True,
)
def _custom_jvp_call(eqn, *args):
    return _custom_jvp(eqn, args)


@register_rule(
    [custom_vjp_call_p],
    "control",
    "re-emitted as a jax.custom_vjp of the interpreted primal/fwd; bwd is scalified on the residuals.",
    raw=True,
)
def _custom_vjp_call(eqn, *args):
    return _custom_vjp(eqn, args)


@register_rule([remat_p], "control", "jax.checkpoint (same policy, prevent_cse) of the interpreted body.", raw=True)
def _remat(eqn, *args):
    return rebuild(WALK, eqn, list(args))


def _as_loop_value(x, scaled: bool):
    """Uniform type for values crossing branch / iteration boundaries."""
    if not scaled:
        return x
    if isinstance(x, ScaledArray):
        c = fold(to_carrier(x))
        return ScaledArray(c.data, jnp.asarray(c.scale, F32).reshape(()))
    x = jnp.asarray(x)
    return ScaledArray(x, jnp.ones((), F32))


def _scaled_mask(outs):
    return [isinstance(o, ScaledArray) for o in outs]


@register_rule([cond_p], "control", "lax.switch over interpreted branches; scaled outputs as per-tensor carriers.")
def _cond(eqn, index, *ops):
    (branches,) = jaxprs(eqn)
    if isinstance(index, ScaledArray):
        index = dequant(index)
    fns = [functools.partial(eval_closed, br) for br in branches]
    masks = [_scaled_mask(jax.eval_shape(f, *ops)) for f in fns]
    mask = [any(col) for col in zip(*masks, strict=True)]

    def make(f):
        return lambda *a: [_as_loop_value(o, m) for o, m in zip(f(*a), mask, strict=True)]

    return lax.switch(index, [make(f) for f in fns], *ops)


def _carry_fixpoint(body, carry):
    """Which carries must be scaled: iterate until the body's output structure is stable."""
    mask = _scaled_mask(carry)
    for _ in range(len(carry) + 1):
        init = [_as_loop_value(c, m) for c, m in zip(carry, mask, strict=True)]
        out = body(init)
        new = [m or s for m, s in zip(mask, _scaled_mask(out), strict=True)]
        if new == mask:
            return mask
        mask = new
    return mask


_ADDS = (lax.add_p, lax.sub_p, add_any_p)


def _accumulators(jaxpr, first_carry: int, n: int) -> list[bool]:
    """Which of the ``n`` carries (body inputs from ``first_carry``, outputs from 0) the body
    returns as ``carry + term`` (an add whose operand is the carry itself)."""
    producer = {id(v): e for e in jaxpr.eqns for v in e.outvars}
    out = []
    for i in range(n):
        e = producer.get(id(jaxpr.outvars[i]))
        carry = jaxpr.invars[first_carry + i]
        out.append(e is not None and e.primitive in _ADDS and any(v is carry for v in e.invars))
    return out


def _enter(init, mask, accumulates):
    """The loop's entry carries and, per carry, its anchor (:func:`loop_entry`) and data bound
    inside the body (:func:`loop_bound`)."""
    entries = [loop_entry(_as_loop_value(c, m), acc) for c, m, acc in zip(init, mask, accumulates, strict=True)]
    init, anchors = [c for c, _ in entries], [a for _, a in entries]
    return init, anchors, [loop_bound(c, a) for c, a in zip(init, anchors, strict=True)]


def _noted(values, bounds):
    """``values`` with their data bounds recorded (None: unknown), for the evaluation they enter."""
    for v, hi in zip(values, bounds, strict=True):
        if hi is not None:
            note_bound(v, hi)
    return values


def _where_leading(pred, new, old):
    """``where(pred, new, old)`` with ``pred`` broadcast along the leading axes (scaled: on a common scale)."""
    where = lax.broadcast_in_dim(pred, jnp.shape(old), tuple(range(jnp.ndim(pred))))
    if not (isinstance(new, ScaledArray) or isinstance(old, ScaledArray)):
        return lax.select(where, new, old)
    (dn, do), s = align([new, old], finite=True)
    return ScaledArray(lax.select(where, dn, do), s)


@register_rule(
    [while_p],
    "control",
    "lax.while_loop over interpreted cond/body; scaled carries per-tensor: settled each iteration, f32/bf16 "
    "accumulators (carry + term) on one scale for the loop; a batched predicate (vmap) runs while any "
    "example's holds, each carry selected per example.",
)
def _while(eqn, *args):
    cconsts, bconsts, init = operand_groups(eqn, args)
    cond_j, body_j = jaxprs(eqn)

    def shape_body(c):
        return jax.eval_shape(lambda cc: eval_closed(body_j, *bconsts, *cc), c)

    mask = _carry_fixpoint(shape_body, init)

    init, anchors, bounds = _enter(init, mask, _accumulators(body_j.jaxpr, len(bconsts), len(init)))

    def predicate(c):
        (pred,) = eval_closed(cond_j, *cconsts, *c)
        return dequant(pred) if isinstance(pred, ScaledArray) else pred

    # A batched predicate (jax.vmap of a loop whose trip count depends on the example): the loop
    # runs while any example's does, and each carry keeps its old value where its own predicate is
    # false, as JAX lowers while_p with a non-scalar predicate.
    batched = bool(cond_j.out_avals[0].shape)

    def body(c):
        c = _noted(c, bounds)
        outs = eval_closed(body_j, *bconsts, *c)
        if batched:
            pred = predicate(c)
            outs = [_where_leading(pred, o, x) for o, x in zip(outs, c, strict=True)]
        return [carried(_as_loop_value(o, m), a) for o, m, a in zip(outs, mask, anchors, strict=True)]

    def cond(c):
        pred = predicate(_noted(c, bounds))
        return jnp.any(pred) if batched else pred

    return lax.while_loop(cond, body, init)


@register_rule(
    [scan_p],
    "control",
    "lax.scan over the interpreted body; scaled carries as in while_loop; ys stacked scales, their data bounds kept.",
)
def _scan(eqn, *args):
    consts, init, xs = operand_groups(eqn, args)
    (closed,) = jaxprs(eqn)
    ncarry = len(init)

    # xs: per-tensor scales stay outside the loop; block scales along axis 0 are scanned.
    xs_in, layout, xbounds = [], [], []
    for x in xs:
        if isinstance(x, ScaledArray):
            if x.scale.ndim > 0 and x.scale.shape[0] != x.data.shape[0]:
                x = fold(x)
            xbounds.append(bound_of(x))  # a slice's data is bounded by the stacked data's bound
            if x.scale.ndim == 0:
                xs_in.append(x.data)
                layout.append(("const", x.scale))
            else:
                xs_in.append(x)
                layout.append(("scan", None))
        else:
            xs_in.append(x)
            layout.append(("plain", None))
            xbounds.append(None)

    def unpack(xs_t):
        return _noted(_unpacked(xs_t), xbounds)

    def _unpacked(xs_t):
        out = []
        for v, (kind, s) in zip(xs_t, layout, strict=True):
            if kind == "const":
                out.append(ScaledArray(v, s))
            elif kind == "scan":
                out.append(
                    ScaledArray(
                        v.data,
                        v.scale.reshape((1,) * (v.data.ndim - v.scale.ndim) + v.scale.shape)
                        if v.data.ndim
                        else v.scale.reshape(()),
                    )
                )
            else:
                out.append(v)
        return out

    def raw_body(c, x):
        outs = eval_closed(closed, *consts, *c, *unpack(x))
        return outs[:ncarry], outs[ncarry:]

    x0 = jax.tree.map(lambda a: a[0], xs_in)

    def shape_body(c):
        return jax.eval_shape(lambda cc: raw_body(cc, x0)[0], c)

    mask = _carry_fixpoint(shape_body, init)
    init_c, anchors, bounds = _enter(init, mask, _accumulators(closed.jaxpr, len(consts), ncarry))
    _, ys_shape = jax.eval_shape(lambda cc: raw_body(cc, x0), init_c)
    ymask = _scaled_mask(ys_shape)

    ybounds = [None] * len(ymask)

    def body(c, x):
        carry, ys = raw_body(_noted(c, bounds), x)
        carry = [carried(_as_loop_value(o, m), a) for o, m, a in zip(carry, mask, anchors, strict=True)]
        ys = [_as_loop_value(o, m) for o, m in zip(ys, ymask, strict=True)]
        # The bound of each output is a trace-time constant: the same for every iteration.
        ybounds[:] = [bound_of(y) if isinstance(y, ScaledArray) else None for y in ys]
        return carry, ys

    carry, ys = lax.scan(body, init_c, xs_in, **options(eqn))
    ys = [
        ScaledArray(y.data, y.scale.reshape(y.scale.shape + (1,) * (y.data.ndim - 1)))
        if isinstance(y, ScaledArray)
        else y
        for y in ys
    ]
    return [*carry, *_noted(ys, ybounds)]


# -- shard_map --------------------------------------------------------------------------------------
# The body is interpreted per shard, so values inside stay ScaledArrays and its collectives take the
# scaled rules (_rules_collectives). Specs are given for logical arrays; each operand's data and
# scale leaves get theirs from the format's block grid (scalify._sharding): a one-element scale is
# replicated, a block grid is split like the data when every shard holds whole blocks.


def _leaf_in_spec(x, spec, mesh, index):
    """The in_specs of operand ``index``: ``spec`` itself, or a ScaledArray of specs for its leaves."""
    if not isinstance(x, ScaledArray):
        return spec
    try:
        return scaled_sharding(x, spec, mesh=mesh)
    except ValueError as e:
        raise ValueError(f"scalify: shard_map operand {index} (in_specs {spec}): {e}") from None


def _shard_out(o):
    """A body output in a form one logical out_spec lays out: a carrier whose scale has the data's
    rank. A one-element scale becomes a grid of one block per shard, so the output's scale is the
    shards' scales side by side (exact; nothing is rescaled to a common scale)."""
    if not isinstance(o, ScaledArray):
        return o
    c = to_carrier(o)
    if c.scale.ndim == c.data.ndim:
        return c
    if c.scale.size != 1:
        raise ValueError(
            f"scalify: a shard_map output ScaledArray{list(c.shape)} has a scale of shape {c.scale.shape}, "
            f"neither one element nor a block grid of the data's rank; its blocks cannot be laid out by "
            f"out_specs. Dequantize it inside the body (scalify.ops.dequantize) before returning it."
        )
    return ScaledArray(c.data, c.scale.reshape((1,) * c.data.ndim))


@register_rule(
    [q for q in (shard_map_p,) if q is not None],
    "control",
    "jax.shard_map of the interpreted body; scale leaves laid out like their blocks (one element: "
    "replicated), outputs carriers whose scale is the grid of the shards' scales.",
    raw=True,
)
def _shard_map(eqn, *args):
    opts = options(eqn)
    (body,) = jaxprs(eqn)
    specs = zip(args, opts.pop("in_specs"), strict=True)
    in_specs = tuple(_leaf_in_spec(x, s, opts["mesh"], i) for i, (x, s) in enumerate(specs))

    def local(*xs):
        return tuple(_shard_out(o) for o in eval_closed(body, *xs))

    return list(jax.shard_map(local, in_specs=in_specs, **opts)(*args))


# -- custom_linear_solve ------------------------------------------------------------------------------
def _as_values(outs, avals):
    return [dequant(o, a.dtype) if isinstance(o, ScaledArray) else o for o, a in zip(outs, avals, strict=True)]


def _on_leaves(sub, treedef, k):
    """``sub`` as a function of its constants' pytree leaves (ScaledArrays flattened) and the vector."""
    return lambda *a: _as_values(eval_closed(sub, *treedef.unflatten(list(a[:k])), *a[k:]), sub.out_avals)


@register_rule(
    [linear_solve_p],
    "control",
    "re-emitted as custom_linear_solve with its matvec / vecmat / solve / transpose_solve interpreted: "
    "their constants (the matrix) enter scaled, as stored; right-hand side and solution as values in "
    "the program's dtype (the solver iterates on them); JAX's implicit derivative rules kept.",
    raw=True,
)
def _linear_solve(eqn, *args):
    lengths, closed = eqn.params["const_lengths"], eqn.params["jaxprs"]
    n = sum(lengths)
    b = _as_values(args[n:], [v.aval for v in eqn.invars[n:]])
    b_avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in b]
    new_lengths, new_jaxprs, operands, start = [], [], [], 0
    for count, sub in zip(lengths, closed, strict=True):
        consts, start = list(args[start : start + count]), start + count
        if sub is None:
            new_lengths.append(0)
            new_jaxprs.append(None)
            continue
        leaves, treedef = jax.tree.flatten(consts)
        retraced, hoisted = traced_with_hoisted_consts(_on_leaves(sub, treedef, len(leaves)), *leaves, *b_avals)
        new_lengths.append(len(hoisted) + len(leaves))
        new_jaxprs.append(retraced)
        operands += hoisted + leaves
    params = {"const_lengths": type(lengths)(*new_lengths), "jaxprs": type(closed)(*new_jaxprs)}
    return bind_params(linear_solve_p, [*operands, *b], params)


del is_scaled_leaf
