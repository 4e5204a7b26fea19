"""The amp interpreter: evaluate a jaxpr, recasting each equation's inputs according to a policy.

Values flow between equations in whatever dtype the last operation produced (so a chain of
low-precision matmuls does not round-trip through float32); an equation without a policy entry gets
its floating inputs cast back to the dtypes of the traced program. Sub-jaxprs (jit, scan, while,
cond, checkpoint, custom_jvp / custom_vjp) are re-traced through the interpreter and re-bound with
the same parameters, so the policy reaches inside them while shardings, donation, names and custom
derivative rules are kept. At every sub-jaxpr boundary and at the output, values are cast back to
their original dtypes, so the signature of every (sub-)program is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalify.amp import _jax_compat as jc
from scalify.amp._policy import (
    BindRule,
    QuantizeInputs,
    as_precision_fn,
    cast_if_float,
    default_amp_policy,
    use_original_precision,
)

_SOFT_STOPS = ("amp_step", "amp_default")


class _Context:
    """What the interpreter needs besides the jaxpr: compute dtype and normalised policy."""

    def __init__(self, compute_dtype, policy: Mapping[Any, Callable]):
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.policy = policy
        # sub-jaxpr -> re-traced sub-jaxpr, for one call of the amp'ed function (jnp helpers such as
        # ``_where`` appear many times; reusing one jaxpr object also lets JAX reuse its caches)
        self.retraced: dict = {}

    def for_one_call(self) -> _Context:
        return _Context(self.compute_dtype, self.policy)

    def lookup(self, scopes: tuple[str, ...], primitive) -> Callable:
        """The precision function for ``primitive`` under the named ``scopes`` (outermost first)."""
        if "amp_stop" in scopes:
            return use_original_precision
        for scope in scopes:
            if scope in self.policy:
                return self.policy[scope]
            if scope in _SOFT_STOPS:
                return use_original_precision
        if primitive in self.policy:
            return self.policy[primitive]
        if "amp_default" in self.policy:
            return self.policy["amp_default"]
        return use_original_precision


def _normalise_policy(amp_policy) -> dict:
    if amp_policy is None:
        amp_policy = default_amp_policy
    if not isinstance(amp_policy, Mapping):
        raise TypeError(f"amp_policy must be a dict keyed by lax primitives or scope names, got {amp_policy!r}.")
    out = {}
    for key, value in amp_policy.items():
        if not isinstance(key, (str, jc.Primitive)):
            raise TypeError(
                f"amp_policy keys must be lax primitives (e.g. jax.lax.dot_general_p) or jax.named_scope "
                f"names; got {key!r}."
            )
        out[key] = as_precision_fn(value)
    return out


def _read(env, v):
    return v.val if isinstance(v, jc.Literal) else env[v]


def _cast_to_avals(values, avals):
    return [cast_if_float(a.dtype, x) if hasattr(a, "dtype") else x for x, a in zip(values, avals, strict=True)]


def _has_subjaxpr(params) -> bool:
    for v in params.values():
        vs = v if isinstance(v, (tuple, list)) else (v,)
        if any(isinstance(x, (jc.ClosedJaxpr, jc.Jaxpr)) for x in vs):
            return True
    return False


def eval_jaxpr(ctx: _Context, closed, args, scopes: tuple[str, ...] = ()) -> list:
    """Evaluate ``closed`` on ``args`` under the amp policy; outputs have the jaxpr's dtypes."""
    jaxpr = closed.jaxpr
    env: dict = {}
    for v, x in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    base_name_stack = jc.current_name_stack()
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        orig_dtypes = [getattr(v.aval, "dtype", None) for v in eqn.invars]
        eqn_scopes = (*scopes, *jc.scope_names(eqn.source_info.name_stack))
        prim = eqn.primitive
        with jc.eqn_context(eqn, base_name_stack):
            handler = _HIGHER_ORDER.get(prim)
            if handler is not None:
                invals = _cast_to_avals(invals, [v.aval for v in eqn.invars])
                outs = handler(ctx, eqn, invals, eqn_scopes)
            elif _has_subjaxpr(eqn.params):
                # Unknown higher-order primitive (shard_map, custom batching, ...): run it unchanged.
                invals = _cast_to_avals(invals, [v.aval for v in eqn.invars])
                outs = _bind(prim, invals, eqn.params)
            else:
                rule = ctx.lookup(eqn_scopes, prim)
                subfuns, params = jc.get_bind_params(prim, eqn.params)
                if isinstance(rule, BindRule):
                    invals = _cast_to_avals(invals, [v.aval for v in eqn.invars])
                    outs = rule.bind(prim, invals, params, [v.aval for v in eqn.outvars])
                else:
                    if isinstance(rule, QuantizeInputs):
                        invals, params = rule.apply(prim, ctx.compute_dtype, orig_dtypes, invals, params)
                    else:
                        invals, params = rule(ctx.compute_dtype, orig_dtypes, *invals, **params)
                    outs = prim.bind(*subfuns, *invals, **params)
                    if not prim.multiple_results:
                        outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jc.DropVar):
                env[v] = x
    outs = [_read(env, v) for v in jaxpr.outvars]
    return _cast_to_avals(outs, [v.aval for v in jaxpr.outvars])


def _bind(prim, invals, params):
    subfuns, bind_params = jc.get_bind_params(prim, params)
    outs = prim.bind(*subfuns, *invals, **bind_params)
    return list(outs) if prim.multiple_results else [outs]


def retrace(ctx: _Context, closed, scopes: tuple[str, ...]):
    """A ClosedJaxpr with ``closed``'s signature whose body runs under the amp policy."""
    key = (closed, scopes)
    cached = ctx.retraced.get(key)
    if cached is not None and cached[0] is closed:
        return cached[1]

    def body(*args):
        return eval_jaxpr(ctx, closed, args, scopes)

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in closed.in_avals]
    with jc.fresh_name_stack():
        new = jax.make_jaxpr(body)(*specs)
    ctx.retraced[key] = (closed, new)  # keeps ``closed`` alive so the key's identity stays valid
    return new


# ------------------------------------------------------------------------------------------------
# Higher-order primitives
# ------------------------------------------------------------------------------------------------


def _jit_rule(ctx, eqn, invals, scopes):
    params = dict(eqn.params, jaxpr=retrace(ctx, eqn.params["jaxpr"], scopes))
    return _bind(eqn.primitive, invals, params)


def _scan_rule(ctx, eqn, invals, scopes):
    params = dict(eqn.params, jaxpr=retrace(ctx, eqn.params["jaxpr"], scopes))
    return _bind(eqn.primitive, invals, params)


def _while_rule(ctx, eqn, invals, scopes):
    params = dict(
        eqn.params,
        cond_jaxpr=retrace(ctx, eqn.params["cond_jaxpr"], scopes),
        body_jaxpr=retrace(ctx, eqn.params["body_jaxpr"], scopes),
    )
    return _bind(eqn.primitive, invals, params)


def _cond_rule(ctx, eqn, invals, scopes):
    branches = tuple(retrace(ctx, b, scopes) for b in eqn.params["branches"])
    return _bind(eqn.primitive, invals, dict(eqn.params, branches=branches))


def _remat_rule(ctx, eqn, invals, scopes):
    closed = jc.ClosedJaxpr(eqn.params["jaxpr"], ())

    def body(*args):
        return eval_jaxpr(ctx, closed, args, scopes)

    ckpt = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy"))
    return list(ckpt(*invals))


def _custom_jvp_rule(ctx, eqn, invals, scopes):
    params = dict(eqn.params)
    params["call_jaxpr"] = retrace(ctx, params["call_jaxpr"], scopes)
    orig_jvp = params["jvp_jaxpr_fun"]

    @functools.cache
    def amp_jvp_jaxpr(*zeros):
        jvp_jaxpr, consts, out_zeros = orig_jvp.call_wrapped(*zeros)
        new = retrace(ctx, jc.ClosedJaxpr(jvp_jaxpr, consts), scopes)
        return new.jaxpr, new.consts, out_zeros

    params["jvp_jaxpr_fun"] = jc.wrap_init(amp_jvp_jaxpr, orig_jvp)
    return _bind(eqn.primitive, invals, params)


def _custom_vjp_rule(ctx, eqn, invals, scopes):
    params = dict(eqn.params)
    params["call_jaxpr"] = retrace(ctx, params["call_jaxpr"], scopes)
    orig_fwd = params["fwd_jaxpr_thunk"]

    @functools.cache
    def amp_fwd_jaxpr(*nonzeros):
        fwd_jaxpr, consts = orig_fwd.call_wrapped(*nonzeros)
        new = retrace(ctx, jc.ClosedJaxpr(fwd_jaxpr, consts), scopes)
        return new.jaxpr, new.consts

    params["fwd_jaxpr_thunk"] = jc.wrap_init(amp_fwd_jaxpr, orig_fwd)
    return _bind(eqn.primitive, invals, params)


_HIGHER_ORDER = {
    jc.jit_p: _jit_rule,
    jc.scan_p: _scan_rule,
    jc.while_p: _while_rule,
    jc.cond_p: _cond_rule,
    jc.remat_p: _remat_rule,
    jc.custom_jvp_call_p: _custom_jvp_rule,
    jc.custom_vjp_call_p: _custom_vjp_rule,
}


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------


def _is_dynamic(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def amp(fn: Callable | None = None, *, compute_dtype=jnp.float16, amp_policy: Mapping | None = None) -> Callable:
    """Run ``fn`` with some operations in low precision (automatic mixed precision).

    Args:
      fn: any JAX-traceable function. Array leaves of its arguments are traced; every other leaf
        (Python numbers, strings, callables, static module fields) is passed through as a constant.
        ``amp(compute_dtype=...)`` without ``fn`` returns a decorator.
      compute_dtype: the low-precision dtype handed to precision functions (default float16).
      amp_policy: dict from lax primitives or ``jax.named_scope`` names to precision functions
        (jaxamp signature), dtypes or qformats formats. ``None`` means :data:`default_amp_policy`
        (jaxamp's): ``add``, ``sub``, ``dot_general`` and ``conv_general_dilated`` in ``compute_dtype``,
        ``exp``, ``log``, ``mul`` and ``div`` in float32, everything else in the program's own
        precision. :data:`matmul_amp_policy` changes only the matmul-like primitives.

    Returns:
      A function with ``fn``'s signature and output dtypes.
    """
    if fn is None:
        return functools.partial(amp, compute_dtype=compute_dtype, amp_policy=amp_policy)
    ctx = _Context(compute_dtype, _normalise_policy(amp_policy))

    @functools.wraps(fn)
    def amp_fn(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dyn_idx = [i for i, x in enumerate(leaves) if _is_dynamic(x)]

        def flat_fn(*dyn):
            full = list(leaves)
            for i, x in zip(dyn_idx, dyn, strict=True):
                full[i] = x
            a, k = jax.tree.unflatten(treedef, full)
            return fn(*a, **k)

        dyn = [leaves[i] for i in dyn_idx]
        scopes = tuple(jc.scope_names(jc.current_name_stack()))
        with jc.fresh_name_stack():
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
        outs = eval_jaxpr(ctx.for_one_call(), closed, dyn, scopes)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return amp_fn


class _AmpStop:
    """``amp_stop`` as a decorator (``@amp_stop``, ``amp_stop(f)``) or a context manager."""

    def __call__(self, f: Callable | None = None):
        if f is None:
            return jax.named_scope("amp_stop")

        @functools.wraps(f)
        def stopped(*args, **kwargs):
            with jax.named_scope("amp_stop"):
                return f(*args, **kwargs)

        return stopped

    def __init__(self):
        self._open: list = []  # supports nested ``with amp_stop:``

    def __enter__(self):
        cm = jax.named_scope("amp_stop")
        self._open.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self._open.pop().__exit__(*exc)

    def __repr__(self):
        return "amp_stop"


amp_stop = _AmpStop()
amp_stop.__doc__ = """Keep the code inside in the program's own precision under :func:`amp`.

Use as ``@amp_stop``, ``amp_stop(fn)``, ``with amp_stop():`` or ``with amp_stop:``. It opens the
``jax.named_scope("amp_stop")``, which amp honours whatever the policy says (it beats every other key).
"""
