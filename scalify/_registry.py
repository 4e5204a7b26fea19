"""The rule table: ``Primitive -> Rule``. Rules are registered by the ``_rules_*`` modules.

A rule states the property that makes it correct as a :class:`Group`; the interpreter reads the
group's fields (never its name). A primitive has one rule: registering a second raises unless the
caller says ``overwrite=True``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import attrs

from scalify._jax_compat import Primitive


@attrs.frozen
class Group:
    """The property that makes a family of rules correct, and what the interpreter may assume of it.

    Attributes:
        name: the name used in ``register_rule`` and ``docs/operators.md``.
        carries_bound: the output's data are the input's data moved (no arithmetic), so a known
            bound on the input data holds for the output data.
        keeps_format: under ``ScalifyConfig(keep_format=True)`` the output is re-quantized to the
            first formatted input's format (element-wise results of that format's values).
        control: the rule evaluates sub-jaxprs itself (its outputs are already sealed, and it must
            run whenever a sub-jaxpr creates ScaledArrays).
    """

    name: str
    carries_bound: bool = False
    keeps_format: bool = False
    control: bool = False


GROUPS: dict[str, Group] = {
    g.name: g
    for g in (
        Group("commuting", carries_bound=True, keeps_format=True),
        Group("additive", keeps_format=True),
        Group("multiplicative"),
        Group("nonlinear"),
        Group("control", control=True),
        Group("scaled-op"),
    )
}


@attrs.frozen
class Rule:
    """How a primitive treats scaled operands.

    Attributes:
        fn: ``fn(eqn, *invals) -> out or list[out]``; ``invals`` are carrier ScaledArrays (or
            formatted ones when ``raw``) and plain arrays.
        group: the :class:`Group` whose property makes the rule correct.
        doc: one line for ``docs/operators.md``: how the rule treats scales and its output format.
        always: run the rule even when no operand is scaled (ops that create ScaledArrays).
        raw: pass formatted ScaledArrays unconverted.
        keeps_format: see :attr:`Group.keeps_format`; the group's value unless the rule says otherwise.
    """

    fn: Callable
    group: Group
    doc: str
    always: bool = False
    raw: bool = False
    keeps_format: bool = False

    @property
    def carries_bound(self) -> bool:
        return self.group.carries_bound

    @property
    def control(self) -> bool:
        return self.group.control


RULES: dict[Primitive, Rule] = {}


def _group(group: str | Group) -> Group:
    if isinstance(group, Group):
        return group
    try:
        return GROUPS[group]
    except KeyError:
        raise ValueError(
            f"unknown rule group {group!r}: use one of {sorted(GROUPS)} (the property that makes the rule "
            f"correct; 'nonlinear' when unsure), or pass a scalify.Group"
        ) from None


def register_rule(
    prims,
    group: str | Group,
    doc: str,
    *,
    always: bool = False,
    raw: bool = False,
    keeps_format: bool | None = None,
    overwrite: bool = False,
):
    """Decorator registering ``fn`` as the scalify rule of one or several primitives.

    This is also the extension point for users: ``register_rule(my_p, "nonlinear", "...")(fn)``.
    ``keeps_format`` overrides the group's :attr:`Group.keeps_format`. A primitive that already has
    a rule raises ``ValueError`` unless ``overwrite=True`` (replacing a built-in rule is deliberate).
    """
    if isinstance(prims, Primitive):
        prims = [prims]
    g = _group(group)
    keep = g.keeps_format if keeps_format is None else keeps_format

    def deco(fn):
        clash = [prim.name for prim in prims if prim in RULES and not overwrite]
        if clash:
            raise ValueError(f"primitive(s) {clash} already have a scalify rule: pass overwrite=True to replace it")
        for prim in prims:
            RULES[prim] = Rule(fn, g, doc, always, raw, keep)
        return fn

    return deco


# Rules for primitives of modules scalify does not import itself, by module: registered once the
# program's own imports have loaded the module (a program can hold its primitives only then).
_DEFERRED: dict[str, list[Callable[[], None]]] = {}


def register_when_imported(module: str, register: Callable[[], None]) -> None:
    """Run ``register`` (a function registering rules for ``module``'s primitives) once ``module``
    is imported: at once if it is, else the first time a primitive without a rule is met after it
    is. ``jax.experimental.sparse`` imports scipy (about 0.5 s), which ``import scalify`` should
    not cost a program that never builds a sparse matrix."""
    if module in sys.modules:
        register()
    else:
        _DEFERRED.setdefault(module, []).append(register)


def load_imported() -> None:
    """Register the deferred rules of every module imported since (see :func:`register_when_imported`)."""
    for module in [m for m in _DEFERRED if m in sys.modules]:
        for register in _DEFERRED.pop(module):
            register()


def rule_for(prim: Primitive) -> Rule | None:
    """The rule of ``prim``: from :data:`RULES`, after loading deferred rules on a miss."""
    rule = RULES.get(prim)
    if rule is None and _DEFERRED:
        load_imported()
        rule = RULES.get(prim)
    return rule


class ScalifyUnsupportedError(NotImplementedError):
    """A scaled operand reached a primitive that has no scalify rule."""
