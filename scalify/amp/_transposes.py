"""Which forward contraction each contraction of a gradient's backward pass transposes.

A training step that takes its gradient inside (``jax.value_and_grad(loss)`` within the step, as
flax's, equinox's and Keras's steps do) reaches the walker differentiated: the backward GEMMs are
contractions of their own, emitted by JAX's transpose rules. For ``y = dot_general(a, b)`` and
the cotangent ``g`` of ``y`` those rules bind

    d/da: dot_general(g, b)   (g summed over b's free output axes, b over its free axes)
    d/db: dot_general(g, a)   (g summed over a's free output axes, a over its free axes)

for ``conv_general_dilated(a, b)``: ``conv(g, rev(b))`` and ``conv(a, g)``, and for a grouped GEMM
``ragged_dot_general(a, b, sizes)``: ``ragged_dot_general(g, b, sizes)`` and, summing over each
group's rows, ``ragged_dot_general(a, g, sizes)``. A contraction
whose name stack says the transposition emitted it, one of whose operands is a value the forward
contraction read (the residual ``a`` or ``b``, forwarded through jit, scan and cond boundaries by
position; reversed for a convolution's input gradient), with the other shaped as that forward's
output and the dimension numbers the rule gives, transposes it.

One operand can feed several forward contractions of one output shape (a gated MLP's gate and up
projections read the same activations): the candidates whose ``jax.named_scope`` path is the
backward contraction's are preferred, and where several remain they must agree on the backward
GEMM the recipe makes of them (one constant read by two contractions that order the other
operand's summed axes differently, as e3nn's tensor products read a Clebsch-Gordan tensor, has one
input gradient for both).

Under ``jax.checkpoint`` the backward pass recomputes the forward values it needs (JAX scopes
them ``rematted_computation``): those contractions are forward ones. A forward contraction whose
output the backward pass does not need (a layer's last projection, before a residual add) is not
recomputed, so the recomputed activation its weight gradient reads is read by no forward
contraction of that program; such a backward contraction is paired with the forward contractions
whose operand shapes and dimension numbers it transposes (named scopes preferred, outcomes
required to agree, as above).

The same pass records which forward contractions read each operand of each forward contraction:
a value an earlier contraction took as its activation is not a weight at a later one
(:meth:`Transposes.taken_as_activation`; a sampler's data, read at the first position's gradient
and again at a position computed from it).

:class:`Transposes` finds the candidates once per call, before the walk; the walker
records, at each forward contraction, what the recipe made of it (:meth:`Transposes.decide`), and
a backward contraction reads the outcome (:meth:`Transposes.resolve`).
"""

from __future__ import annotations

from typing import NamedTuple

from jax import lax

from scalify import _jax_compat as jc
from scalify import _walk

_RAGGED_DOT = jc.lax_primitive("ragged_dot_general")
CONTRACTIONS = tuple(p for p in (lax.dot_general_p, lax.conv_general_dilated_p, _RAGGED_DOT) if p is not None)


class Partner(NamedTuple):
    """A candidate forward contraction of a backward one.

    ``forward``: the forward equation; ``residual``: which operand of the backward contraction is
    the forward's (0 lhs, 1 rhs); ``grad_of``: the forward operand whose gradient it computes (0 for
    ``a``, the lhs; 1 for ``b``).
    """

    forward: object
    residual: int
    grad_of: int


class _Tag(NamedTuple):
    """A variable read by a forward contraction: as its operand ``side``, ``reversed`` when it went
    through ``rev`` since; ``scopes``: the contraction's named-scope path."""

    forward: object
    side: int
    reversed: bool
    scopes: tuple


def _transpose_dims(forward, side: int):
    """The dimension numbers JAX's rule gives ``dot_general(g, residual)`` for the gradient of the
    operand of ``forward`` other than ``side``; the output is (batch, lhs free, rhs free)."""
    (contract, batch) = forward.params["dimension_numbers"]
    ndims = [len(v.aval.shape) for v in forward.invars]
    free = [tuple(a for a in range(ndims[s]) if a not in contract[s] and a not in batch[s]) for s in (0, 1)]
    nb = len(batch[0])
    start = nb + (len(free[0]) if side == 1 else 0)
    out_free = tuple(range(start, start + len(free[side])))
    return ((out_free, free[side]), (tuple(range(nb)), tuple(batch[side])))


def _ragged_transpose_dims(forward, side: int):
    """What JAX's rule gives ``ragged_dot_general`` for the gradient of the operand of the grouped
    ``forward`` (ragged along a free axis of its lhs) other than ``side``: for the lhs,
    ``ragged_dot_general(g, rhs)`` summing ``g`` over the rhs's free output axes, ragged where the
    lhs was, grouped as the rhs; for the rhs, ``ragged_dot_general(lhs, g)`` summing over the lhs's
    free axes, the ragged one among them. As ``(contracting, batch, lhs ragged, rhs group)``."""
    dn = forward.params["ragged_dot_dimension_numbers"]
    (xc, yc), (xb, yb) = dn.dot_dimension_numbers
    x_ndim, y_ndim = (len(v.aval.shape) for v in forward.invars[:2])
    group = tuple(dn.rhs_group_dimensions)
    x_kept = [a for a in range(x_ndim) if a not in xc and a not in xb]
    y_kept = [a for a in range(y_ndim) if a not in yc and a not in yb and a not in group]
    nb = len(xb)
    ans_x = tuple(range(nb, nb + len(x_kept)))
    ans_y = tuple(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
    (ragged,) = dn.lhs_ragged_dimensions
    if ragged not in x_kept:  # ragged along a summed or batch axis: JAX has no transpose rule for it
        return None
    if side == 1:  # the lhs's gradient, the rhs the residual
        return _normal(((ans_y, y_kept), (tuple(range(nb)), yb))), (nb + x_kept.index(ragged),), group
    return _normal(((x_kept, ans_x), (xb, tuple(range(nb))))), (ragged,), ()


def _ragged_dims(eqn):
    dn = eqn.params["ragged_dot_dimension_numbers"]
    as_ints = lambda axes: tuple(int(a) for a in axes)
    return _normal(dn.dot_dimension_numbers), as_ints(dn.lhs_ragged_dimensions), as_ints(dn.rhs_group_dimensions)


def _normal(dims):
    return tuple(tuple(tuple(int(a) for a in axes) for axes in pair) for pair in dims)


def _transposes(eqn, residual: int, tag: _Tag) -> bool:
    """Whether ``eqn``, reading ``tag``'s forward operand as its operand ``residual``, is the
    transpose rule's contraction for the gradient of that forward's other operand."""
    forward, side = tag.forward, tag.side
    if eqn.primitive is not forward.primitive:
        return False
    r, g = eqn.invars[residual], eqn.invars[1 - residual]
    if r.aval.shape != forward.invars[side].aval.shape or g.aval.shape != forward.outvars[0].aval.shape:
        return False
    if eqn.primitive is lax.dot_general_p:
        # JAX's rule: dot_general(g, residual), never the residual reversed.
        dims = _normal(eqn.params["dimension_numbers"])
        return residual == 1 and not tag.reversed and dims == _normal(_transpose_dims(forward, side))
    if eqn.primitive is _RAGGED_DOT:
        # ragged_dot_general(g, b) for the input gradient, ragged_dot_general(a, g) for the weight's.
        return residual == side and not tag.reversed and _ragged_dims(eqn) == _ragged_transpose_dims(forward, side)
    # conv: conv(g, rev(b)) for the input gradient, conv(a, g) for the weight gradient.
    return residual == side and tag.reversed == (side == 1)


class Transposes:
    """The forward candidates of each backward contraction in one closed jaxpr (nested ones
    included), and what the recipe made of each forward contraction.

    Equations are told apart by identity (the walker walks these jaxpr objects); the instance
    keeps the jaxpr, so the ids stay valid while it lives.
    """

    def __init__(self, closed):
        self._partners: dict[int, tuple[Partner, ...]] = {}
        self._decisions: dict[int, list] = {}
        # ids of the contractions the transposition emitted: those without a partner are a user's
        # own backward rule, or a pairing this module misses
        self._transposed: set[int] = set()
        # forward contractions with their scope paths, and the values remat recomputed, in program order
        self._forwards: list[tuple[object, tuple]] = []
        # the forward contractions that read each operand of each forward contraction (itself included)
        self._readers: dict[int, tuple[tuple[_Tag, ...], ...]] = {}
        self._recomputed: set = set()
        self._closed = closed
        self._scan(closed.jaxpr, {}, False, ())

    @property
    def counts(self) -> tuple[int, int]:
        """``(paired, emitted)``: contractions JAX's transposition emitted that have a forward
        candidate, and all it emitted (each equation once)."""
        return len(self._partners), len(self._transposed)

    def decide(self, eqn, decision) -> None:
        """Record what the recipe made of the forward contraction ``eqn`` (once per distinct
        decision: a jaxpr traced once and called at several sites is walked at each)."""
        seen = self._decisions.setdefault(id(eqn), [])
        if decision not in seen:
            seen.append(decision)

    def taken_as_activation(self, eqn, side: int) -> bool:
        """Whether another forward contraction, decided before ``eqn``, read ``eqn``'s operand
        ``side`` as its activation (the operand the recipe did not take as the weight)."""
        for tag in self._readers.get(id(eqn), ((), ()))[side]:
            if tag.forward is eqn:
                continue
            for d in self._decisions.get(id(tag.forward), ()):
                if d is not None and tag.side == (1 if d.unswap is not None else 0):
                    return True
        return False

    def resolve(self, eqn, backward=None):
        """``(partner, decision)`` for the backward contraction ``eqn``, or ``None`` when it has no
        forward candidate. ``decision`` is ``None`` where the forward kept the program's precision
        (also when no rule bound it: a high-precision scope, ``amp_stop``). Raises ``ValueError``
        when the candidates' outcomes differ.

        ``backward(partner, decision)``: what the backward contraction computes given that
        candidate (hashable; by default the decision and the partner's sides). Candidates that
        compute the same are one outcome: two forward contractions that read one constant and differ
        only in how the other operand's axes are ordered (``jnp.einsum`` with a shared coefficient
        tensor) transpose to the same backward GEMM, whichever of them ``eqn`` belongs to."""
        partners = self._partners.get(id(eqn), ())
        if not partners:
            return None
        backward = backward or (lambda p, d: (d, p.residual, p.grad_of))
        outcomes: dict = {}
        for p in partners:
            for d in self._decisions.get(id(p.forward), [None]):
                outcomes.setdefault(None if d is None else backward(p, d), (p, d))
        if len(outcomes) > 1:
            where = ", ".join(
                sorted({"/".join(jc.scope_names(p.forward.source_info.name_stack)) or "no scope" for p in partners})
            )
            raise ValueError(
                f"a backward {eqn.primitive.name} of the gradient taken inside the function under the recipe "
                f"transposes one of several forward contractions (at {where}) that the recipe treats differently "
                "(one quantized, another kept in the program's precision, or one jitted function called on "
                "a weight at one site and on two activations at another), and nothing tells which. Apply the "
                "recipe to the loss and take the gradient outside: jax.grad(recipes.apply(loss, recipe)); "
                "where the forward contractions are distinct equations (not one jitted function called twice), "
                "distinct jax.named_scope blocks around them also tell them apart."
            )
        return next(iter(outcomes.values()))

    def _scan(self, jaxpr, tags: dict, transposed: bool, scopes: tuple) -> None:
        """Walk ``jaxpr``; ``tags``: ``{var: (_Tag, ...)}``, the forward operands each variable is,
        updated in place (so the caller reads the tags its sub-jaxpr's invars and outvars acquired)."""
        for eqn in jaxpr.eqns:
            recomputed = jc.in_recomputation(eqn.source_info.name_stack)
            inside = (transposed or jc.in_transpose(eqn.source_info.name_stack)) and not recomputed
            here = (*scopes, *jc.scope_names(eqn.source_info.name_stack))
            if recomputed:
                self._recomputed.update(v for v in eqn.outvars if not isinstance(v, jc.Literal))
            if eqn.primitive in CONTRACTIONS:
                partners = (self._match(eqn, tags, here) or self._match_recomputed(eqn, here)) if inside else ()
                if inside:
                    self._transposed.add(id(eqn))
                if partners:
                    self._partners[id(eqn)] = partners
                    continue
                self._forwards.append((eqn, here))
                seen = self._readers.get(id(eqn), ((),) * len(eqn.invars))
                self._readers[id(eqn)] = tuple(
                    _merge(old, _read(tags, v)) for old, v in zip(seen, eqn.invars, strict=True)
                )
                for side, v in enumerate(eqn.invars):
                    _add(tags, v, (_Tag(eqn, side, False, here),))
            elif eqn.primitive is lax.rev_p:  # the input gradient of a convolution reverses its weight
                flipped = tuple(t._replace(reversed=not t.reversed) for t in _read(tags, eqn.invars[0]))
                _add(tags, eqn.outvars[0], flipped)
            elif _walk.has_sub_jaxprs(eqn):
                self._into(eqn, tags, inside, here)

    def _into(self, eqn, tags: dict, transposed: bool, scopes: tuple) -> None:
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
            self._scan(j, inner, transposed, scopes)
            for v, i in zip(j.invars, operands, strict=True):
                if i is not None:
                    _add(tags, eqn.invars[i], _read(inner, v))
            for v, o in zip(j.outvars, results, strict=True):
                if o is not None:
                    _add(tags, eqn.outvars[o], _read(inner, v))

    @staticmethod
    def _match(eqn, tags, scopes: tuple) -> tuple[Partner, ...]:
        """Every forward candidate of ``eqn``; those under ``eqn``'s own named scopes where any is."""
        found = [
            (tag, Partner(tag.forward, residual, 1 - tag.side))
            for residual in (1, 0)
            for tag in _read(tags, eqn.invars[residual])
            if _transposes(eqn, residual, tag)
        ]
        return _prefer_scope(found, scopes)

    def _match_recomputed(self, eqn, scopes: tuple) -> tuple[Partner, ...]:
        """The forward candidates of ``eqn`` by shapes and dimension numbers alone, where its residual
        operand is a value remat recomputed that no recomputed forward contraction reads."""
        found = [
            (tag, Partner(forward, residual, 1 - side))
            for residual in (1, 0)
            if not isinstance(eqn.invars[residual], jc.Literal) and eqn.invars[residual] in self._recomputed
            for forward, where in self._forwards
            for side in (0, 1)
            if _transposes(eqn, residual, tag := _Tag(forward, side, False, where))
        ]
        return _prefer_scope(found, scopes)


def _prefer_scope(found, scopes: tuple) -> tuple[Partner, ...]:
    """The partners of ``found`` (``(tag, partner)`` pairs) under ``scopes`` where any is, else all."""
    same_scope = [p for tag, p in found if tag.scopes == scopes]
    return tuple(same_scope or [p for _, p in found])


class Site(NamedTuple):
    """Where a rule's contraction sits in the walked program: what it is a transpose of, and where
    the rule records what it made of a forward contraction."""

    transposes: Transposes
    eqn: object

    def resolve(self, backward=None):
        return self.transposes.resolve(self.eqn, backward)

    def decide(self, decision) -> None:
        self.transposes.decide(self.eqn, decision)

    def taken_as_activation(self, side: int) -> bool:
        return self.transposes.taken_as_activation(self.eqn, side)


def _read(tags: dict, v) -> tuple:
    return () if isinstance(v, jc.Literal) else tags.get(v, ())


def _add(tags: dict, v, new: tuple) -> None:
    if not new or isinstance(v, jc.Literal):
        return
    tags[v] = _merge(tags.get(v, ()), new)


def _merge(old: tuple, new: tuple) -> tuple:
    # by identity: equations compare by their params otherwise
    return old + tuple(t for t in new if not any(t[0] is o[0] and t[1:] == o[1:] for o in old))
