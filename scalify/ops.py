"""Explicit scaled operations (the seed's ``jsa.ops``), usable inside and outside ``scalify``.

* ``dynamic_rescale_{max,l1,l2}``: pick a new scale from the data's norm (per block) so that the data
  is O(1) again. ``_grad`` twins are the identity forward and rescale the gradient backward.
  On plain arrays they return their input unchanged.
* ``cast_ml_dtype`` / ``cast_ml_dtype_grad``: round the data to a narrower ml_dtype (e.g.
  ``float8_e4m3fn``, saturating to its max), keeping the scale.
* ``quantize(x, fmt)``: change format inside a program; ``dequantize(x)``: back to a plain array.
* ``debug_scale_stats(x, name)``: record (and optionally print) the scale statistics of ``x``.
* jax-scalify's forward/backward maps: ``cast_on_{forward,backward}`` (dtype cast in one pass, identity
  in the other), ``reduce_precision_on_{forward,backward}`` (round to an ml_dtype's precision and
  range, ``lax.reduce_precision``), and ``debug_callback`` / ``debug_print`` with their ``_grad``
  twins (called on the gradients); under ``scalify`` the callbacks receive ScaledArrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import qformats as qf
from qformats._bits import round_to
from scalify._jax_compat import define_elementwise_primitive, is_tracer
from scalify._pow2 import pow2_round
from scalify._registry import register_rule
from scalify._rules_common import F32, safe_scale
from scalify._scaled_array import (
    ScaledArray,
    as_scaled_array,
    block_of,
    expand_scale,
    is_scaled_leaf,
    to_carrier,
)

__all__ = [
    "cast_ml_dtype",
    "cast_on_backward",
    "cast_on_forward",
    "debug_callback",
    "debug_callback_grad",
    "debug_print",
    "debug_print_grad",
    "reduce_precision_on_backward",
    "reduce_precision_on_forward",
    "cast_ml_dtype_grad",
    "debug_scale_stats",
    "dequantize",
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
    "quantize",
    "scale_stats_log",
]


# -- dynamic rescale --------------------------------------------------------------------------------
def _norm_max(d):
    return jnp.max(jnp.abs(d), axis=tuple(range(1, d.ndim, 2)))


def _norm_l1(d):
    return jnp.mean(jnp.abs(d), axis=tuple(range(1, d.ndim, 2)))


def _norm_l2(d):
    """Per-block RMS, computed on ``d / max|d|`` so that squaring tiny (or huge) data cannot
    underflow (overflow): ``rms(d) = m * sqrt(mean((d / m)^2))``."""
    axes = tuple(range(1, d.ndim, 2))
    m = jnp.max(jnp.abs(d), axis=axes, keepdims=True)
    m = jnp.where(m > 0, m, jnp.ones_like(m))
    return jnp.squeeze(m, axes) * jnp.sqrt(jnp.mean(jnp.square(d / m), axis=axes))


_NORMS = {"max": _norm_max, "l1": _norm_l1, "l2": _norm_l2}
_ZERO_NORM = np.float32(2.0**-14)


def _rescale_scaled(x: ScaledArray, norm: str) -> ScaledArray:
    x = to_carrier(x)
    data = x.data.astype(F32)
    block = block_of(tuple(x.scale.shape), tuple(data.shape))
    if data.ndim == 0:
        n = jnp.abs(data)
    else:
        grid = tuple(s // b for s, b in zip(data.shape, block, strict=True))
        inter = [d for pair in zip(grid, block, strict=True) for d in pair]
        n = _NORMS[norm](data.reshape(inter))
        if x.scale.ndim == 0:
            n = n.reshape(())
    # A zero block gets jax-scalify's epsilon 2^-14 (its data stays 0 and its scale is small, not 1).
    n = jnp.where(n > 0, n, jnp.asarray(_ZERO_NORM, F32))
    r = safe_scale(pow2_round(safe_scale(n)))
    new = (data * expand_scale(1.0 / r, data.shape)).astype(x.data.dtype)
    return ScaledArray(new, x.scale * r)


def _make_rescale(norm):
    prim = define_elementwise_primitive(f"dynamic_rescale_{norm}", lambda x: x)

    register_rule(
        prim,
        "scaled-op",
        f"data / 2^k, scale * 2^k with 2^k the {norm} norm of each block's data rounded to a power of two.",
    )(lambda eqn, x: _rescale_scaled(x, norm))

    def op(x):
        if isinstance(x, ScaledArray):
            return _rescale_scaled(x, norm)
        if is_tracer(x):
            return prim.bind(x)
        return x

    op.__name__ = f"dynamic_rescale_{norm}"
    op.__doc__ = (
        f"Rescale a ScaledArray so its data has unit {norm} norm (per block, power-of-two scale). "
        "Identity on plain arrays (inside and outside scalify)."
    )

    @jax.custom_vjp
    def op_grad(x):
        return x

    op_grad.defvjp(lambda x: (x, None), lambda _, g: (op(g),))
    op_grad.__doc__ = f"Identity forward; applies ``dynamic_rescale_{norm}`` to the gradient."
    return prim, op, op_grad


dynamic_rescale_max_p, dynamic_rescale_max, dynamic_rescale_max_grad = _make_rescale("max")
dynamic_rescale_l1_p, dynamic_rescale_l1, dynamic_rescale_l1_grad = _make_rescale("l1")
dynamic_rescale_l2_p, dynamic_rescale_l2, dynamic_rescale_l2_grad = _make_rescale("l2")


# -- cast_ml_dtype ------------------------------------------------------------------------------------
def _round_to(x, dtype):
    """``x`` clipped to ``dtype``'s finite range and rounded to it (nearest, ties to even), in
    ``x``'s dtype.

    A float32 -> bfloat16 or float16 -> float32 round trip is ``qformats._bits.round_to``: XLA may
    drop the ``astype`` round trip (``xla_allow_excess_precision``, on by default), and on CPU its
    reduction fusions do, so ``jnp.sum(cast_ml_dtype(x, bfloat16))`` under ``jit`` summed the
    unrounded ``x``.
    """
    dtype = np.dtype(dtype)
    x = jnp.asarray(x)
    info = ml_dtypes.finfo(dtype)
    m = float(info.max)
    x = jnp.clip(x, -m, m)
    if x.dtype == jnp.float32 and dtype in (jnp.bfloat16, jnp.float16):
        return round_to(x, dtype)
    return x.astype(dtype).astype(x.dtype)


cast_ml_dtype_p = define_elementwise_primitive("cast_ml_dtype", lambda x, *, dtype: _round_to(x, dtype))


def _cast_scaled(x: ScaledArray, dtype) -> ScaledArray:
    x = to_carrier(x)
    return ScaledArray(_round_to(x.data, dtype), x.scale)


register_rule(cast_ml_dtype_p, "scaled-op", "data rounded to the ml_dtype (saturating), scale kept.")(
    lambda eqn, x: _cast_scaled(x, eqn.params["dtype"])
)


def cast_ml_dtype(x, dtype):
    """Round ``x``'s data to ``dtype`` (e.g. ``ml_dtypes.float8_e4m3fn``), keeping dtype and scale.

    Values beyond the ml_dtype's range saturate to its max. On a plain array, rounds the values.
    """
    dtype = np.dtype(dtype)
    if isinstance(x, ScaledArray):
        return _cast_scaled(x, dtype)
    if is_tracer(x):
        return cast_ml_dtype_p.bind(x, dtype=dtype)
    return _round_to(x, dtype)


def cast_ml_dtype_grad(x, dtype):
    """Identity forward; rounds the gradient's data to ``dtype`` backward."""
    dtype = np.dtype(dtype)

    @jax.custom_vjp
    def f(v):
        return v

    f.defvjp(lambda v: (v, None), lambda _, g: (cast_ml_dtype(g, dtype),))
    return f(x)


# -- quantize / dequantize --------------------------------------------------------------------------
def _fake_quant(x, *, fmt):
    x = jnp.asarray(x)
    data, scale = fmt.quantize(x.astype(F32))
    return fmt.dequantize(data, scale, dtype=x.dtype)


quantize_p = define_elementwise_primitive("scalify_quantize", _fake_quant)


def _quantize_any(x, fmt):
    value = x.to_array(F32) if isinstance(x, ScaledArray) else jnp.asarray(x, F32)
    dtype = x.dtype if isinstance(x, ScaledArray) else jnp.asarray(x).dtype
    data, scale = fmt.quantize(value)
    return ScaledArray(data, scale, fmt=fmt, dtype=dtype)


register_rule(
    quantize_p, "scaled-op", "value re-quantized with the format (output in that format).", always=True, raw=True
)(lambda eqn, x: _quantize_any(x, eqn.params["fmt"]))


def quantize(x, fmt):
    """Quantize ``x`` (plain or scaled) with ``fmt`` (a format or registered name).

    Inside ``scalify`` the result is a ScaledArray in ``fmt``; in a plain (non-scalified) traced
    program it is the fake-quantized value (quantize then dequantize).
    """
    if isinstance(fmt, str):
        fmt = qf.get_format(fmt)
    if isinstance(x, ScaledArray):
        return _quantize_any(x, fmt)
    if is_tracer(x):
        return quantize_p.bind(x, fmt=fmt)
    return as_scaled_array(x, fmt=fmt)


dequantize_p = define_elementwise_primitive("scalify_dequantize", lambda x: x)

register_rule(dequantize_p, "scaled-op", "plain value data * scale (explicit dequantization).", raw=True)(
    lambda eqn, x: x.to_array()
)


def dequantize(x):
    """Plain value of ``x``: inside ``scalify`` the explicit way out of scaled arithmetic."""
    if isinstance(x, ScaledArray):
        return x.to_array()
    if is_tracer(x):
        return dequantize_p.bind(x)
    return x


# -- debug ------------------------------------------------------------------------------------------
scale_stats_log: list[dict] = []
"""Records appended by :func:`debug_scale_stats` (name, scale min/max, data absmax, format)."""

_PRINT = {}


def _record(name, fmt_name, smin, smax, amax):
    entry = {
        "name": name,
        "format": fmt_name,
        "scale_min": float(smin),
        "scale_max": float(smax),
        "data_absmax": float(amax),
    }
    scale_stats_log.append(entry)
    if _PRINT.get(name, False):
        print(
            f"[scalify] {name}: format={fmt_name} scale in [{entry['scale_min']:.6g}, "
            f"{entry['scale_max']:.6g}], |data| max {entry['data_absmax']:.6g}"
        )


scale_stats_p = define_elementwise_primitive("scalify_scale_stats", lambda x, *, name: x)


def _stats(x, name):
    fmt_name = x.fmt.name if x.fmt is not None else "carrier"
    c = to_carrier(x)
    jax.debug.callback(
        _record,
        name,
        fmt_name,
        jnp.min(c.scale),
        jnp.max(c.scale),
        jnp.max(jnp.abs(c.data.astype(F32))) if c.data.size else jnp.zeros((), F32),
    )
    return x


register_rule(scale_stats_p, "scaled-op", "records scale statistics with jax.debug.callback; identity.", raw=True)(
    lambda eqn, x: _stats(x, eqn.params["name"])
)


def debug_scale_stats(x, name: str = "tensor", *, print_stats: bool = True):
    """Record the scale statistics of ``x`` (a ScaledArray inside scalify) and return ``x``.

    Each call appends ``{"name", "format", "scale_min", "scale_max", "data_absmax"}`` to
    :data:`scale_stats_log` at run time (works under jit) and prints it when ``print_stats``.
    Plain arrays are returned unchanged and not recorded.
    """
    _PRINT[name] = print_stats
    if isinstance(x, ScaledArray):
        return _stats(x, name)
    if is_tracer(x):
        return scale_stats_p.bind(x, name=name)
    return x


# -- forward / backward maps (jax-scalify) ----------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _on_forward(f, x):
    return f(x)


_on_forward.defvjp(lambda f, x: (f(x), None), lambda f, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _on_backward(f, x):
    return x


_on_backward.defvjp(lambda f, x: (x, None), lambda f, _, g: (f(g),))


def _reduce_precision(x, dtype):
    info = ml_dtypes.finfo(np.dtype(dtype))
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _convert(dtype):
    return lambda v: jax.lax.convert_element_type(v, np.dtype(dtype))


def cast_on_forward(x, dtype):
    """``x`` cast to ``dtype`` forward; the gradient passes through unchanged (not cast)."""
    return _on_forward(_convert(dtype), x)


def cast_on_backward(x, dtype):
    """``x`` unchanged forward; its gradient is cast to ``dtype``."""
    return _on_backward(_convert(dtype), x)


def reduce_precision_on_forward(x, dtype):
    """``x`` rounded to ``dtype``'s precision and range (``lax.reduce_precision``, dtype kept) forward;
    identity backward. Under ``scalify`` the data is rounded and the scale kept."""
    return _on_forward(functools.partial(_reduce_precision, dtype=dtype), x)


def reduce_precision_on_backward(x, dtype):
    """Identity forward; the gradient is rounded to ``dtype``'s precision and range."""
    return _on_backward(functools.partial(_reduce_precision, dtype=dtype), x)


# -- debug callbacks ---------------------------------------------------------------------------------
class _HostCallback:
    """The user's callback and the pytree of its arguments, with ScaledArrays as leaves.

    ``jax.debug.callback`` traces the call into a ``debug_callback`` equation that flattens
    ScaledArrays into their logical arrays; under ``scalify`` the rule below finds this object in
    the equation's callback and calls it with the ScaledArrays themselves.
    """

    def __init__(self, fn, treedef):
        self.fn, self.treedef = fn, treedef

    def __call__(self, *leaves):
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        self.fn(*args, **kwargs)


def debug_callback(callback, *args, ordered: bool = False, **kwargs):
    """``jax.debug.callback(callback, *args, **kwargs)`` that hands ScaledArrays to ``callback``
    (inside ``scalify`` too). Returns None."""
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_scaled_leaf)
    jax.debug.callback(_HostCallback(callback, treedef), *leaves, ordered=ordered)


def _host_callback_of(flat_callback):
    """The ``_HostCallback`` that JAX's flat debug callback wraps (found in its closure), or None."""
    for cell in getattr(flat_callback, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, _HostCallback):
            return value
        inner = _host_callback_of(value) if callable(value) else None
        if inner is not None:
            return inner
    return None


def _traced_primitive(fn):
    """The primitive ``fn`` binds, found by tracing it (no JAX internals imported)."""
    return jax.make_jaxpr(fn)(np.float32(0)).eqns[0].primitive


def _debug_callback_p():
    return _traced_primitive(lambda v: jax.debug.callback(lambda *_: None, v))


def _debug_callback_rule(eqn, *invals):
    host = _host_callback_of(eqn.params["callback"])
    if host is not None:
        # Our debug_callback: the user's callback receives ScaledArrays.
        ordered = "ordered" in str(eqn.params.get("effect", "")).lower()
        jax.debug.callback(host, *invals, ordered=ordered)
    else:
        # jax.debug.callback / jax.debug.print: the callback receives the values.
        _debug_values_rule(eqn, *invals)
    return []


register_rule(
    _debug_callback_p(),
    "scaled-op",
    "host callback: scalify.ops.debug_callback passes ScaledArrays, jax.debug.* passes values.",
    raw=True,
)(_debug_callback_rule)


def _debug_values_rule(eqn, *invals):
    plain = [v.to_array() if isinstance(v, ScaledArray) else v for v in invals]
    return eqn.primitive.bind(*plain, **eqn.params)


_debug_print_p = _traced_primitive(lambda v: jax.debug.print("{}", v))
if _debug_print_p is not _debug_callback_p():
    register_rule(_debug_print_p, "scaled-op", "jax.debug.print: prints the values data * scale.", raw=True)(
        _debug_values_rule
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def debug_callback_grad(f, *args):
    """Identity on ``args`` forward; calls ``f(*gradients)`` on the backward pass."""
    return args


def _dcg_bwd(f, _, grads):
    debug_callback(f, *grads)
    return grads


debug_callback_grad.defvjp(lambda f, *args: (args, None), _dcg_bwd)


def debug_print(fmt: str, *args):
    """Print ``fmt.format(*args)`` at run time (ScaledArrays print as ScaledArrays); returns ``args``."""
    debug_callback(lambda *a: print(fmt.format(*a)), *args)
    return args


def debug_print_grad(fmt: str, *args):
    """Identity forward; prints ``fmt.format(*gradients)`` on the backward pass."""
    return debug_callback_grad(lambda *a: print(fmt.format(*a)), *args)
