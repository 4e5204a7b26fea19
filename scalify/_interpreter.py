"""The scalify interpreter: trace to a jaxpr on logical avals, walk it with the rule table.

The walk itself (literals, source info, errors, sub-jaxprs) is :mod:`scalify._walk`'s; this module
is scalify's :class:`~scalify._walk.Walk`: which equations need a rule (a scaled operand, or a
primitive that creates ScaledArrays), carriers in, sealed scales out, fills and bounds noted.
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify import _walk
from scalify._config import get_config
from scalify._in_place import holds_graph_nodes, lift_in_place
from scalify._jax_compat import Literal, bind_eqn, bind_params, is_tracer, logical_aval, lower_hijax, p
from scalify._registry import RULES, ScalifyUnsupportedError, rule_for
from scalify._rules_common import (
    bound_of,
    decoded,
    fill_scope,
    finish_output,
    is_float,
    isolate_scale,
    note_bound,
    note_fill,
    runtime_fill,
    settle_output,
    static_operand,
    static_scalar,
)
from scalify._scaled_array import ScaledArray, is_scaled_leaf, split_leaves, split_outputs

_ALWAYS_CACHE: dict[int, tuple[object, bool]] = {}


def _contains_always(jaxpr) -> bool:
    """Whether ``jaxpr`` (or a nested jaxpr) uses a primitive that creates ScaledArrays."""
    key = id(jaxpr)
    hit = _ALWAYS_CACHE.get(key)
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    found = any(
        (RULES.get(e.primitive) is not None and RULES[e.primitive].always)
        or any(_contains_always(j) for j in _walk.sub_jaxprs(e))
        for e in inner.eqns
    )
    if len(_ALWAYS_CACHE) > 4096:
        _ALWAYS_CACHE.clear()
    _ALWAYS_CACHE[key] = (jaxpr, found)
    return found


def describe(x) -> str:
    """An operand as error messages show it: ScaledArray with its format, or a plain array."""
    if isinstance(x, ScaledArray):
        fmt = x.fmt.name if x.fmt is not None else "carrier (data + float32 scale)"
        return f"ScaledArray[{x.dtype}{list(x.shape)}, format {fmt}]"
    kind = "ref" if isinstance(jax.typeof(x), jax.ref.AbstractRef) else "plain"
    return f"{kind} {jnp.result_type(x)}{list(jnp.shape(x))}"


def unsupported(eqn, invals):
    """The error for a scaled operand reaching a primitive without a rule."""
    operands = ", ".join(describe(x) for x in invals)
    return ScalifyUnsupportedError(
        f"scalify has no rule for primitive `{eqn.primitive.name}`, which received a scaled operand "
        f"(operands: {operands}). Dequantize explicitly before this operation with "
        f"`scalify.ops.dequantize(x)` inside the function (or `x.to_array()` outside it), or register "
        f"a rule with `scalify.register_rule({eqn.primitive.name}_p, ...)`. See docs/operators.md "
        f"for the supported primitives."
    )


def _needs_rule(eqn, invals) -> bool:
    if any(isinstance(x, ScaledArray) for x in invals):
        return True
    rule = RULES.get(eqn.primitive)
    if rule is not None and rule.always:
        return True
    if rule is not None and rule.control:
        return any(_contains_always(j) for j in _walk.sub_jaxprs(eqn))
    return False


def _first_format(invals):
    for x in invals:
        if isinstance(x, ScaledArray) and x.fmt is not None:
            return x.fmt
    return None


def _maybe_keep_format(rule, invals, outs):
    fmt = _first_format(invals)
    if fmt is None or not rule.keeps_format:
        return outs
    res = []
    for o in outs:
        if isinstance(o, ScaledArray) and o.fmt is None and jnp.issubdtype(o.dtype, jnp.floating):
            try:
                fmt.block_shape(o.shape)
            except (ValueError, IndexError):
                res.append(o)
                continue
            data, scale = fmt.quantize(o.to_array(jnp.float32))
            res.append(ScaledArray(data, scale, fmt=fmt, dtype=o.dtype))
        else:
            res.append(o)
    return res


def _carry_bound(args, outs):
    """A commuting rule with one scaled operand (and no other float operand) moves, negates or
    takes the absolute value of its data, or shifts it right: the data bound carries over."""
    scaled = [a for a in args if isinstance(a, ScaledArray)]
    if len(scaled) != 1 or any(not isinstance(a, ScaledArray) and is_float(a) for a in args):
        return
    hi = bound_of(scaled[0])
    if hi is None:
        return
    for o in outs:
        if isinstance(o, ScaledArray) and bound_of(o) is None:
            note_bound(o, hi)


def _seal(x, sealed: dict):
    """``isolate_scale(x)``, skipped for a scale an earlier rule already sealed and passed through
    unchanged (reshape, transpose, neg, ...): fewer equations to trace and lower."""
    if not isinstance(x, ScaledArray) or id(x.scale) in sealed:
        return x
    x = isolate_scale(x)
    sealed[id(x.scale)] = x.scale  # the reference keeps the id from being reused
    return x


# A fill stays a fill through these (one operand; the value only changes dtype).
_FILL_PRESERVING = (p.broadcast_in_dim_p, p.convert_element_type_p, p.reshape_p, p.squeeze_p)

# Elementwise primitives: on static scalars and fills the result is a fill of the scalar result
# (the ``1/N`` of a mean's cotangent, ``1 - beta`` of an optimizer), computed at trace time.
_ELEMENTWISE = frozenset(
    getattr(p, n)
    for n in (
        "add_p sub_p mul_p div_p neg_p abs_p max_p min_p exp_p log_p sqrt_p rsqrt_p integer_pow_p "
        "square_p pow_p sign_p tanh_p logistic_p expm1_p log1p_p"
    ).split()
    if hasattr(p, n)
)


def _note_fill(eqn, invals, outs):
    """Record outputs that hold one scalar everywhere, so that rules treat them like the scalar.

    * a broadcast (or cast, or reshape) of a static scalar, such as the zeros of a relu or ``where``
      cotangent: a zero adopts the other operands' scale, a power of two only touches the scale;
    * an elementwise op on static scalars and fills: folded at trace time (``1/N`` of a mean);
    * a broadcast of a runtime 0-d float (a learning rate): its power of two goes to the scale.
    """
    if len(outs) != 1 or not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return
    dtype = eqn.outvars[0].aval.dtype
    if eqn.primitive in _FILL_PRESERVING and len(invals) == 1:
        (x,) = invals
        value = static_scalar(x)
        if value is not None:
            note_fill(outs[0], float(np.asarray(value, dtype)))
        elif (rv := runtime_fill(x)) is not None:
            note_fill(outs[0], lax.convert_element_type(rv, dtype))
        elif eqn.primitive is p.broadcast_in_dim_p and is_tracer(x) and jnp.ndim(x) == 0 and eqn.params["shape"]:
            if jnp.issubdtype(x.dtype, jnp.floating):
                note_fill(outs[0], x)
        return
    if eqn.primitive in _ELEMENTWISE:
        values = [static_operand(x) for x in invals]
        if invals and all(v is not None for v in values):
            with jax.ensure_compile_time_eval():
                (out,) = bind_eqn(eqn, [jnp.asarray(v) for v in values])
            note_fill(outs[0], float(np.asarray(out, dtype)))


def _abstract(x):
    if isinstance(x, ScaledArray):
        return logical_aval(x.shape, x.dtype, jax.tree.leaves((x.data, x.scale)))
    return x


def trace_logical(fn, args):
    """The ClosedJaxpr of ``fn`` traced on ``args`` as the program sees them (a ScaledArray as the
    logical array it stands for), to be walked with the rules on ``args`` themselves."""
    return jax.make_jaxpr(fn)(*[_abstract(x) for x in args])


# The equations whose implementation is being walked (see ``_Scalify.through_impl``), and how
# deep such expansions may nest (a safety net: a library's solver calls itself a few levels deep).
_EXPANDING: contextvars.ContextVar[frozenset] = contextvars.ContextVar("scalify_expanding", default=frozenset())
_MAX_EXPANSION_DEPTH = 16


def _expansion_key(eqn) -> tuple:
    """A primitive with the identity of its parameters: an implementation that binds its own
    primitive again (JAX's ``apply_primitive``) passes the same parameter objects on, while a
    library's primitive calling itself for another job (lineax's GMRES solving its Hessenberg
    least-squares problem by ``linear_solve`` with a QR solver) passes other ones."""
    return eqn.primitive, tuple(sorted((k, id(v)) for k, v in eqn.params.items()))


class _Scalify(_walk.Walk):
    """scalify's walk: one evaluation of a (sub-)jaxpr, with the scales it has sealed."""

    def __init__(self, args=()):
        self.keep = get_config().keep_format
        # An input scale is a runtime value with no static factor folded in: nothing to seal.
        self.sealed = {id(a.scale): a.scale for a in args if isinstance(a, ScaledArray)}

    def eval(self, jaxpr, consts, args):
        """A fresh evaluation (its own sealed scales) with the fills of ``args`` known."""
        with fill_scope(args):
            outs = _walk.eval_jaxpr(_Scalify(args), jaxpr, consts, args)
            known = [(o, bound_of(o)) for o in outs if isinstance(o, ScaledArray)]
        # The outputs' data bounds stay known to the caller (a loop body's outputs, a branch's).
        for o, hi in known:
            if hi is not None:
                note_bound(o, hi)
        return outs

    def apply(self, eqn, invals):
        """The rule of ``eqn`` when it needs one (scaled operands, ``always``), else bind it."""
        if not _needs_rule(eqn, invals):
            outs = bind_params(eqn.primitive, invals, eqn.params)  # the walker entered eqn.ctx
            _note_fill(eqn, invals, outs)
            return outs
        rule = rule_for(eqn.primitive)
        if rule is None:
            outs = self.through_impl(eqn, invals)
            if outs is None:
                raise unsupported(eqn, invals)
            return outs
        args = invals if rule.raw else [decoded(x) if isinstance(x, ScaledArray) else x for x in invals]
        outs = rule.fn(eqn, *args)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        if rule.carries_bound:
            _carry_bound(args, outs)
        if not rule.control:
            # A control-flow rule's outputs come from an interpreted body that sealed them.
            outs = [_seal(o, self.sealed) for o in outs]
        if self.keep:
            outs = _maybe_keep_format(rule, invals, list(outs))
        return outs

    def through_impl(self, eqn, invals):
        """The outputs of a primitive without a rule whose implementation is JAX code (a library's
        own primitive, such as the ``maybe_set`` of equinox's loops in diffrax's solvers): the
        jaxpr of ``primitive.impl`` is walked with the rules, as the primitive's own definition of
        what it computes. None when the implementation is no such code (JAX's primitives bind
        themselves; an implementation may also fail to trace)."""
        prim = eqn.primitive
        expanding, key = _EXPANDING.get(), _expansion_key(eqn)
        if key in expanding or len(expanding) >= _MAX_EXPANSION_DEPTH:
            return None  # the implementation binds the primitive itself (directly or in a nested jit)
        try:
            closed = trace_logical(lambda *a: prim.impl(*a, **eqn.params), invals)
        except Exception:  # any failure means: no implementation to walk
            return None
        token = _EXPANDING.set(expanding | {key})
        try:
            outs = self.eval(closed.jaxpr, closed.consts, list(invals))
        finally:
            _EXPANDING.reset(token)
        return outs if prim.multiple_results else outs[:1]

    def describe(self, x) -> str:
        return describe(x)


#: The walk that scalify's control rules evaluate sub-jaxprs with (each evaluation starts afresh).
WALK = _Scalify()


class _Program(_Scalify):
    """The walk of the program's own jaxpr: a value it returns is settled where an equation
    produces it (:func:`~scalify._rules_common.settle_output`), so the equations after it read
    the settled value; a returned input or constant is settled at the exit."""

    def __init__(self, args, outvars):
        super().__init__(args)
        self.exits = {v for v in outvars if not isinstance(v, Literal)}

    def apply(self, eqn, invals):
        outs = super().apply(eqn, invals)
        return [settle_output(o) if v in self.exits else o for v, o in zip(eqn.outvars, outs, strict=True)]

    def run(self, closed, args) -> list:
        with fill_scope(args):
            outs = _walk.eval_jaxpr(self, closed.jaxpr, closed.consts, args)
        unproduced = {*closed.jaxpr.invars, *closed.jaxpr.constvars}
        return [
            # A returned constant (or a static argument returned as it is) comes back as an array,
            # as jax.jit returns it, not as JAX's internal literal type.
            jnp.asarray(o) if isinstance(v, Literal) else finish_output(settle_output(o) if v in unproduced else o)
            for v, o in zip(closed.jaxpr.outvars, outs, strict=True)
        ]


def eval_jaxpr(jaxpr, consts, *args):
    """Evaluate an open ``jaxpr`` on ScaledArrays and plain values with the rule table."""
    return WALK.eval(jaxpr, consts, list(args))


def eval_closed(closed, *args):
    """Evaluate a ClosedJaxpr on ScaledArrays and plain values with the rule table."""
    return WALK.eval(closed.jaxpr, closed.consts, list(args))


def scalify(fun, *, dequantize_outputs: bool = False):
    """Transform ``fun`` so that it propagates scales through ScaledArray inputs.

    ``fun`` is traced on the logical shapes and dtypes of its array inputs (ScaledArrays are seen as
    plain arrays; every other argument is passed as it is, so ``jax.jit(scalify(f),
    static_argnums=...)`` works as it does for ``f``), then its jaxpr is evaluated with scaling
    rules. Equations without scaled operands are bound unchanged. Plain inputs only:
    ``scalify(fun)`` calls ``fun`` directly. flax NNX modules, optimizers and metrics among the
    arguments may be updated in place, as under ``nnx.jit`` (:mod:`scalify._in_place`).

    Outputs are ScaledArrays where the program's values are scaled. With ``dequantize_outputs=True``
    every floating array ``fun`` returns goes through :func:`scalify.ops.dequantize` inside the
    program: a plain array of its logical dtype holding ``data * scale`` (exact for a float32
    carrier; a float16 or bfloat16 carrier whose value is out of its dtype's range overflows there,
    as ``to_array`` does). It is for outputs that go into a container which accepts only
    ``jax.Array`` fields (a jaxtyping-annotated ``flax.struct`` dataclass, such as a sampler's
    decoding state): the weights stay scaled inside ``fun``, what it returns is plain. NNX modules
    updated in place keep their parameters scaled (only what ``fun`` returns is dequantized).
    """
    if dequantize_outputs:
        fun = _dequantizing(fun)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        if holds_graph_nodes((args, kwargs)):
            return lift_in_place(scalify, fun, args, kwargs)
        leaves, rebuild = split_leaves((args, kwargs), is_leaf=is_scaled_leaf)

        def flat_fun(*flat):
            a, k = rebuild(flat)
            return fun(*a, **k)

        traced, rebuild_out = split_outputs(flat_fun)
        if not any(isinstance(x, ScaledArray) for x in leaves):
            # Plain inputs: behave like `fun`, unless it creates ScaledArrays (scalify.ops.quantize).
            closed = lower_hijax(jax.make_jaxpr(traced)(*leaves))
            if not _contains_always(closed):
                # As the traced program would (and jax-scalify does): NumPy inputs are computed by JAX.
                a, k = jax.tree.map(lambda v: jnp.asarray(v) if isinstance(v, np.ndarray) else v, (args, kwargs))
                return fun(*a, **k)
        else:
            closed = lower_hijax(trace_logical(traced, leaves))
        outs = _Program(leaves, closed.jaxpr.outvars).run(closed, leaves)
        return _rebuild_outputs(rebuild_out, outs, fun)

    return wrapped


def _dequantizing(fun):
    """``fun`` with each floating array it returns passed through ``scalify.ops.dequantize`` (under
    scalify: the plain value ``data * scale``; elsewhere: the array itself)."""
    from scalify.ops import dequantize

    def plain(v):
        return dequantize(v) if is_tracer(v) and jnp.issubdtype(v.dtype, jnp.inexact) else v

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        return jax.tree.map(plain, fun(*args, **kwargs))

    return wrapped


def _rebuild_outputs(rebuild_out, outs, fun):
    """``fun``'s output structure around ``outs``; a container that refuses a ScaledArray field (it
    checks that its fields are ``jax.Array``s when it is rebuilt) gets an error naming the way out."""
    try:
        return rebuild_out(outs)
    except Exception as exc:
        if not any(isinstance(x, ScaledArray) for x in outs):
            raise
        name = getattr(fun, "__qualname__", repr(fun))
        raise TypeError(
            f"scalify({name}): its output could not be rebuilt with ScaledArray leaves ({type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0][:200]}). A container in the output checks that its fields are "
            "jax.Arrays (a jaxtyping-annotated flax.struct dataclass, for example), and a scaled value is not one. "
            "Use scalify.scalify(fn, dequantize_outputs=True) to return plain arrays of the logical dtype "
            "(the values data * scale), or return the values outside that container."
        ) from exc
