"""Precision functions and the default amp policy.

A *precision function* has jaxamp's signature::

    precision_fn(compute_dtype, original_dtypes, *invars, **bind_params) -> (invars, bind_params)

``original_dtypes`` are the dtypes the traced program gave the operation's inputs; ``invars`` are the
values amp is about to feed it (their dtypes may differ, because an earlier operation ran in low
precision). A policy maps keys (lax primitives or ``jax.named_scope`` strings) to precision functions,
dtypes or qformats formats; :func:`as_precision_fn` normalises the last two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

STOP_SCOPES = ("amp_stop", "amp_step", "amp_default")
"""Named scopes inside which amp keeps original precision (``amp_stop`` always; the other two unless
the policy maps them to something else)."""


def _is_inexact(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _is_real_float(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def cast_if_float(dtype, value):
    """``value.astype(dtype)`` for a floating array of another dtype; anything else unchanged.

    A complex array is cast only to another complex dtype: casting it to a real one would drop its
    imaginary part (jaxamp casts it, with NumPy's ``ComplexWarning``), and float16 and bfloat16 have
    no complex counterpart. ``dtype`` is None for an operand whose type has no dtype (a captured
    hijax Variable, which forwards ``.dtype`` to the value it holds): it is not an array to cast."""
    if dtype is None or not _is_inexact(value) or value.dtype == jnp.dtype(dtype):
        return value
    if not _is_real_float(value) and jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        return value
    return lax.convert_element_type(value, dtype)


def cast_tree(dtype, tree):
    """:func:`cast_if_float` on every leaf of ``tree``."""
    return jax.tree.map(lambda v: cast_if_float(dtype, v), tree)


def use_original_precision(compute_dtype, original_dtypes: Sequence[Any], *invars, **bind_params):
    """Run the operation on inputs cast back to the dtypes the program gave them."""
    del compute_dtype
    return [cast_if_float(d, v) for v, d in zip(invars, original_dtypes, strict=True)], bind_params


def use_compute_precision(compute_dtype, original_dtypes: Sequence[Any], *invars, **bind_params):
    """Run the operation in ``compute_dtype`` (jaxamp's rule).

    If any input is not a real floating array (an integer index, a boolean mask, a complex value:
    float16 has no complex form) the operation keeps the program's dtypes (jaxamp left integer
    inputs as they came, which breaks ``select_n`` after an earlier low-precision op, and cast
    complex ones to the real compute dtype, dropping their imaginary part). Floating arrays in
    ``bind_params`` are cast too, and ``preferred_element_type`` becomes ``compute_dtype``.
    """
    if not all(_is_real_float(v) for v in invars):
        return use_original_precision(compute_dtype, original_dtypes, *invars, **bind_params)
    invars = cast_tree(compute_dtype, list(invars))
    bind_params = dict(cast_tree(compute_dtype, bind_params))
    if "preferred_element_type" in bind_params:
        bind_params["preferred_element_type"] = jnp.dtype(compute_dtype)
    return invars, bind_params


def use_widest_precision(compute_dtype, original_dtypes: Sequence[Any], *invars, **bind_params):
    """Run the operation in the widest floating dtype among ``original_dtypes``."""
    del compute_dtype
    floats = [jnp.dtype(d) for d in original_dtypes if jnp.issubdtype(d, jnp.inexact)]
    if not floats:
        return list(invars), bind_params
    widest = max(floats, key=lambda d: (d.itemsize, d == jnp.dtype(jnp.bfloat16)))
    return use_compute_precision(widest, original_dtypes, *invars, **bind_params)


def use_precision(dtype) -> Callable:
    """A precision function running the operation in ``dtype`` whatever ``compute_dtype`` is."""
    dtype = jnp.dtype(dtype)

    def fixed_precision(compute_dtype, original_dtypes, *invars, **bind_params):
        del compute_dtype
        return use_compute_precision(dtype, original_dtypes, *invars, **bind_params)

    fixed_precision.__name__ = f"use_precision_{dtype.name}"
    return fixed_precision


# ------------------------------------------------------------------------------------------------
# Formats: quantize -> dequantize the inputs, straight-through gradient (QAT in one line)
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _quantize_dequantize(fmt, x):
    return fmt.fake_quantize(x).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def fake_quantize(fmt, x):
    """``fmt.dequantize(*fmt.quantize(x))`` in ``x``'s dtype, with an identity (straight-through) JVP.

    The quantize/dequantize pair is one jitted computation (cached per format and shape), so it
    costs one dispatch when run eagerly.
    """
    return _quantize_dequantize(fmt, x)


@fake_quantize.defjvp
def _fake_quantize_jvp(fmt, primals, tangents):
    (x,) = primals
    (t,) = tangents
    return fake_quantize(fmt, x), t


def _operand_axes(primitive, params, ndims) -> list[tuple[int | None, int | None]]:
    """For each operand: (contracted axis, a free axis) or Nones when the primitive has no notion."""
    name = getattr(primitive, "name", None)
    if name == "dot_general" and len(ndims) == 2:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        out = []
        for nd, c, b in ((ndims[0], lc, lb), (ndims[1], rc, rb)):
            free = [a for a in range(nd) if a not in c and a not in b]
            out.append((c[-1] if c else None, free[-1] if free else None))
        return out
    if name == "conv_general_dilated" and len(ndims) == 2:
        dn = params["dimension_numbers"]
        lhs, rhs = dn.lhs_spec, dn.rhs_spec
        # lhs: (batch, feature, spatial...), rhs: (out feature, in feature, spatial...)
        return [(lhs[1], lhs[0]), (rhs[1], rhs[0])]
    return [(None, None)] * len(ndims)


class QuantizeInputs:
    """Precision function that fake-quantizes every floating input through a qformats format.

    Inputs are cast back to their original dtype, quantized then dequantized (``fmt.quantize`` then
    ``fmt.dequantize``) and the operation runs on the result in the original dtype; the gradient is
    straight-through (identity), so this is quantization-aware training. For ``dot_general`` and
    ``conv_general_dilated`` the format is re-aimed per operand: a block format (MX, NVFP4) blocks
    along the operand's contracted axis (the last one if several), a per-channel format puts its
    channels on a free (non-contracted, non-batch) axis. If the contracted axis length is not a
    multiple of the block size a ``ValueError`` names the operation and the shape; nothing is skipped.
    Other primitives use the format as given (its own ``axis``).
    """

    def __init__(self, fmt):
        self.fmt = fmt

    def __repr__(self):
        return f"QuantizeInputs({getattr(self.fmt, 'name', self.fmt)!r})"

    def apply(self, primitive, compute_dtype, original_dtypes, invars, params):
        """The primitive-aware entry point amp calls."""
        del compute_dtype
        ndims = [np.ndim(v) for v in invars]
        axes = _operand_axes(primitive, params, ndims)
        out = []
        for i, (v, dtype) in enumerate(zip(invars, original_dtypes, strict=True)):
            v = cast_if_float(dtype, v)
            if not jnp.issubdtype(jnp.result_type(v), jnp.floating):
                out.append(v)
                continue
            contracted, free = axes[i]
            prim_name = getattr(primitive, "name", primitive)
            where = f"its contracted axis {contracted}" if contracted is not None else "the format's axis"
            try:
                # A contraction's operand: the format aimed at it (blocks along the contracted axis,
                # per-channel scales along a free one); otherwise the format as given.
                fmt = self.fmt.aim(contracted, free) if contracted is not None else self.fmt
                fmt.block_shape(np.shape(v))
            except ValueError as e:
                raise ValueError(
                    f"amp policy {getattr(self.fmt, 'name', self.fmt)} cannot quantize operand {i} of "
                    f"{prim_name} with shape {tuple(np.shape(v))} along {where}: {e} "
                    f"Either pad the model dimension, use a per-tensor format for this operation "
                    f"(e.g. qformats.FP8_E4M3), or key the policy on a jax.named_scope that excludes it."
                ) from e
            out.append(fake_quantize(fmt, v))
        return out, params

    def __call__(self, compute_dtype, original_dtypes, *invars, **bind_params):
        """jaxamp signature: no primitive known, so the format's own axis is used."""
        return self.apply(None, compute_dtype, original_dtypes, list(invars), bind_params)


class BindRule:
    """A policy value that evaluates the equation itself instead of choosing its inputs' precision.

    The walker calls ``bind(primitive, invals, params, out_avals, scopes, sources, site)`` with the
    inputs cast back to the program's dtypes, the ``jax.named_scope`` names around the equation
    (outermost first, for error messages), per input, how many of the walked function's inputs it
    is computed from (0, 1: a weight, 2: two or more, an activation; :mod:`scalify.amp._sources`),
    and the equation's :class:`~scalify.amp._transposes.Site` (which forward contraction a
    backward one transposes); it returns the equation's outputs (a list), with the program's
    output avals. ``scalify.recipes`` is a policy of such rules over this walker.
    """

    def bind(self, primitive, invals, params, out_avals, scopes=(), sources=(), site=None) -> list:
        raise NotImplementedError


def use_format(fmt) -> QuantizeInputs:
    """Policy value quantizing inputs through ``fmt`` (what a bare format in a policy means)."""
    return QuantizeInputs(fmt)


def _is_format(value) -> bool:
    try:
        import qformats as qf
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, qf.ScaledFormat)


def _is_dtype(value) -> bool:
    if isinstance(value, (str, np.dtype, type)):
        try:
            return jnp.issubdtype(jnp.dtype(value), jnp.inexact)
        except TypeError:
            return False
    return False


def as_precision_fn(value):
    """Normalise a policy value: a callable is kept, a dtype becomes :func:`use_precision`, a format
    becomes :class:`QuantizeInputs`, ``None`` means original precision."""
    if value is None:
        return use_original_precision
    if _is_format(value):
        return QuantizeInputs(value)
    if isinstance(value, (QuantizeInputs, BindRule)) or (callable(value) and not isinstance(value, type)):
        return value
    if _is_dtype(value):
        return use_precision(value)
    raise TypeError(
        f"amp_policy values must be precision functions, floating dtypes or qformats formats; got {value!r}."
    )


MATMUL_PRIMITIVES = (lax.dot_general_p, lax.conv_general_dilated_p)

LOW_PRECISION_PRIMITIVES = (lax.add_p, lax.sub_p, *MATMUL_PRIMITIVES)
"""Primitives the default policy runs in ``compute_dtype`` (jaxamp's list)."""

HIGH_PRECISION_PRIMITIVES = (lax.exp_p, lax.log_p, lax.mul_p, lax.div_p)
"""Primitives the default policy runs in float32 whatever ``compute_dtype`` is (jaxamp's list)."""

default_amp_policy: Mapping[Any, Any] = {
    **{p: use_compute_precision for p in LOW_PRECISION_PRIMITIVES},
    **{p: use_precision(jnp.float32) for p in HIGH_PRECISION_PRIMITIVES},
    **{s: use_original_precision for s in STOP_SCOPES},
}
"""jaxamp's default policy: ``add``, ``sub``, ``dot_general`` and ``conv_general_dilated`` in
``compute_dtype``; ``exp``, ``log``, ``mul`` and ``div`` in float32; everything else (reductions,
comparisons, ``max``, ``tanh``, ...) in the precision the program gave it."""

matmul_amp_policy: Mapping[Any, Any] = {
    **{p: use_compute_precision for p in MATMUL_PRIMITIVES},
    **{s: use_original_precision for s in STOP_SCOPES},
}
"""Only matmul-like primitives in ``compute_dtype``; elementwise ops, reductions, normalisations and
the loss keep the program's precision (scalify's default before jaxamp parity)."""
