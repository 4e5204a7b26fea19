"""Which inputs of the walked function each value is computed from: a weight or an activation.

A contraction's operands do not say which is the layer's weight: ``jnp.einsum`` orders them as it
finds cheapest (``einsum("th,ehm->etm", x, w)`` binds ``dot_general(w, x)``). Their sources do. A
weight is computed from one input of the function alone (a parameter, reshaped, cast, sliced from
a stack of layers); an activation mixes several (the batch and the parameters before it).

Each value's source is ``None`` (constants and literals only), one input's id, or :data:`MANY`.
An equation's outputs take the join of its operands' sources, leaving out integer and boolean
scalars (loop counters, indices, predicates), and a loop carry is :data:`MANY` (it changes with
the iterations). Sub-jaxprs receive their operands' sources renumbered in order of appearance, so
one jnp helper called on differently-sourced but alike-patterned operands is walked once.

Where the walked function takes a gradient inside, the values its backward pass computes (those
JAX's transposition emitted) have no source where the forward program reads them: a step that
differentiates again at ``w + rho * g`` (a sharpness-aware step, a sampler's next position) sees
that point's weights come from ``w`` alone, as the loss differentiated outside would. Inside the
backward pass (a ``custom_vjp``'s own backward rule contracting its residuals) they keep theirs.

A custom derivative rule's jaxpr (``custom_vjp``'s forward, ``custom_jvp``'s JVP) takes the
primal operands first: they keep their sources. The JVP rule's tangent inputs are
:data:`TANGENT`, and so is everything computed from one: JAX transposes that part of the rule for
reverse mode, so it must stay linear (see ``scalify.amp._interpreter``). A ``custom_vjp``'s
backward rule, which JAX calls after the walk, takes the residuals with the sources the forward
rule gave them and the cotangents as :data:`MANY` (each mixes the batch and the parameters).
"""

from __future__ import annotations

import jax.numpy as jnp

from scalify import _jax_compat as jc

MANY = "many"
TANGENT = "tangent"


def join(sources):
    """The source of a value computed from values of ``sources``: :data:`TANGENT` if one is a
    tangent, else ``None`` if none has one, the input they share if one, else :data:`MANY`."""
    out = None
    for s in sources:
        if s is None:
            continue
        if s == TANGENT:
            return TANGENT
        if s == MANY or (out is not None and s != out):
            out = MANY
        else:
            out = s
    return out


def canonical(sources) -> tuple:
    """``sources`` with the inputs' ids renumbered 0, 1, ... in order of first appearance."""
    ids: dict = {}
    return tuple(s if s is None or s in (MANY, TANGENT) else ids.setdefault(s, len(ids)) for s in sources)


def count(source) -> int:
    """How many of the function's inputs a value is computed from: 0, 1, or 2 for two or more."""
    return 0 if source is None else 2 if source == MANY else 1


def _counts(var) -> bool:
    """Whether ``var``'s source counts in a join: not a literal, not an integer or boolean scalar."""
    if isinstance(var, jc.Literal):
        return False
    aval = var.aval
    return not (getattr(aval, "shape", None) == () and not jnp.issubdtype(aval.dtype, jnp.inexact))


def _in_backward_pass(eqn) -> bool:
    """Whether JAX's transposition emitted ``eqn`` (a value of a gradient, not a forward value
    ``jax.checkpoint`` recomputes there)."""
    stack = eqn.source_info.name_stack
    return jc.in_transpose(stack) and not jc.in_recomputation(stack)


class Sources:
    """The sources of one evaluation of a jaxpr's variables.

    ``inputs``: the sources of the jaxpr's invars (as :func:`canonical` gives them), or ``None``
    at the top level, where each invar is an input of its own. Constvars are inputs of their own.
    Unknown variables read as :data:`MANY`, which leaves a contraction in its bound order.
    """

    def __init__(self, jaxpr, inputs: tuple | None):
        if inputs is None:
            inputs = tuple(range(len(jaxpr.invars)))
        elif len(inputs) != len(jaxpr.invars):  # a layout the walker does not describe: assume mixed
            inputs = (MANY,) * len(jaxpr.invars)
        self.env = dict(zip(jaxpr.invars, inputs, strict=True))
        self.env.update({v: ("const", i) for i, v in enumerate(jaxpr.constvars)})
        self.gradients: set = set()  # values the backward pass of a gradient taken inside computed

    def read(self, var):
        return None if isinstance(var, jc.Literal) else self.env.get(var, MANY)

    def of(self, eqn) -> list:
        """The sources of ``eqn``'s operands. Outside the backward pass of a gradient taken inside,
        a value that backward pass computed has none: a weight moved along its gradient comes from
        that weight alone, as the loss differentiated outside would see it."""
        if _in_backward_pass(eqn):
            return [self.read(v) for v in eqn.invars]
        return [None if self._is_gradient(v) else self.read(v) for v in eqn.invars]

    def _is_gradient(self, var) -> bool:
        return not isinstance(var, jc.Literal) and var in self.gradients

    def record(self, eqn, sources) -> None:
        """Each output of ``eqn`` takes the join of its counted operands' sources."""
        out = join(s for s, v in zip(sources, eqn.invars, strict=True) if _counts(v))
        self.env.update({v: out for v in eqn.outvars})
        if _in_backward_pass(eqn):
            self.gradients.update(eqn.outvars)


def results(jaxpr, inputs: tuple) -> list:
    """The sources of ``jaxpr``'s outvars when its invars have ``inputs``, without evaluating it
    (a custom VJP's residuals, which its backward rule receives after the walk)."""
    env = Sources(jaxpr, inputs)
    for eqn in jaxpr.eqns:
        env.record(eqn, env.of(eqn))
    return [env.read(v) for v in jaxpr.outvars]
