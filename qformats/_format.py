"""The :class:`ScaledFormat` contract.

A format turns a float array ``x`` into ``(data, scale)`` with

    value = element.decode(data) * expand(scale_values(scale))

where ``expand`` broadcasts one scale to every element of its block (see :mod:`qformats._layout`).
It is an immutable, hashable value (a frozen ``attrs`` class) so it can be static pytree metadata
and a ``jit`` cache key. Concrete formats implement five methods; everything else here is derived.
"""

from __future__ import annotations

import abc
import functools
import inspect
import math
from typing import ClassVar

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from qformats import _layout

#: The entry points that run as one compiled program when called on concrete arrays, with the
#: arguments that are static there (besides the format itself).
_COMPILED_WHEN_EAGER = {"quantize": (), "quantize_stochastic": (), "fake_quantize": (), "dequantize": ("dtype",)}


def _is_concrete(leaf) -> bool:
    return isinstance(leaf, (np.ndarray, np.generic, float, int)) or (
        isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
    )


def _compiled_when_eager(method, static: tuple[str, ...], owner: type):
    """``method``, run as one ``jax.jit`` program (the format a static argument) when every argument
    is a concrete array, and as itself when any is being traced (inside the caller's program).

    Called eagerly, JAX would dispatch each of the format's operations on its own, and compile
    every ``lax.cond`` whose branches are closures again at each call: a few hundred milliseconds
    per MX or NVFP4 quantize. Compiled, a call costs one dispatch, and its bits are those of the
    same format under the caller's ``jit``.
    """
    jitted = jax.jit(method, static_argnames=("self", *static))
    names = list(inspect.signature(method).parameters)[1:]  # after self
    static_at = {i for i, n in enumerate(names) if n in static}

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        traced = [a for i, a in enumerate(args) if i not in static_at]
        traced += [v for k, v in kwargs.items() if k not in static]
        leaves = jax.tree.leaves(traced)
        if leaves and all(map(_is_concrete, leaves)):
            try:
                return jitted(self, *args, **kwargs)
            except (TypeError, ValueError):  # jit's error for an unhashable static argument
                _check_hashable(self)  # names the fix where that is the cause
                raise
        return method(self, *args, **kwargs)

    call.__compiled_owner__ = owner
    return call


def _check_hashable(fmt) -> None:
    try:
        hash(fmt)
    except TypeError as e:
        raise TypeError(
            f"{type(fmt).__name__} is not hashable, but a format is a static argument of the programs it "
            f"runs: make it an immutable value, e.g. decorate the class with @attrs.frozen."
        ) from e


def _wrap_entry_points(cls: type) -> None:
    """Wrap each entry point ``cls`` defines (not inherits) with :func:`_compiled_when_eager`.

    ``attrs`` rebuilds a slotted class as a new class with a copy of the old one's namespace, so
    this runs twice for it; the second time it only moves the wrapped method's ``super()`` cell to
    the class that is kept. A wrapper a class borrows from an ancestor is left alone.
    """
    for name, static in _COMPILED_WHEN_EAGER.items():
        fn = cls.__dict__.get(name)
        if fn is None or getattr(fn, "__isabstractmethod__", False):
            continue
        owner = getattr(fn, "__compiled_owner__", None)
        if owner is None:
            setattr(cls, name, _compiled_when_eager(fn, static, cls))
        elif owner is not cls and owner not in cls.__mro__:
            _repoint_class_cells(fn.__wrapped__, owner, cls)
            fn.__compiled_owner__ = cls


def _repoint_class_cells(fn, old: type, new: type) -> None:
    """Point ``fn``'s zero-argument ``super()`` cell from ``old`` to ``new``, as ``attrs`` does for
    the methods it sees when it rebuilds a class with slots (it does not see inside our wrapper)."""
    for cell in fn.__closure__ or ():
        if cell.cell_contents is old:
            cell.cell_contents = new


class ScaledFormat(abc.ABC):
    """Abstract base of every quantization format.

    Concrete formats are frozen ``attrs`` classes with at least the fields/properties ``name``,
    ``element`` (an element codec with ``max_value``, ``smallest_normal``, ``bits``, ``encode``,
    ``decode``) and ``layout`` (a :class:`qformats.Layout`).

    Called on concrete arrays, ``quantize``, ``quantize_stochastic``, ``fake_quantize`` and
    ``dequantize`` run as one ``jax.jit`` program per format, shape and dtype (the format is a
    static argument, so it must be hashable); inside a traced program they run inline.
    """

    name: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _wrap_entry_points(cls)

    #: The fields that name data axes (``("axis",)``, NVFP4's ``("axis", "tile_axis")``): what
    #: :meth:`reindex` moves. A format whose layout has no axis, or counts its axes from the end
    #: (negative and fixed, as GGUF's last-axis blocks), leaves it empty.
    axis_fields: ClassVar[tuple[str, ...]] = ()

    #: Whether each block's scale is computed from that block's values alone (MX, per-channel,
    #: per-line and per-tensor scales), so that :meth:`separable` can be read off the layout. False
    #: (the default, always safe) where a scale also sees values outside its block, as NVFP4's
    #: second-level tensor scale does, or where the format does not say.
    local_scales: ClassVar[bool] = False

    # -- the contract -----------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def element(self):
        """The element codec (type of ``data`` before packing)."""

    @property
    @abc.abstractmethod
    def layout(self) -> _layout.Layout:
        """Which elements share one scale."""

    @abc.abstractmethod
    def quantize(self, x):
        """Encode float array ``x`` as ``(data, scale)``. Traceable: works under jit and vmap."""

    @abc.abstractmethod
    def decode(self, data):
        """Element values of ``data`` as float32, in the logical shape (unpacked, unscaled)."""

    @abc.abstractmethod
    def scale_values(self, scale):
        """The multiplier of each block as float32, in the scale-grid shape.

        May be subnormal (an E8M0 byte of 0 is ``2**-127``): use :meth:`dequantize`, which never
        multiplies by a subnormal, to get values.
        """

    # -- optional -------------------------------------------------------------------------------
    def aim(self, contracted: int, free: int | None = None) -> ScaledFormat:
        """This format for an operand of a contraction (a GEMM) that sums over axis ``contracted``.

        Block formats put their blocks along ``contracted`` (a block's scale then factors out of
        each partial sum); ``free`` names a non-contracted axis of the operand, for layouts that
        need a second axis (per-channel: one scale per index of ``free``; 2-D tiles). ``free`` is
        ``None`` when the operand has no free axis. The default, for layouts with no axis
        (per-tensor), is the format itself.
        """
        del contracted, free
        return self

    def separable(self, shape, axis: int) -> bool:
        """Whether the slices of an ``x`` of ``shape`` along ``axis`` quantize alone: rounded to
        nearest, ``fake_quantize(x)`` is, bit for bit, each slice ``x[.., i:i+1, ..]`` quantized on
        its own and the results stacked.

        True when every scale is computed from its own block (:attr:`local_scales`) and the blocks
        are one element wide along ``axis``: MX blocks, per-line and per-channel scales along rows
        are separable by rows. A caller that needs statistics per group of slices (a grouped GEMM's
        token groups) may then quantize the whole array once; where this is False it quantizes
        each group itself.
        """
        a = _layout.normalize_axis(axis, len(shape), self.name)
        return self.local_scales and self.block_shape(tuple(shape))[a] == 1

    def quantize_stochastic(self, x, key):
        """:meth:`quantize` with elements rounded stochastically (unbiased) using PRNG ``key``.

        Formats that support it override this; the scales are those of :meth:`quantize`.
        """
        del x, key
        raise NotImplementedError(
            f"format {self.name!r} has no stochastic rounding mode; use a format that has one "
            f"(qformats.NVFP4, the MX formats) or round to nearest."
        )

    def fake_quantize(self, x, key=None):
        """``dequantize(*quantize(x))`` as float32: the values an emulated low-precision GEMM reads.

        With a PRNG ``key``, the round trip of :meth:`quantize_stochastic` instead. Formats may
        compute it without forming the stored data (no packing, one element loop); the result must
        equal the round trip bit for bit. The default is the round trip itself.
        """
        data, scale = self.quantize(x) if key is None else self.quantize_stochastic(x, key)
        return self.dequantize(data, scale, jnp.float32)

    def factored(self, data, scale):
        """``dequantize(data, scale)`` as ``(values, factor)`` with ``values * factor`` its value.

        ``values`` has the logical shape and a dtype that holds each of them exactly (the stored
        dtype itself where it does, as for per-tensor FP8 data; bfloat16 for elements of 8
        significant bits or fewer times power-of-two or E4M3 block scales); ``factor`` is a float32
        scalar or a rank-matched scale grid. A contraction feeds ``values`` to the GEMM and applies
        a factor that is constant along the contracted axes to its output; a factor known when the
        program is traced (1 where the values carry the whole scale) is best given as a NumPy
        array, so that the contraction's output scale is static and costs no pass over the output.
        The default is exact for every format: float32 dequantized values and factor 1.
        """
        return self.dequantize(data, scale), np.ones((), np.float32)

    def block_scaled(self, data, scale):
        """``(elements, block_scales, factor)`` in the operand types of
        ``jax.nn.scaled_matmul`` (elements float8_e4m3fn / float8_e5m2 / float4_e2m1fn in the logical
        shape, scales float8_e8m0fnu / float8_e4m3fn in the scale-grid shape, ``factor`` a float32
        scalar multiplying the product), or ``None`` when this format has no such form (default)."""
        del data, scale
        return None

    # -- derived ----------------------------------------------------------------------------------
    def reindex(self, rank: int, *, insert: int | None = None, remove: int | None = None) -> ScaledFormat | None:
        """This format for data of rank ``rank`` with one axis inserted at ``insert`` (a stacked or
        gathered dimension: the result has rank ``rank + 1``) or removed at ``remove`` (a mapped
        dimension), its blocks still on the same data axes.

        Each field of :attr:`axis_fields` moves with its axis; a negative axis counts from the end
        and stays negative. ``None`` when ``remove`` is an axis the format scales along (its scale
        varies there: the items cannot share it). A format with no axis fields is returned as is.
        """
        if (insert is None) == (remove is None):
            raise ValueError("reindex takes exactly one of insert= and remove=")
        changes = {}
        for name in self.axis_fields:
            ax = getattr(self, name)
            if ax is None:
                continue
            n = ax % rank
            if remove is not None:
                if n == remove % rank:
                    return None
                new = (ax if remove % rank < n else ax + 1) if ax < 0 else n - (remove % rank < n)
            else:
                k = insert % (rank + 1)
                new = (ax if k <= n else ax - 1) if ax < 0 else n + (k <= n)
            if new != ax:
                changes[name] = new
        return self.replace(**changes) if changes else self

    def dequantize(self, data, scale, dtype=jnp.float32):
        """``decode(data) * expand(scale_values(scale))`` cast to ``dtype``."""
        elems = self.decode(data)
        block = self.block_shape(elems.shape)
        return (elems * _layout.expand(self.scale_values(scale), elems.shape, block)).astype(dtype)

    def block_shape(self, shape) -> tuple[int, ...]:
        """Per-axis block extents for a logical ``shape`` (validates it)."""
        return self.layout.block_shape(tuple(shape))

    def scale_shape(self, shape) -> tuple[int, ...]:
        return self.layout.scale_shape(tuple(shape))

    def data_shape(self, shape) -> tuple[int, ...]:
        """Shape of ``data`` for a logical ``shape`` (differs only for packed formats)."""
        return tuple(shape)

    def value_shape(self, data_shape) -> tuple[int, ...]:
        """Logical shape for a ``data`` shape; inverse of :meth:`data_shape`."""
        return tuple(data_shape)

    @property
    def max_value(self) -> float:
        """Largest magnitude an element holds (before scaling)."""
        return float(self.element.max_value)

    @property
    def smallest_normal(self) -> float:
        return float(self.element.smallest_normal)

    def replace(self, **changes) -> ScaledFormat:
        """A copy with some fields changed, e.g. ``MXFP8.replace(scale_mode="rceil", axis=0)``."""
        try:
            return attrs.evolve(self, **changes)
        except TypeError as e:
            fields = ", ".join(f.name for f in attrs.fields(type(self)))
            raise TypeError(
                f"{type(self).__name__} has no field among {sorted(changes)}; its fields are: {fields}"
            ) from e

    def nbytes(self, shape) -> int:
        """Bytes of ``data`` plus every scale leaf for a logical ``shape``."""
        out = jax.eval_shape(self.quantize, jax.ShapeDtypeStruct(tuple(shape), jnp.float32))
        return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(out))

    def bits_per_element(self, shape=(1024, 1024)) -> float:
        """Storage bits per element, scales included, for a logical ``shape``."""
        return 8.0 * self.nbytes(shape) / math.prod(shape)

    def check_input(self, x) -> None:
        """Raise a clear error for inputs no format can quantize."""
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{self.name}.quantize expects a floating-point array, got dtype {dtype}. "
                f"Convert first, e.g. x.astype(jnp.float32)."
            )
        self.block_shape(jnp.shape(x))

    def describe(self) -> dict:
        """One row of the formats table (used by ``python -m qformats list`` and the docs)."""
        return {
            "name": self.name,
            "element": self.element.name,
            "bits/elem": round(self.bits_per_element(), 3),
            "max": self.max_value,
            "smallest normal": self.smallest_normal,
            "layout": self.layout.describe(),
        }


_wrap_entry_points(ScaledFormat)  # its defaults serve every format that does not override them
