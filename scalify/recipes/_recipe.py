"""A training recipe: how each operand of the three GEMMs of a linear layer is quantized.

For ``y = dot_general(x, w)`` and the cotangent ``dy`` of ``y``:

* forward ``y = x . w``        (``fwd_lhs`` = x, ``fwd_rhs`` = w), contracted over x's K axes;
* input gradient ``dx = dy . w`` (``dgrad_lhs`` = dy, ``dgrad_rhs`` = w), contracted over the N axes;
* weight gradient ``dw = dy . x`` (``wgrad_lhs`` = dy, ``wgrad_rhs`` = x), contracted over the M axes.

Each role holds a qformats format or ``None`` (high precision: the operand as the program has it).
The library aims every format at its GEMM's contracted axis (``fmt.aim``), so one format value
serves all roles.
"""

from __future__ import annotations

import attrs
import jax.numpy as jnp

import qformats as qf

ROLES = ("fwd_lhs", "fwd_rhs", "dgrad_lhs", "dgrad_rhs", "wgrad_lhs", "wgrad_rhs")
"""The six GEMM operands a recipe quantizes, in the order forward, input gradient, weight gradient."""


def _format_or_none(value):
    if value is None or isinstance(value, qf.ScaledFormat):
        return value
    if isinstance(value, str):
        return qf.get_format(value)
    raise TypeError(
        f"a recipe role takes a qformats format, a registered format name or None (high precision); got {value!r}"
    )


def _roles(value) -> frozenset:
    value = frozenset((value,) if isinstance(value, str) else value)
    unknown = sorted(value - set(ROLES))
    if unknown:
        raise ValueError(f"unknown GEMM role(s) {unknown}; the roles are {ROLES}")
    return value


def _dtype_or_none(value):
    return None if value is None else jnp.dtype(value)


@attrs.frozen
class Recipe:
    """A low-precision training recipe: a format (or ``None``) per GEMM role, plus transforms.

    Attributes:
      name: what the recipe is called (``"mxfp8"``, ``"float8_tensorwise"``, ...).
      fwd_lhs, fwd_rhs, dgrad_lhs, dgrad_rhs, wgrad_lhs, wgrad_rhs: the format of each GEMM operand
        (see the module docstring), a registered name, or ``None`` for high precision.
      out_dtype: dtype of each GEMM's result; ``None`` keeps the program's.
      stochastic_rounding: roles whose elements round stochastically (NVFP4 rounds the gradient
        ``dy`` this way); needs formats with ``quantize_stochastic``.
      wgrad_hadamard: a ``qformats.RandomHadamard`` applied to both weight-gradient operands along
        their contracted (M) axis before quantization, or ``None``.
      high_precision_scopes: ``jax.named_scope`` names inside which contractions stay in the
        program's precision (for example an LM head).
      weights_only: if true, only contractions with a weight operand (one computed from a single
        input of the applied function) follow the recipe; a product of two activations
        (attention's scores and weighted values) keeps the program's precision, as torchao's and
        Transformer Engine's linear-layer swaps leave it.
      seed: seeds the stochastic rounding (with each GEMM's position and its operand's bits).

    Build variants with :meth:`replace`, e.g. ``MXFP8.replace(wgrad_lhs=None, wgrad_rhs=None)``.
    """

    name: str
    fwd_lhs: qf.ScaledFormat | None = attrs.field(converter=_format_or_none)
    fwd_rhs: qf.ScaledFormat | None = attrs.field(converter=_format_or_none)
    dgrad_lhs: qf.ScaledFormat | None = attrs.field(converter=_format_or_none)
    dgrad_rhs: qf.ScaledFormat | None = attrs.field(converter=_format_or_none)
    wgrad_lhs: qf.ScaledFormat | None = attrs.field(converter=_format_or_none)
    wgrad_rhs: qf.ScaledFormat | None = attrs.field(converter=_format_or_none)
    out_dtype: object = attrs.field(default=None, converter=_dtype_or_none)
    stochastic_rounding: frozenset = attrs.field(default=frozenset(), converter=_roles)
    wgrad_hadamard: qf.RandomHadamard | None = None
    high_precision_scopes: tuple = attrs.field(default=(), converter=tuple)
    seed: int = 0
    weights_only: bool = attrs.field(default=False, converter=bool)

    def __attrs_post_init__(self):
        for role in self.stochastic_rounding:
            if getattr(self, role) is None:
                raise ValueError(
                    f"recipe {self.name!r} rounds role {role!r} stochastically but keeps it in high precision; "
                    f"give {role} a format or drop it from stochastic_rounding."
                )

    @classmethod
    def uniform(cls, name: str, fmt, **kwargs) -> Recipe:
        """The recipe with the same format in all six roles."""
        return cls(name, *(fmt,) * len(ROLES), **kwargs)

    def format_of(self, role: str):
        """The format of ``role`` (``None``: high precision)."""
        return getattr(self, role)

    def replace(self, **changes) -> Recipe:
        """A copy with some fields changed (roles take formats, names or ``None``)."""
        unknown = sorted(set(changes) - set(attrs.fields_dict(Recipe)))
        if unknown:
            fields = ", ".join(attrs.fields_dict(Recipe))
            raise TypeError(f"Recipe has no field {unknown}; its fields are: {fields}")
        return attrs.evolve(self, **changes)

    @staticmethod
    def _label(fmt) -> str:
        """A format's registered name plus the fields this recipe changes (the axis is the library's)."""
        if fmt is None:
            return "high"
        try:
            base = qf.get_format(fmt.name)
        except qf.UnknownFormatError:
            return fmt.name
        if type(base) is not type(fmt):
            return fmt.name
        changed = [
            f"{f.name}={getattr(fmt, f.name)}"
            for f in attrs.fields(type(fmt))
            if f.name not in ("axis", "tile_axis") and getattr(fmt, f.name) != getattr(base, f.name)
        ]
        if isinstance(fmt.layout, qf.Tiles):
            changed.append(f"{fmt.layout.size}x{fmt.layout.size} tiles")
        return fmt.name + (f" ({', '.join(changed)})" if changed else "")

    def describe(self) -> dict:
        """One row of the recipes table: each role's format name (or ``"high"``) and the transforms."""
        row = {"recipe": self.name}
        for role in ROLES:
            row[role] = self._label(self.format_of(role))
        row["stochastic rounding"] = ", ".join(sorted(self.stochastic_rounding)) or "-"
        h = self.wgrad_hadamard
        row["wgrad Hadamard"] = "-" if h is None else f"{h.size}x{h.size}"
        return row
