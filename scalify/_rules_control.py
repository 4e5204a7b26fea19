"""Rules for primitives with sub-jaxprs: the sub-jaxprs are interpreted with the same rule table.

* ``jit`` / ``closed_call``: re-emitted as a nested ``jax.jit`` of the interpreted body;
* ``checkpoint`` (remat): re-emitted as ``jax.checkpoint`` (same policy) of the interpreted body;
* ``custom_jvp_call`` / ``custom_vjp_call``: with plain operands they are bound unchanged (custom
  rule kept); with scaled operands the primal body is interpreted (derivatives of the scalified
  program then follow the interpreted primal);
* ``cond`` / ``while`` / ``scan``: re-emitted as ``lax.switch`` / ``lax.while_loop`` / ``lax.scan``
  over interpreted bodies. A loop-carried or branch output that is scaled anywhere is carried as a
  per-tensor carrier (data in the logical dtype, 0-d float32 scale) so every branch and iteration
  agrees on its type.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from scalify._config import get_config
from scalify._interpreter import eval_closed, eval_jaxpr
from scalify._jax_compat import (
    closed_call_p,
    cond_p,
    custom_jvp_call_p,
    custom_vjp_call_p,
    jit_p,
    remat_p,
    scan_p,
    while_p,
)
from scalify._registry import register_rule
from scalify._rules_common import F32, dequant, fold
from scalify._scaled_array import ScaledArray, is_scaled_leaf, to_carrier

_JIT_CACHE: dict = {}


def _cached_jit(closed, name):
    key = (id(closed), get_config())
    hit = _JIT_CACHE.get(key)
    if hit is not None and hit[0] is closed:
        return hit[1]

    def body(*args):
        return eval_closed(closed, *args)

    body.__name__ = str(name)
    fn = jax.jit(body)
    if len(_JIT_CACHE) > 1024:
        _JIT_CACHE.clear()
    _JIT_CACHE[key] = (closed, fn)
    return fn


@register_rule([jit_p], "control", "nested jit of the interpreted body (stays a jit in the output program).", raw=True)
def _jit(eqn, *args):
    return _cached_jit(eqn.params["jaxpr"], eqn.params.get("name", "scalified"))(*args)


@register_rule([closed_call_p], "control", "interpreted body inlined.", raw=True)
def _closed_call(eqn, *args):
    return eval_closed(eqn.params["call_jaxpr"], *args)


@register_rule(
    [custom_jvp_call_p, custom_vjp_call_p],
    "control",
    "plain operands: bound unchanged (custom rule kept); scaled operands: primal body interpreted.",
    raw=True,
)
def _custom_call(eqn, *args):
    closed = eqn.params["call_jaxpr"]
    return eval_closed(closed, *args)


@register_rule([remat_p], "control", "jax.checkpoint (same policy, prevent_cse) of the interpreted body.", raw=True)
def _remat(eqn, *args):
    jaxpr = eqn.params["jaxpr"]
    fn = jax.checkpoint(
        lambda *a: eval_jaxpr(jaxpr, (), *a),
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"),
    )
    return fn(*args)


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
    branches = eqn.params["branches"]
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


@register_rule([while_p], "control", "lax.while_loop over interpreted cond/body; scaled carries per-tensor.")
def _while(eqn, *args):
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cconsts, bconsts, init = args[:cn], args[cn : cn + bn], list(args[cn + bn :])
    cond_j, body_j = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]

    def shape_body(c):
        return jax.eval_shape(lambda cc: eval_closed(body_j, *bconsts, *cc), c)

    mask = _carry_fixpoint(shape_body, init)

    def body(c):
        return [_as_loop_value(o, m) for o, m in zip(eval_closed(body_j, *bconsts, *c), mask, strict=True)]

    def cond(c):
        (pred,) = eval_closed(cond_j, *cconsts, *c)
        return dequant(pred) if isinstance(pred, ScaledArray) else pred

    return lax.while_loop(cond, body, [_as_loop_value(c, m) for c, m in zip(init, mask, strict=True)])


@register_rule([scan_p], "control", "lax.scan over the interpreted body; scaled carries per-tensor, ys stacked scales.")
def _scan(eqn, *args):
    nc, ncarry = eqn.params["num_consts"], eqn.params["num_carry"]
    closed = eqn.params["jaxpr"]
    consts, init, xs = args[:nc], list(args[nc : nc + ncarry]), list(args[nc + ncarry :])
    length = eqn.params["length"]

    # xs: per-tensor scales stay outside the loop; block scales along axis 0 are scanned.
    xs_in, rebuild = [], []
    for x in xs:
        if isinstance(x, ScaledArray):
            if x.scale.ndim > 0 and x.scale.shape[0] != x.data.shape[0]:
                x = fold(x)
            if x.scale.ndim == 0:
                xs_in.append(x.data)
                rebuild.append(("const", x.scale))
            else:
                xs_in.append(x)
                rebuild.append(("scan", None))
        else:
            xs_in.append(x)
            rebuild.append(("plain", None))

    def unpack(xs_t):
        out = []
        for v, (kind, s) in zip(xs_t, rebuild, strict=True):
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
    init_c = [_as_loop_value(c, m) for c, m in zip(init, mask, strict=True)]
    _, ys_shape = jax.eval_shape(lambda cc: raw_body(cc, x0), init_c)
    ymask = _scaled_mask(ys_shape)

    def body(c, x):
        carry, ys = raw_body(c, x)
        carry = [_as_loop_value(o, m) for o, m in zip(carry, mask, strict=True)]
        ys = [_as_loop_value(o, m) for o, m in zip(ys, ymask, strict=True)]
        return carry, ys

    carry, ys = lax.scan(body, init_c, xs_in, length=length, reverse=eqn.params["reverse"], unroll=eqn.params["unroll"])
    ys = [
        ScaledArray(y.data, y.scale.reshape(y.scale.shape + (1,) * (y.data.ndim - 1)))
        if isinstance(y, ScaledArray)
        else y
        for y in ys
    ]
    return [*carry, *ys]


del is_scaled_leaf
