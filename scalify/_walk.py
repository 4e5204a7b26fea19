"""The one jaxpr walker under scalify, amp and the recipes.

As in JAX's own transformations there are three parts:

* one evaluation loop (:func:`eval_jaxpr`): literals, dropped outputs, each equation re-emitted
  under its own source info (traceback and name stack, so ``jax.named_scope`` survives) and
  context (compute type, ...), errors from rules annotated in one place (:func:`note_error`);
* one description per higher-order primitive (:data:`HIGHER_ORDER`): where its sub-jaxprs are and
  how to rebuild it around interpreted ones (:func:`rebuild`);
* a rule table per transformation: a :class:`Walk` subclass deciding what each equation becomes
  (scalify's ``RULES`` over ScaledArray carriers, amp's dtype policy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from scalify._jax_compat import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    Literal,
    bind_params,
    closed_call_p,
    cond_p,
    current_name_stack,
    custom_jvp_call_p,
    custom_vjp_call_p,
    fresh_name_stack,
    jaxprs_in_params,
    jit_p,
    remat_p,
    scan_p,
    shard_map_p,
    source_context,
    source_line,
    while_p,
    wrap_init,
)


class Walk:
    """A transformation's rule table: what each equation of a walked jaxpr becomes.

    The default binds every equation unchanged and walks into higher-order primitives, so a
    subclass overrides :meth:`apply` for the equations it changes.
    """

    #: ``{(closed, key): (closed, retraced)}`` shared by the walks of one call (None: no cache).
    cache: dict | None = None
    #: what, besides the sub-jaxpr, its retraced form depends on (amp: the enclosing scopes).
    key: object = None

    def eval(self, jaxpr, consts, args) -> list:
        """Evaluate a (sub-)jaxpr; a transformation with per-evaluation state starts it here."""
        return eval_jaxpr(self, jaxpr, consts, args)

    def apply(self, eqn, invals) -> list:
        """The outputs of ``eqn`` on ``invals`` (a list, also for single-result primitives)."""
        if eqn.primitive in HIGHER_ORDER:
            return rebuild(self, eqn, invals)
        return bind_params(eqn.primitive, invals, eqn.params)

    def outputs(self, jaxpr, outs) -> list:
        """The values a (sub-)jaxpr returns, from those its outvars hold."""
        return outs

    def backward(self, eqn, rule) -> tuple:
        """``(new_rule, seen)`` for the backward rule ``rule`` of the rebuilt ``eqn`` (a
        WrappedFun JAX calls after the walk); ``seen``, if not None, is called with the forward
        rule's jaxpr each time JAX asks for it. By default the rule is kept as it is."""
        return rule, None

    def describe(self, x) -> str:
        """How an operand appears in error messages."""
        return f"{jnp.result_type(x)}{list(jnp.shape(x))}"


def eval_jaxpr(walk: Walk, jaxpr, consts, args) -> list:
    """Evaluate the open ``jaxpr`` on ``consts`` and ``args``, each equation through ``walk.apply``."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    base = current_name_stack()  # the scopes around this evaluation, prefixed to each equation's
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with source_context(eqn, base), eqn.ctx.manager:
            try:
                outs = walk.apply(eqn, invals)
            except Exception as exc:
                note_error(exc, eqn, invals, walk.describe)
                raise
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, DropVar):
                env[v] = x
    return walk.outputs(jaxpr, [read(v) for v in jaxpr.outvars])


def note_error(exc: BaseException, eqn, invals, describe: Callable) -> None:
    """Add to ``exc`` the failing primitive, its operand types and the user's source line.

    Called at every level the error passes through (an error in a jit body also passes through the
    ``jit`` equation around it): the innermost equation names the primitive and operands, the
    innermost one with a user frame (jnp functions are jits of JAX-internal code) names the line.
    The exception keeps its type and message; the note is added once.
    """
    if getattr(exc, "_scalify_eqn_located", False):
        return
    failed = getattr(exc, "_scalify_eqn_failed", None)
    if failed is None:
        try:
            operands = ", ".join(describe(x) for x in invals)
        except Exception:  # pragma: no cover - describing must not hide the error
            operands = "?"
        failed = exc._scalify_eqn_failed = (eqn.primitive.name, operands)
    line = source_line(eqn)
    if not line or line == "unknown":
        return  # JAX-internal code: an enclosing equation names the user's line
    name, operands = failed
    where = f"at {line}" if name == eqn.primitive.name else f"(inside `{eqn.primitive.name}` at {line})"
    exc.add_note(f"While transforming `{name}` {where} on operands ({operands}).")
    exc._scalify_eqn_located = True


def eval_closed(walk: Walk, closed, args) -> list:
    """Evaluate a ClosedJaxpr with ``walk`` (a fresh evaluation: :meth:`Walk.eval`)."""
    return walk.eval(closed.jaxpr, closed.consts, list(args))


def interpreted(walk: Walk, closed) -> Callable:
    """``closed`` as a Python function evaluated by ``walk``."""
    return lambda *args: eval_closed(walk, closed, args)


def retrace(walk: Walk, closed):
    """A ClosedJaxpr with ``closed``'s signature (avals, including shard_map's varying axes and
    sharding) whose body is ``closed`` evaluated by ``walk``; cached in ``walk.cache``."""
    key = (closed, walk.key)
    hit = walk.cache.get(key) if walk.cache is not None else None
    if hit is not None and hit[0] is closed:
        return hit[1]
    with fresh_name_stack():  # as jax.jit traces a body: its scopes are its own
        new = jax.make_jaxpr(interpreted(walk, closed))(*closed.in_avals)
    if walk.cache is not None:
        walk.cache[key] = (closed, new)  # keeps ``closed`` alive so the key's identity stays valid
    return new


# -- higher-order primitives ------------------------------------------------------------------------
# The only place in the library that names the params of a higher-order primitive: the walker's
# `rebuild` and scalify's control rules both read sub-jaxprs, operand counts and options through it.


class HigherOrder(NamedTuple):
    """Where a higher-order primitive keeps its sub-jaxprs, and how it is rebuilt around new ones.

    Attributes:
        closed: params holding ClosedJaxprs (or tuples of them, cond's ``branches``); rebuilt by
            binding the primitive again with each replaced by its retraced form (same signature), so
            every other param (shardings, donation, names, unroll, ...) is kept.
        open: the param holding an open Jaxpr (no consts), rebuilt by ``emit``.
        derivative: params of a custom derivative rule: first the lazy rule that returns
            ``(jaxpr, consts, *rest)`` (custom_jvp's JVP, custom_vjp's forward; its jaxpr is
            retraced when JAX asks for it), then what goes with it (custom_vjp's bwd, out_trees).
        backward: the param holding a backward rule JAX calls after the walk (custom_vjp's
            ``bwd``, a function of the residuals and cotangents): replaced by ``Walk.backward``.
        counts: params giving the sizes of the leading operand groups (consts, carries); the
            operands after them form the last group.
        options: ``options(params) -> dict``: the equation's options as keyword arguments of the
            public function that re-emits it (``lax.scan``, ``jax.checkpoint``, ``jax.shard_map``;
            jit: its ``name``).
        emit: ``emit(options, body, invals) -> outs`` re-emits the primitive through its public API
            with ``body``, the walked ``open`` jaxpr, as the function.
    """

    closed: tuple[str, ...] = ()
    open: str | None = None
    derivative: tuple[str, ...] = ()
    backward: str | None = None
    counts: tuple[str, ...] = ()
    options: Callable = lambda params: {}
    emit: Callable | None = None


def _jit_options(params) -> dict:
    return {"name": params.get("name")}


def _scan_options(params) -> dict:
    return {"length": params["length"], "reverse": params["reverse"], "unroll": params["unroll"]}


def _checkpoint_options(params) -> dict:
    """``jax.checkpoint`` keyword arguments that rebuild a ``checkpoint`` (remat) equation."""
    return {"prevent_cse": params.get("prevent_cse", True), "policy": params.get("policy")}


def _shard_map_options(params) -> dict:
    """``jax.shard_map`` keyword arguments that rebuild a ``shard_map`` equation (flat operands)."""
    return {
        "mesh": params["mesh"],
        "in_specs": tuple(params["in_specs"]),
        "out_specs": tuple(params["out_specs"]),
        "axis_names": set(params["newly_manual_axes"]),
        "check_vma": params["check_vma"],
    }


def _emit_checkpoint(options, body, invals):
    return list(jax.checkpoint(body, **options)(*invals))


def _emit_shard_map(options, body, invals):
    # The public shard_map traces the body with the mesh axes bound and the per-shard types.
    return list(jax.shard_map(lambda *a: tuple(body(*a)), **options)(*invals))


HIGHER_ORDER: dict = {
    jit_p: HigherOrder(closed=("jaxpr",), options=_jit_options),
    closed_call_p: HigherOrder(closed=("call_jaxpr",)),
    cond_p: HigherOrder(closed=("branches",)),
    while_p: HigherOrder(closed=("cond_jaxpr", "body_jaxpr"), counts=("cond_nconsts", "body_nconsts")),
    scan_p: HigherOrder(closed=("jaxpr",), counts=("num_consts", "num_carry"), options=_scan_options),
    custom_jvp_call_p: HigherOrder(closed=("call_jaxpr",), derivative=("jvp_jaxpr_fun",), counts=("num_consts",)),
    custom_vjp_call_p: HigherOrder(
        closed=("call_jaxpr",),
        derivative=("fwd_jaxpr_thunk", "bwd", "out_trees"),
        backward="bwd",
        counts=("num_consts",),
    ),
    remat_p: HigherOrder(open="jaxpr", options=_checkpoint_options, emit=_emit_checkpoint),
}
if shard_map_p is not None:
    HIGHER_ORDER[shard_map_p] = HigherOrder(open="jaxpr", options=_shard_map_options, emit=_emit_shard_map)


def jaxprs(eqn) -> tuple:
    """``eqn``'s sub-jaxprs, one entry per ``closed`` param in order (cond: the tuple of branches),
    then the ``open`` body as a ClosedJaxpr without consts."""
    spec = HIGHER_ORDER[eqn.primitive]
    out = tuple(eqn.params[name] for name in spec.closed)
    if spec.open is not None:
        out += (ClosedJaxpr(eqn.params[spec.open], ()),)
    return out


def with_jaxprs(eqn, new) -> dict:
    """``eqn``'s params with its ``closed`` sub-jaxprs replaced by ``new`` (shaped as :func:`jaxprs`)."""
    spec = HIGHER_ORDER[eqn.primitive]
    return {**eqn.params, **dict(zip(spec.closed, new, strict=True))}


def derivative_rule(eqn) -> tuple:
    """The params of ``eqn``'s custom derivative rule, in the order of ``derivative``."""
    return tuple(eqn.params[name] for name in HIGHER_ORDER[eqn.primitive].derivative)


def operand_groups(eqn, invals) -> list[list]:
    """``invals`` split by the ``counts`` params: ``[consts, ..., rest]`` (while: cond consts, body
    consts, carries; scan: consts, carries, xs; custom_jvp/vjp: consts, primals)."""
    groups, start = [], 0
    for name in HIGHER_ORDER[eqn.primitive].counts:
        n = eqn.params[name]
        groups.append(list(invals[start : start + n]))
        start += n
    return [*groups, list(invals[start:])]


def options(eqn) -> dict:
    """``eqn``'s options as keyword arguments of its public re-emission (see :class:`HigherOrder`)."""
    return HIGHER_ORDER[eqn.primitive].options(eqn.params)


def sub_jaxprs(eqn) -> list:
    """The sub-jaxprs ``eqn`` evaluates eagerly (ClosedJaxprs or open Jaxprs, as its params hold
    them; lazy derivative rules excluded)."""
    if eqn.primitive not in HIGHER_ORDER:  # a higher-order primitive this module does not describe
        return list(jaxprs_in_params(eqn.params))
    out = []
    for value in jaxprs(eqn):
        out.extend(value if isinstance(value, (tuple, list)) else [value])
    return out


def sub_jaxpr_operands(eqn) -> list[list[int | None]]:
    """For each of ``eqn``'s sub-jaxprs (as :func:`sub_jaxprs` lists them), the index of the
    operand of ``eqn`` each of its invars receives; ``None`` for a loop carry, whose value changes
    from one iteration to the next (while, scan). Other sub-jaxprs take the trailing operands
    (jit, checkpoint, custom rules and shard_map all of them; cond's branches all but the index)."""
    n, p = len(eqn.invars), eqn.params
    if eqn.primitive is while_p:
        cc, bc = p["cond_nconsts"], p["body_nconsts"]
        carry = [None] * (n - cc - bc)
        return [[*range(cc), *carry], [*range(cc, cc + bc), *carry]]
    if eqn.primitive is scan_p:
        c, k = p["num_consts"], p["num_carry"]
        return [[*range(c), *[None] * k, *range(c + k, n)]]
    out = []
    for j in sub_jaxprs(eqn):
        m = len(j.jaxpr.invars if isinstance(j, ClosedJaxpr) else j.invars)
        out.append(list(range(n - m, n)))
    return out


def sub_jaxpr_results(eqn) -> list[list[int | None]]:
    """For each of ``eqn``'s sub-jaxprs (as :func:`sub_jaxprs` lists them), the index of the output
    of ``eqn`` each of its outvars becomes; ``None`` for a loop carry (while's body, scan's carries)
    and for a sub-jaxpr whose outputs are not ``eqn``'s (while's predicate)."""
    if eqn.primitive is while_p:
        cond, body = sub_jaxprs(eqn)
        return [[None] * len(cond.jaxpr.outvars), [None] * len(body.jaxpr.outvars)]
    if eqn.primitive is scan_p:
        k = eqn.params["num_carry"]
        return [[*[None] * k, *range(k, len(eqn.outvars))]]
    out = []
    for j in sub_jaxprs(eqn):
        m = len(j.jaxpr.outvars if isinstance(j, ClosedJaxpr) else j.outvars)
        out.append(list(range(m)) if m == len(eqn.outvars) else [None] * m)
    return out


def has_sub_jaxprs(eqn) -> bool:
    """Whether ``eqn`` is a higher-order primitive (described here or not)."""
    if eqn.primitive in HIGHER_ORDER:
        return True
    for v in eqn.params.values():
        vs = v if isinstance(v, (tuple, list)) else (v,)
        if any(isinstance(x, (ClosedJaxpr, Jaxpr)) for x in vs):
            return True
    return False


def _retraced_thunk(walk: Walk, thunk, seen: Callable | None):
    """The lazy rule ``thunk`` with the jaxpr it returns retraced by ``walk``; ``seen``, if given,
    is called with the rule's own jaxpr (a ClosedJaxpr) each time JAX asks for it."""

    @functools.cache
    def retraced(*args):
        jaxpr, consts, *rest = thunk.call_wrapped(*args)
        original = ClosedJaxpr(jaxpr, consts)
        new = retrace(walk, original)
        return original, (new.jaxpr, new.consts, *rest)

    def rule(*args):
        original, out = retraced(*args)
        if seen is not None:
            seen(original)
        return out

    return wrap_init(rule, thunk)


def rebuild(walk: Walk, eqn, invals) -> list:
    """Re-emit the higher-order ``eqn`` on ``invals`` with every sub-jaxpr walked by ``walk``.

    Sub-jaxprs keep their signatures, so this suits transformations that keep value types (amp);
    scalify's control rules change them (ScaledArray carriers) and re-emit through ``lax``.
    """
    spec = HIGHER_ORDER[eqn.primitive]
    if spec.emit is not None:
        (body,) = jaxprs(eqn)
        return spec.emit(options(eqn), interpreted(walk, body), invals)
    walked = lambda j: type(j)(retrace(walk, c) for c in j) if isinstance(j, (tuple, list)) else retrace(walk, j)
    new = [walked(j) for j in jaxprs(eqn)]
    params = with_jaxprs(eqn, new)
    if spec.derivative:
        seen = None
        if spec.backward is not None:
            params[spec.backward], seen = walk.backward(eqn, params[spec.backward])
        params[spec.derivative[0]] = _retraced_thunk(walk, params[spec.derivative[0]], seen)
    return bind_params(eqn.primitive, invals, params)
