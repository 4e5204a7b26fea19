"""ScaledArray: an array stored as ``data`` times a (block) ``scale``.

Two forms share one class:

* **formatted** (``fmt`` set): ``data`` and ``scale`` are what ``fmt.quantize`` returns (fp8 bytes,
  packed fp4 codes, E8M0 scales, ...); ``value = fmt.dequantize(data, scale)``.
* **carrier** (``fmt is None``): ``data`` is in the logical dtype (float16, bfloat16, float32, ...)
  and ``scale`` is a float32 array that is either 0-d (one scale for the tensor) or has the rank of
  ``data`` with each axis dividing the data's: element ``i`` uses ``scale[i // block]`` with
  ``block = data.shape // scale.shape``. Every rule of the interpreter works on this form.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qformats as qf
from scalify._jax_compat import is_tracer
from scalify._pow2 import mul_pow2_bits, pow2_floor_np

TRACED_CONVERSION = (
    "a ScaledArray was converted to an array inside a traced function (jax.jit, jax.grad, scalify, ...). "
    "scalify sees only the ScaledArrays passed as arguments of the function it wraps: one captured "
    "by a closure or stored on an object (e.g. `model.params = scaled_params`) is a constant it "
    "cannot see. Pass it as an argument, e.g. `scalify.scalify(lambda params, x: model(x, "
    "params=params))(scaled_params, x)`; a function given ScaledArrays without scalify must be "
    "wrapped: `jax.jit(scalify.scalify(fn))`."
)


@jax.tree_util.register_pytree_node_class
class ScaledArray:
    """An array represented as ``data * scale``, with an optional quantization format.

    Children: ``data``, ``scale``. Static metadata: ``fmt`` (a :class:`qformats.ScaledFormat` or
    ``None`` for the carrier form) and, for formatted arrays, the logical ``dtype``.
    """

    __slots__ = ("_dtype", "data", "fmt", "scale")
    # Make numpy defer to us in mixed operations.
    __array_priority__ = 100

    def __init__(self, data, scale, fmt=None, dtype=None):
        self.data = data
        self.scale = scale
        self.fmt = fmt
        self._dtype = None if dtype is None else np.dtype(dtype)

    # -- pytree -----------------------------------------------------------------------------------
    def tree_flatten(self):
        return (self.data, self.scale), (self.fmt, self._dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        obj.fmt, obj._dtype = aux
        return obj

    # -- array-like -------------------------------------------------------------------------------
    @property
    def dtype(self):
        if self._dtype is not None:
            return self._dtype
        return np.dtype(self.data.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(np.shape(self.data))
        return tuple(self.fmt.value_shape(shape)) if self.fmt is not None else shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def aval(self):
        """Abstract value of the logical array (shape and dtype), as JAX's ``ShapedArray``."""
        return jax.core.ShapedArray(self.shape, self.dtype)

    def __len__(self):
        return self.shape[0]

    def to_array(self, dtype=None):
        """The value ``data * scale`` as a plain array (computed in float32, cast to ``dtype``).

        A carrier array whose data and scale are NumPy arrays gives a NumPy array (no device
        transfer), as in jax-scalify; otherwise a ``jax.Array``.
        """
        dtype = self.dtype if dtype is None else dtype
        if self.fmt is not None:
            return self.fmt.dequantize(self.data, self.scale, dtype=jnp.float32).astype(dtype)
        if _is_numpy(self.data) and _is_numpy(self.scale):
            return _numpy_value(self.data, self.scale, dtype)
        data = jnp.asarray(self.data)
        return (data.astype(jnp.float32) * expand_scale(self.scale, data.shape)).astype(dtype)

    def __array__(self, dtype=None, copy=None):
        # Convert straight to `dtype`: a float16 array with a large scale is finite in float32.
        value = self.to_array(dtype)
        if is_tracer(value):
            # Inside a trace no NumPy value exists; JAX would raise TracerArrayConversionError from here.
            raise TypeError(TRACED_CONVERSION)
        return np.asarray(value)

    def item(self, *args):
        """One element's value as a Python scalar, as ``np.ndarray.item`` (a step's ``loss.item()``)."""
        return np.asarray(self).item(*args)

    def __float__(self):
        return float(np.asarray(self))

    def __int__(self):
        return int(np.asarray(self))

    def astype(self, dtype) -> ScaledArray:
        """The same value with logical dtype ``dtype`` (a floating dtype); the scale is unchanged.

        Carrier form: the data is cast (``data.astype(dtype)``, a plain cast like NumPy's: float8
        targets do not saturate), as in jax-scalify. Formatted form: only the logical dtype
        changes, the quantized data stays as it is.
        """
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"ScaledArray.astype({dtype}): a ScaledArray holds floating values; "
                f"use `sa.to_array({dtype})` for a plain {dtype} array of its value."
            )
        if self.fmt is not None:
            return ScaledArray(self.data, self.scale, fmt=self.fmt, dtype=dtype)
        return ScaledArray(self.data.astype(dtype), self.scale)

    def __repr__(self):
        if self.fmt is None:
            return f"ScaledArray(data={self.data!r}, scale={self.scale!r})"
        return f"ScaledArray(data={self.data!r}, scale={self.scale!r}, fmt={self.fmt.name})"

    # Arithmetic outside scalify is deliberately not provided (no silent dequantization): the
    # operators raise an error that says so (see `_outside_scalify`).


def _outside_scalify(name):
    def op(self, *args):
        raise TypeError(
            f"ScaledArray has no arithmetic outside scalify ({name}): run the computation under "
            "scalify.scalify (e.g. jax.jit(scalify.scalify(f))(...)), where every operation keeps "
            "the scales, or take the value as a plain array with x.to_array()."
        )

    op.__name__ = name
    return op


for _name in (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__ "
    "__rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __matmul__ __rmatmul__ __neg__ __pos__ __abs__ "
    "__lt__ __le__ __gt__ __ge__"
).split():
    setattr(ScaledArray, _name, _outside_scalify(_name))


def is_scaled_leaf(x) -> bool:
    """``is_leaf`` predicate for ``jax.tree`` functions that stop at ScaledArrays."""
    return isinstance(x, ScaledArray)


def is_traced_leaf(x) -> bool:
    """Whether the transformations trace an argument leaf: arrays are; Python scalars and other
    objects (a dtype, a config, a learning-rate schedule) reach the function as they are, as
    ``jax.jit``'s static arguments and ``jax.grad``'s non-differentiated ones do."""
    return isinstance(x, (ScaledArray, jax.Array, np.ndarray, np.generic))


def split_leaves(tree, keep=is_traced_leaf, is_leaf=None):
    """``(kept, rebuild)``: the leaves of ``tree`` that ``keep`` selects, and a function that
    rebuilds ``tree`` from replacements for them, every other leaf as it was (how the
    transformations trace the array arguments and pass the rest through)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    idx = [i for i, x in enumerate(leaves) if keep(x)]

    def rebuild(kept):
        full = list(leaves)
        for i, x in zip(idx, kept, strict=True):
            full[i] = x
        return treedef.unflatten(full)

    return [leaves[i] for i in idx], rebuild


def is_array_leaf(x) -> bool:
    """Whether an output leaf is an array (traced), not a Python object that a function returns
    beside them (an ``eqx.Module``'s activation function, name or ``inference`` flag)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def split_outputs(fn):
    """``(traced, rebuild)``: ``traced(*args)`` returns the arrays among the leaves of ``fn(*args)``
    (what ``jax.make_jaxpr`` traces), and ``rebuild(values)`` puts values for them back into that
    output, every other leaf (a Python number, a string, a function) as ``fn`` returned it.

    As ``eqx.filter_jit`` does: a step that returns its ``eqx.Module`` (activation functions,
    names, a BatchNorm's ``inference`` flag) runs under ``eqx.filter_jit(scalify(step))`` and
    returns them as they were, not as arrays. ``jax.jit`` turns a returned number into an array
    and rejects other objects, with or without scalify.
    """
    box = []

    def traced(*args):
        leaves, treedef = jax.tree.flatten(fn(*args))
        box[:] = [treedef, leaves]
        return [x for x in leaves if is_array_leaf(x)]

    def rebuild(values):
        treedef, leaves = box
        values = iter(values)
        return treedef.unflatten([next(values) if is_array_leaf(x) else x for x in leaves])

    return traced, rebuild


def cast(x, dtype):
    """``x`` as an array of ``dtype``; no equation when it already is one.

    Rules call this instead of ``jnp.asarray``/``astype``: those go through NumPy-style dispatch,
    which costs more to trace than the conversion itself.
    """
    if isinstance(x, jax.Array) and x.dtype == dtype:
        return x
    return lax.convert_element_type(x, dtype)


def expand_scale(scale, shape):
    """Broadcast a 0-d or rank-matched block-grid ``scale`` to ``shape`` (float32)."""
    scale = cast(scale, jnp.float32)
    shape = tuple(shape)
    if scale.ndim == 0 or tuple(scale.shape) == shape:
        return scale
    scale = normalize_scale(scale, shape)
    return qf.expand(scale, shape, block_of(scale.shape, shape))


def normalize_scale(scale, shape):
    """A carrier scale as 0-d or rank-matched (a lower-rank scale is taken as leading axes)."""
    if scale.ndim == 0:
        return scale
    if math.prod(scale.shape) == 1:
        return scale.reshape(())
    if math.prod(shape) == 0:
        # No element to scale: every grid fits, and per-tensor is the one all rules accept.
        return jnp.ones((), scale.dtype)
    if scale.ndim < len(shape):
        scale = scale.reshape(tuple(scale.shape) + (1,) * (len(shape) - scale.ndim))
    if scale.ndim != len(shape) or any(n % g for n, g in zip(shape, scale.shape, strict=True)):
        raise ValueError(f"A scale of shape {tuple(scale.shape)} is not a block grid of data shape {tuple(shape)}.")
    return scale


def block_of(scale_shape, shape) -> tuple[int, ...]:
    """Block extents of a carrier scale grid over ``shape``."""
    if len(scale_shape) == 0:
        return tuple(shape)
    return tuple(n // g for n, g in zip(shape, scale_shape, strict=True))


def to_carrier(x: ScaledArray) -> ScaledArray:
    """The carrier form of ``x``: decoded elements in the logical dtype, float32 scale grid.

    Talks to the format protocol only (``decode`` and ``scale_values``), so it serves every format.
    """
    if x.fmt is None:
        data = x.data if isinstance(x.data, jax.Array) else jnp.asarray(x.data)
        scale = normalize_scale(cast(x.scale, jnp.float32), data.shape)
        if scale is x.scale and data is x.data:
            return x
        return ScaledArray(data, scale)
    fmt = x.fmt
    elems = fmt.decode(x.data)
    shape = tuple(elems.shape)
    grid = fmt.scale_values(x.scale).astype(jnp.float32).reshape(fmt.scale_shape(shape))
    # Elements go up to the element max (448 for e4m3, 127 for int8): move a static power of two
    # into the scale so the carrier data is O(1) and products cannot overflow a float16 carrier.
    k = pow2_floor_np(fmt.max_value)
    if k != 1.0:
        if k > 2.0**64:
            # bf16's max is ~2^128: 1/k = 2^-127 is a float32 subnormal that XLA on CPU flushes
            # to zero, and XLA folds chains of constant factors (2^-64 * 2^-63, or k with a
            # rule's next static factor: 2^128 = inf) back into one. Exponent arithmetic on the
            # bits is exact and leaves no constant to fold.
            e = int(np.log2(k))
            elems, grid = mul_pow2_bits(elems, -e), mul_pow2_bits(grid, e)
        else:
            elems, grid = elems * np.float32(1.0 / k), grid * np.float32(k)
        if grid.ndim == 0:
            # A per-tensor format stores scale 1 for an all-zero tensor: shifted, that zero would
            # carry scale k (2^127 for bf16) and set the common scale of every sum it joins,
            # flushing the other operands. Zero data can take any scale: keep 1.
            grid = lax.select(jnp.any(elems != 0), grid, np.float32(1.0))
    return ScaledArray(elems.astype(x.dtype), normalize_scale(grid, shape))


def _is_numpy(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def _numpy_value(data, scale, dtype):
    """``data * scale`` computed with NumPy (in at least float32) and cast to ``dtype``."""
    data, scale = np.asarray(data), np.asarray(scale)
    wide = np.promote_types(np.promote_types(data.dtype, np.float32), scale.dtype)
    scale = np.asarray(expand_scale(scale, data.shape)) if scale.ndim else scale
    return (data.astype(wide) * scale.astype(wide)).astype(dtype)


def _dtype_of(x):
    """``x``'s dtype: its own for arrays, NumPy's promotion for Python scalars."""
    return x.dtype if isinstance(x, np.ndarray | np.generic | jax.Array) else np.result_type(x)


def _is_float(x) -> bool:
    return jnp.issubdtype(_dtype_of(x), jnp.floating)


def _split_scalar(x):
    """A floating scalar as ``mantissa * 2^e`` with the mantissa in ``[1, 2)`` (jax-scalify's scalar
    form): the power of two goes to the scale, so the data of a scalar is O(1) in any dtype."""
    xnp = _is_numpy(x)
    xp = np if xnp else jnp
    m, e = xp.frexp(xp.abs(xp.asarray(x, np.float32)))  # |x| = m * 2^e, m in [0.5, 1)
    zero = m == 0
    scale = xp.where(zero, np.float32(1), xp.ldexp(np.float32(1), e - 1)).astype(np.float32)
    data = (xp.asarray(x, np.float32) / scale).astype(_dtype_of(x))
    return ScaledArray(data, scale)


def _concrete(scale):
    """``scale`` as a NumPy array when its value is known now (not a tracer), else None."""
    if is_tracer(scale):
        return None
    return np.asarray(scale, np.float32)


def check_scale(scale, *, divides: bool):
    """The scale contract: a ScaledArray's value is ``data * scale`` with ``scale >= 0``.

    The rules read signs, maxima and orderings from the data alone (``abs``, ``max``, ``relu``,
    ``sign``, comparisons), which holds only for a non-negative scale. ``divides`` (the carrier
    form of ``as_scaled_array``, ``data = x / scale``) also needs it finite and non-zero: a zero or
    non-finite divisor turns finite values into inf/NaN data. A traced scale cannot be checked
    here; it is the caller's contract.
    """
    s = _concrete(scale)
    if s is None:
        return
    if np.any(s < 0):
        raise ValueError(
            f"ScaledArray scales must be >= 0, got {scale!r}: the value is data * scale and the rules "
            "take signs and orderings from the data. Put the sign in the data (pass -x with a positive scale)."
        )
    if divides and not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(
            f"as_scaled_array(x, scale=...) divides x by the scale, so it must be positive and finite, got "
            f"{scale!r} (zero, NaN or Inf would make the data inf/NaN). Pass a positive finite scale, or "
            "scaled_array(data, scale) to build a ScaledArray from its raw data and scale."
        )


def _as_scaled_leaf(x, scale, fmt):
    if fmt is not None:
        if isinstance(fmt, str):
            fmt = qf.get_format(fmt)
        if isinstance(x, ScaledArray):
            x = x.to_array()
        x = jnp.asarray(x)
        fmt.check_input(x)
        data, sc = fmt.quantize(x)
        return ScaledArray(data, sc, fmt=fmt, dtype=x.dtype)
    if isinstance(x, ScaledArray):
        return x
    if isinstance(x, (bool, int)) or not _is_float(x):
        return x  # integer labels, masks: the very object, unchanged
    if isinstance(x, float):
        x = np.float32(x)
    if scale is None and np.ndim(x) == 0:
        return _split_scalar(x)
    # NumPy in, NumPy out (no device transfer), as in jax-scalify; JAX arrays stay JAX arrays.
    xp = np if _is_numpy(x) else jnp
    if scale is None:
        return ScaledArray(x if xp is jnp else np.asarray(x), np.ones((), np.float32))
    if not (_is_numpy(scale) or isinstance(scale, jax.Array)) or not _is_float(scale):
        scale = np.asarray(scale, np.float32)  # Python numbers and integer scales: float32
    check_scale(scale, divides=True)
    grid = normalize_scale(jnp.asarray(scale, jnp.float32), np.shape(x))
    if xp is np and _is_numpy(scale):
        wide = np.promote_types(np.asarray(x).dtype, np.float32)
        g = np.asarray(grid)
        data = (np.asarray(x, wide) / (np.asarray(expand_scale(g, np.shape(x))) if g.ndim else g)).astype(x.dtype)
    else:
        xj = jnp.asarray(x)
        data = (xj.astype(jnp.float32) / expand_scale(grid, xj.shape)).astype(xj.dtype)
    # Keep the caller's scale object (its dtype and array type) when it is a scalar.
    return ScaledArray(data, scale if np.ndim(scale) == 0 else grid)


def as_scaled_array(x, scale=None, fmt=None):
    """Make ScaledArrays from an array or a pytree of arrays.

    * ``scale`` given: the value is kept and ``data = x / scale`` in ``x``'s dtype (carrier form).
      ``scale`` may be a scalar or a block grid (rank-matched, each axis dividing ``x``'s); it must be
      positive and finite (``ValueError`` otherwise, when its value is known at the call).
    * ``fmt`` given (a :class:`qformats.ScaledFormat` or a registered name): quantize with it.
    * neither: ``scale = 1``.

    Non-floating leaves (integer labels, booleans, Python ints) are returned as they are (the same
    object). A floating scalar without ``scale`` is split as ``mantissa * 2^e`` (data in ``[1, 2)``,
    power-of-two scale), as in jax-scalify. NumPy inputs keep NumPy data; a scalar ``scale`` is kept
    as given (a Python number becomes a float32 scalar).
    """
    if scale is not None and fmt is not None:
        raise ValueError("Pass either `scale` (carrier form) or `fmt` (quantize), not both.")
    return jax.tree.map(lambda leaf: _as_scaled_leaf(leaf, scale, fmt), x, is_leaf=is_scaled_leaf)


def asarray(x, dtype=None):
    """Plain value of a ScaledArray (or a pytree of them); other leaves pass through.

    With ``dtype``, arrays are cast with their own ``astype`` (NumPy stays NumPy) and Python
    scalars become NumPy arrays.
    """

    def leaf(v):
        if isinstance(v, ScaledArray):
            return v.to_array(dtype)
        if dtype is None:
            return v
        return v.astype(dtype) if isinstance(v, (np.ndarray, jax.Array)) else np.asarray(v, dtype)

    return jax.tree.map(leaf, x, is_leaf=is_scaled_leaf)


def scaled_array(data, scale, dtype=None, npapi=jnp) -> ScaledArray:
    """A carrier ScaledArray from raw ``data`` and ``scale`` (no division: the value is
    ``data * scale``), like ``npapi.array``: ``data`` is converted with ``npapi.asarray(data, dtype)``.

    ``npapi`` is ``jax.numpy`` (default) or ``numpy``. A non-floating ``scale`` becomes float32.
    ``scale`` must be >= 0 (zero, Inf and NaN scales are accepted: the value is ``data * scale``).
    """
    data = npapi.asarray(data, dtype=dtype)
    scale = npapi.asarray(scale)
    check_scale(scale, divides=False)
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        scale = scale.astype(np.float32)
    return ScaledArray(data, scale)


def dequantize(x, dtype=jnp.float32):
    """Float value of a ScaledArray or plain array, as ``dtype``."""
    if isinstance(x, ScaledArray):
        return x.to_array(dtype)
    return jnp.asarray(x, dtype)
