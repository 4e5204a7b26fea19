"""Explicit scaled operations (the seed's ``jsa.ops``), usable inside and outside ``scalify``.

* ``dynamic_rescale_{max,l1,l2}``: pick a new scale from the data's norm (per block) so that the data
  is O(1) again. ``_grad`` twins are the identity forward and rescale the gradient backward.
  On plain arrays they return their input unchanged.
* ``cast_ml_dtype`` / ``cast_ml_dtype_grad``: round the data to a narrower ml_dtype (e.g.
  ``float8_e4m3fn``, saturating to its max), keeping the scale.
* ``quantize(x, fmt)``: change format inside a program; ``dequantize(x)``: back to a plain array.
* ``debug_scale_stats(x, name)``: record (and optionally print) the scale statistics of ``x``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import qformats as qf
from scalify._config import pow2_round
from scalify._jax_compat import define_elementwise_primitive, is_tracer
from scalify._registry import register_rule
from scalify._rules_common import F32, safe_scale
from scalify._scaled_array import ScaledArray, as_scaled_array, block_of, expand_scale, to_carrier

__all__ = [
    "cast_ml_dtype",
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
    dtype = np.dtype(dtype)
    x = jnp.asarray(x)
    info = ml_dtypes.finfo(dtype)
    m = float(info.max)
    return jnp.clip(x, -m, m).astype(dtype).astype(x.dtype)


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
