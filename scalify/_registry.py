"""The rule table: ``Primitive -> Rule``. Rules are registered by the ``_rules_*`` modules."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from scalify._jax_compat import Primitive


@attrs.frozen
class Rule:
    """How a primitive treats scaled operands.

    Attributes:
        fn: ``fn(eqn, *invals) -> out or list[out]``; ``invals`` are carrier ScaledArrays (or
            formatted ones when ``raw``) and plain arrays.
        group: the property that makes the rule correct (``commuting``, ``multiplicative``,
            ``additive``, ``nonlinear``, ``control``, ``scaled-op``).
        doc: one line for ``docs/operators.md``: how the rule treats scales and its output format.
        always: run the rule even when no operand is scaled (ops that create ScaledArrays).
        raw: pass formatted ScaledArrays unconverted.
    """

    fn: Callable
    group: str
    doc: str
    always: bool = False
    raw: bool = False


RULES: dict[Primitive, Rule] = {}


def register_rule(prims, group: str, doc: str, *, always: bool = False, raw: bool = False):
    """Decorator registering ``fn`` as the scalify rule of one or several primitives.

    This is also the extension point for users: ``register_rule(my_p, "nonlinear", "...")(fn)``.
    """
    if isinstance(prims, Primitive):
        prims = [prims]

    def deco(fn):
        for prim in prims:
            RULES[prim] = Rule(fn, group, doc, always, raw)
        return fn

    return deco


class ScalifyUnsupportedError(NotImplementedError):
    """A scaled operand reached a primitive that has no scalify rule."""
