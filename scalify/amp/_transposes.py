"""Which forward contraction each contraction of a gradient's backward pass transposes.

A training step that takes its gradient inside (``jax.value_and_grad(loss)`` within the step, as
flax's, equinox's and Keras's steps do) reaches the walker differentiated: the backward GEMMs are
contractions of their own, emitted by JAX's transpose rules. For ``y = dot_general(a, b)`` and
the cotangent ``g`` of ``y`` those rules bind

    d/da: dot_general(g, b)   (b contracted over its free axes)
    d/db: dot_general(g, a)   (a contracted over its free axes)

and for ``conv_general_dilated(a, b)``: ``conv(g, rev(b))`` and ``conv(a, g)``. A contraction
whose name stack says the transposition emitted it, and one of whose operands is a value the
forward contraction read (the residual ``a`` or ``b``, forwarded through jit, scan and cond
boundaries by position), with the other shaped as that contraction's output, transposes it.

:class:`Transposes` finds these pairs once per call, before the walk; the walker then records, at
each forward contraction, what the recipe made of it (:meth:`Transposes.decide`), and a backward
contraction reads its partner's decision (:meth:`Transposes.partner_of`).
"""

from __future__ import annotations

from typing import NamedTuple

from jax import lax

from scalify import _jax_compat as jc
from scalify import _walk

CONTRACTIONS = (lax.dot_general_p, lax.conv_general_dilated_p)


class Partner(NamedTuple):
    """A backward contraction's forward one.

    ``forward``: the forward equation; ``residual``: which operand of the backward contraction is
    the forward's (0 lhs, 1 rhs); ``grad_of``: the forward operand whose gradient it computes (0 for
    ``a``, the lhs; 1 for ``b``).
    """

    forward: object
    residual: int
    grad_of: int


def _free_axes(eqn, side: int) -> set[int]:
    """The axes of ``dot_general`` operand ``side`` that are neither contracted nor batch."""
    (contract, batch) = eqn.params["dimension_numbers"]
    ndim = len(eqn.invars[side].aval.shape)
    return set(range(ndim)) - set(contract[side]) - set(batch[side])


def _transposes(eqn, residual: int, forward, side: int) -> bool:
    """Whether ``eqn``, reading ``forward``'s operand ``side`` as its operand ``residual``, is the
    transpose rule's contraction for the gradient of ``forward``'s other operand."""
    if eqn.primitive is not forward.primitive:
        return False
    r, g = eqn.invars[residual], eqn.invars[1 - residual]
    if r.aval.shape != forward.invars[side].aval.shape or g.aval.shape != forward.outvars[0].aval.shape:
        return False
    if eqn.primitive is lax.dot_general_p:
        # JAX's rule: dot_general(g, residual), the residual contracted over its free axes.
        (contract, batch) = eqn.params["dimension_numbers"]
        (_, fbatch) = forward.params["dimension_numbers"]
        return residual == 1 and set(contract[1]) == _free_axes(forward, side) and set(batch[1]) == set(fbatch[side])
    # conv: conv(g, rev(b)) for the input gradient, conv(a, g) for the weight gradient.
    return residual == side


class Transposes:
    """The forward partner of each backward contraction in one closed jaxpr (nested ones included).

    Equations are told apart by identity (the walker walks these jaxpr objects), so the jaxpr must
    outlive the instance's use.
    """

    def __init__(self, closed):
        self._partner: dict[int, Partner] = {}
        self._decision: dict[int, object] = {}
        # ids of the contractions the transposition emitted: those without a partner are a user's
        # own backward rule, or a pairing this module misses
        self._transposed: set[int] = set()
        self._closed = closed  # keeps every equation, and so every id, alive
        self._scan(closed.jaxpr, {}, False)

    @property
    def counts(self) -> tuple[int, int]:
        """``(paired, emitted)``: contractions JAX's transposition emitted that have a forward
        partner, and all it emitted."""
        return len(self._partner), len(self._transposed)

    def partner_of(self, eqn) -> Partner | None:
        return self._partner.get(id(eqn))

    def decide(self, eqn, decision) -> None:
        """Record what the recipe made of the forward contraction ``eqn``."""
        self._decision[id(eqn)] = decision

    def decision_of(self, eqn):
        """What the recipe made of the forward contraction ``eqn``; ``None`` when no rule bound it
        (a high-precision scope, ``amp_stop``)."""
        return self._decision.get(id(eqn))

    def _scan(self, jaxpr, tags: dict, transposed: bool) -> None:
        """Walk ``jaxpr``; ``tags``: ``{var: ((forward eqn, side), ...)}``, the forward operands each
        variable is, updated in place (so the caller reads the tags its sub-jaxpr's invars and
        outvars acquired)."""
        for eqn in jaxpr.eqns:
            inside = transposed or jc.in_transpose(eqn.source_info.name_stack)
            if eqn.primitive in CONTRACTIONS:
                if inside:
                    self._transposed.add(id(eqn))
                partner = self._match(eqn, tags) if inside else None
                if partner is not None:
                    self._partner[id(eqn)] = partner
                    continue
                for side, v in enumerate(eqn.invars):
                    _add(tags, v, ((eqn, side),))
            elif eqn.primitive is lax.rev_p:  # the input gradient of a convolution reverses its weight
                _add(tags, eqn.outvars[0], _read(tags, eqn.invars[0]))
            elif _walk.has_sub_jaxprs(eqn):
                self._into(eqn, tags, inside)

    def _into(self, eqn, tags: dict, transposed: bool) -> None:
        """Scan ``eqn``'s sub-jaxprs with its operands' tags, then carry back the tags their invars
        and outvars acquired to ``eqn``'s operands and outputs (a residual saved inside a forward
        jit or scan body, read by the backward one)."""
        for sub, operands, results in zip(
            _walk.sub_jaxprs(eqn), _walk.sub_jaxpr_operands(eqn), _walk.sub_jaxpr_results(eqn), strict=True
        ):
            j = sub.jaxpr if isinstance(sub, jc.ClosedJaxpr) else sub
            inner: dict = {}
            for v, i in zip(j.invars, operands, strict=True):
                if i is not None:
                    _add(inner, v, _read(tags, eqn.invars[i]))
            self._scan(j, inner, transposed)
            for v, i in zip(j.invars, operands, strict=True):
                if i is not None:
                    _add(tags, eqn.invars[i], _read(inner, v))
            for v, o in zip(j.outvars, results, strict=True):
                if o is not None:
                    _add(tags, eqn.outvars[o], _read(inner, v))

    @staticmethod
    def _match(eqn, tags) -> Partner | None:
        for residual in (1, 0):
            for forward, side in _read(tags, eqn.invars[residual]):
                if _transposes(eqn, residual, forward, side):
                    return Partner(forward, residual, 1 - side)
        return None


class Site(NamedTuple):
    """Where a rule's contraction sits in the walked program: what it is a transpose of, and where
    the rule records what it made of a forward contraction."""

    transposes: Transposes
    eqn: object

    def partner(self) -> Partner | None:
        return self.transposes.partner_of(self.eqn)

    def decide(self, decision) -> None:
        self.transposes.decide(self.eqn, decision)


def _read(tags: dict, v) -> tuple:
    return () if isinstance(v, jc.Literal) else tags.get(v, ())


def _add(tags: dict, v, new: tuple) -> None:
    if not new or isinstance(v, jc.Literal):
        return
    old = tags.get(v, ())
    # by identity: equations compare by their params otherwise
    tags[v] = old + tuple(t for t in new if not any(t[0] is o[0] and t[1] == o[1] for o in old))
