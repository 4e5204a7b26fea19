"""The amp interpreter: walk a jaxpr, recasting each equation's inputs according to a policy.

Values flow between equations in whatever dtype the last operation produced (so a chain of
low-precision matmuls does not round-trip through float32); an equation without a policy entry gets
its floating inputs cast back to the dtypes of the traced program. amp is a rule table over
:mod:`scalify._walk`: sub-jaxprs (jit, scan, while, cond, checkpoint, custom_jvp / custom_vjp,
shard_map, ...) are rebuilt by the walker around bodies walked under the same policy, so shardings,
donation, names and custom derivative rules are kept. At every sub-jaxpr boundary and at the
output, values are cast back to their original dtypes, so the signature of every (sub-)program is
unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalify import _jax_compat as jc
from scalify import _walk
from scalify._in_place import holds_graph_nodes, lift_in_place
from scalify._scaled_array import split_leaves, split_outputs
from scalify.amp import _sources, _transposes
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
        # Operands' sources are tracked for rules that read them (the recipes'), not for dtype policies.
        self.tracks_sources = any(isinstance(rule, BindRule) for rule in policy.values())
        # the backward contractions' forward partners in the traced program (rules that read sources)
        self.transposes = None

    def for_one_call(self, closed=None) -> _Context:
        """A context for one call of the amp'ed function, whose traced program is ``closed``."""
        out = _Context(self.compute_dtype, self.policy)
        out.transposes = _transposes.Transposes(closed) if closed is not None and self.tracks_sources else None
        return out

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


def _cast_to_avals(values, avals):
    return [cast_if_float(a.dtype, x) if hasattr(a, "dtype") else x for x, a in zip(values, avals, strict=True)]


class _Amp(_walk.Walk):
    """amp's walk under the named ``scopes`` around the walked jaxpr (outermost first).

    ``sources``: ``{sub-jaxpr: the sources of its invars}`` (:mod:`scalify.amp._sources`) for the
    sub-jaxprs of one equation; ``None`` for the walked function itself. ``rule_of``: that
    equation's primitive when it is a ``custom_jvp_call`` or ``custom_vjp_call``, whose derivative
    rule's jaxpr this walk also evaluates (see :meth:`_inputs`).
    """

    def __init__(self, ctx: _Context, scopes: tuple[str, ...] = (), sources: dict | None = None, rule_of=None):
        self.ctx = ctx
        self.scopes = scopes
        self.sources = sources
        self.rule_of = rule_of
        self.cache = ctx.retraced
        self.key = (scopes, None if sources is None else tuple(sources.values()))
        self._env = None

    def _inputs(self, jaxpr) -> tuple | None:
        """The sources of ``jaxpr``'s invars. A custom derivative rule's jaxpr (not among the
        equation's sub-jaxprs: JAX traces it lazily) takes the primals first, in the call's order,
        with their sources; a JVP rule then takes the tangents of the non-zero primals."""
        if self.sources is None:
            return None
        known = self.sources.get(jaxpr)
        if known is not None:
            return known
        if self.rule_of in (jc.custom_jvp_call_p, jc.custom_vjp_call_p):
            (primals,) = self.sources.values()
            extra = len(jaxpr.invars) - len(primals)
            if extra == 0 or (extra > 0 and self.rule_of is jc.custom_jvp_call_p):
                return (*primals, *(_sources.TANGENT,) * extra)
            if extra < 0 and self.rule_of is jc.custom_vjp_call_p:  # without the closed-over values
                return primals[-extra:]
        return (_sources.MANY,) * len(jaxpr.invars)

    def eval(self, jaxpr, consts, args) -> list:
        if not self.ctx.tracks_sources:
            return super().eval(jaxpr, consts, args)
        inputs = self._inputs(jaxpr)
        outer, self._env = self._env, _sources.Sources(jaxpr, inputs)
        try:
            return super().eval(jaxpr, consts, args)
        finally:
            self._env = outer

    def apply(self, eqn, invals):
        if self._env is None:
            return self._apply(eqn, invals, None)
        sources = self._env.of(eqn)
        outs = self._apply(eqn, invals, sources)
        self._env.record(eqn, sources)
        return outs

    def backward(self, eqn, rule) -> tuple:
        """A ``custom_vjp``'s backward rule, walked under this walk's policy when JAX calls it.

        Under a recipe (a policy that reads sources) the rule's contractions run under the recipe
        as those of the walked program do: the contractions JAX's transposition emitted inside it
        (a rule that calls ``jax.vjp``, as equinox's checkpointed loops do) as the backward GEMMs
        of their forward partners, the others as forward GEMMs. Its residuals keep the sources the
        forward rule gave them, recorded when JAX asks for that rule and looked up by the
        residuals' shapes (one rebuilt equation can serve several calls: a cached jit body); its
        cotangents mix the batch and the parameters. amp's own policies keep the rule as the
        program wrote it (a backward rule states its own numerics).
        """
        if not self.ctx.tracks_sources or self.sources is None:
            return rule, None
        by_shapes: dict = {}  # the residuals' shapes -> their sources (None: calls disagreed)

        def seen(fwd):
            shapes, sources = self._residuals(eqn, fwd)
            if by_shapes.setdefault(shapes, sources) != sources:
                by_shapes[shapes] = None

        def walked(*args):
            closed, kept, put_back = jc.custom_vjp_bwd_jaxpr(rule, args)
            n_res = len(args) - len(eqn.outvars)
            residuals = by_shapes.get(tuple(np.shape(a) for a in args[:n_res])) or (_sources.MANY,) * n_res
            sources = (*residuals, *(_sources.MANY,) * len(eqn.outvars))
            inputs = _sources.canonical(s for s, k in zip(sources, kept, strict=True) if k)
            walk = _Amp(self.ctx.for_one_call(closed), self.scopes, {closed.jaxpr: inputs})
            arrays = [a for a, k in zip(args, kept, strict=True) if k]
            return put_back(_walk.eval_closed(walk, closed, arrays))

        return jc.wrap_init(walked, rule), seen

    def _residuals(self, eqn, fwd) -> tuple:
        """The shapes and sources of the residuals the forward rule ``fwd`` hands the backward
        rule, as JAX has just asked for ``fwd``: computed ones from its outputs, forwarded ones
        from the call's operands (``input_fwds`` counts them all, closed-over values first)."""
        *_, out_trees = _walk.derivative_rule(eqn)
        _, _, input_fwds = out_trees()
        (operands,) = self.sources.values()
        computed = zip(fwd.out_avals, _sources.results(fwd.jaxpr, self._inputs(fwd.jaxpr)), strict=True)
        out = [next(computed) if f is None else (eqn.invars[f].aval, operands[f]) for f in input_fwds]
        return tuple(tuple(a.shape) for a, _ in out), tuple(s for _, s in out)

    def _sub_sources(self, eqn, sources) -> dict | None:
        """The sources of each sub-jaxpr's invars, from those of ``eqn``'s operands."""
        if sources is None:
            return None
        out = {}
        for j, operands in zip(_walk.sub_jaxprs(eqn), _walk.sub_jaxpr_operands(eqn), strict=True):
            jaxpr = j.jaxpr if isinstance(j, jc.ClosedJaxpr) else j
            out[jaxpr] = _sources.canonical(_sources.MANY if i is None else sources[i] for i in operands)
        return out

    def _apply(self, eqn, invals, sources):
        """Higher-order primitives are rebuilt around walked bodies; others follow the policy."""
        scopes = (*self.scopes, *jc.scope_names(eqn.source_info.name_stack))
        prim = eqn.primitive
        if _walk.has_sub_jaxprs(eqn):
            # A sub-jaxpr keeps its signature: its operands get the traced program's dtypes back.
            invals = _cast_to_avals(invals, [v.aval for v in eqn.invars])
            if jc.calls_random_sampler(eqn):
                # A sampler's arithmetic is its contract: jax.random.uniform's u * (max - min) + min
                # stays below max in float32 only (in float16 it reaches max 1 time in 4096, and
                # normal's erfinv(1) is inf). It runs as the program wrote it, under any policy.
                return jc.bind_params(prim, invals, eqn.params)
            if prim in _walk.HIGHER_ORDER:
                walk = _Amp(self.ctx, scopes, self._sub_sources(eqn, sources), rule_of=prim)
                return _walk.rebuild(walk, eqn, invals)
            return jc.bind_params(prim, invals, eqn.params)  # one the walker does not describe
        rule = self.ctx.lookup(scopes, prim)
        subfuns, params = jc.get_bind_params(prim, eqn.params)
        if isinstance(rule, BindRule) and sources is not None and _sources.TANGENT in sources:
            # A contraction on a tangent inside a custom JVP rule: JAX transposes this part of the
            # rule for reverse mode, and a rule's replacement (a recipe's custom-VJP GEMM) has no
            # transpose. It stays as the rule wrote it; the rule's primal part follows the policy.
            invals = _cast_to_avals(invals, [v.aval for v in eqn.invars])
            return jc.bind_params(prim, invals, eqn.params)
        if isinstance(rule, BindRule):
            invals = _cast_to_avals(invals, [v.aval for v in eqn.invars])
            counts = () if sources is None else tuple(_sources.count(s) for s in sources)
            site = None if self.ctx.transposes is None else _transposes.Site(self.ctx.transposes, eqn)
            return rule.bind(prim, invals, params, [v.aval for v in eqn.outvars], scopes, counts, site)
        orig_dtypes = [getattr(v.aval, "dtype", None) for v in eqn.invars]
        if isinstance(rule, QuantizeInputs):
            invals, params = rule.apply(prim, self.ctx.compute_dtype, orig_dtypes, invals, params)
        else:
            invals, params = rule(self.ctx.compute_dtype, orig_dtypes, *invals, **params)
        outs = prim.bind(*subfuns, *invals, **params)
        return outs if prim.multiple_results else [outs]

    def outputs(self, jaxpr, outs):
        """Outputs in the jaxpr's own dtypes: every (sub-)program keeps its signature."""
        return _cast_to_avals(outs, [v.aval for v in jaxpr.outvars])


def eval_jaxpr(ctx: _Context, closed, args, scopes: tuple[str, ...] = ()) -> list:
    """Evaluate ``closed`` on ``args`` under the amp policy; outputs have the jaxpr's dtypes."""
    return _walk.eval_closed(_Amp(ctx, scopes), closed, args)


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------


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
        if holds_graph_nodes((args, kwargs)):
            return lift_in_place(lambda f: amp(f, compute_dtype=compute_dtype, amp_policy=amp_policy), fn, args, kwargs)
        # No is_leaf: a ScaledArray argument is traced as its data and scale arrays.
        dyn, rebuild = split_leaves((args, kwargs))

        def flat_fn(*flat):
            a, k = rebuild(flat)
            return fn(*a, **k)

        traced, rebuild_out = split_outputs(flat_fn)
        scopes = tuple(jc.scope_names(jc.current_name_stack()))
        with jc.fresh_name_stack():
            closed = jc.lower_hijax(jax.make_jaxpr(traced)(*dyn))
        outs = eval_jaxpr(ctx.for_one_call(closed), closed, dyn, scopes)
        # A returned constant (a BatchNorm's `state.set(index, jnp.array(False))`) comes back as an
        # array, as jax.jit returns it: as a Python bool it was static under eqx.filter_jit, and the
        # next step compiled again.
        outvars = closed.jaxpr.outvars
        outs = [jnp.asarray(o) if isinstance(v, jc.Literal) else o for v, o in zip(outvars, outs, strict=True)]
        return rebuild_out(outs)

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
