"""Scaling primitives for user programs (jax-scalify's public ``jsa.lax`` names).

Outside ``scalify`` they are the identity (``stop_scaling`` may cast; ``get_data_scale`` pairs the
array with a scale of 1). Under ``scalify`` they read or set the scale of a ScaledArray:

* ``set_scaling(x, s)``: the value of ``x`` with scale ``s``: ``data = x / s`` (0 where ``s = 0``).
* ``stop_scaling(x, dtype)``: the plain value ``data * scale``, cast to ``dtype``.
* ``get_data_scale(x)``: ``(data, scale)``.
* ``rebalance(x, r)``: ``set_scaling(x, scale * r)``: data / r, scale * r, value unchanged.

jax-scalify's per-primitive ``scaled_*`` implementations are not provided: ``scalify(f)`` applies
the rule table to every primitive of ``f``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scalify._config import get_config
from scalify._jax_compat import Primitive, ad, batching, is_tracer, mlir
from scalify._registry import register_rule
from scalify._scaled_array import ScaledArray

__all__ = ["get_data_scale", "rebalance", "set_scaling", "stop_scaling"]


def _xp(*xs):
    """NumPy when every operand is a NumPy value (eager, no device transfer), else jax.numpy."""
    return np if all(isinstance(x, (np.ndarray, np.generic, float, int)) for x in xs) else jnp


def _value(x):
    return x.to_array() if isinstance(x, ScaledArray) else x


def _set_scaling(values, scale):
    """``values`` (plain or scaled) re-expressed with the scalar scale ``scale``."""
    scale = _value(scale)
    if np.ndim(scale) != 0:
        raise ValueError(f"set_scaling expects a scalar scale, got shape {np.shape(scale)}.")
    if isinstance(values, ScaledArray):
        data, old = values.data, values.scale
    else:
        data, old = values, np.float32(1)
    xp = _xp(data, old, scale)
    wide = np.promote_types(np.promote_types(data.dtype, np.float32), np.result_type(getattr(scale, "dtype", scale)))
    s = xp.asarray(scale, wide)
    ratio = xp.where(s == 0, xp.zeros((), wide), xp.asarray(old, wide) / xp.where(s == 0, 1, s))
    return ScaledArray((xp.asarray(data, wide) * ratio).astype(data.dtype), scale)


# -- set_scaling ------------------------------------------------------------------------------------
set_scaling_p = Primitive("scalify_set_scaling")
set_scaling_p.def_impl(lambda values, scale: values)
set_scaling_p.def_abstract_eval(lambda values, scale: values)
mlir.register_lowering(set_scaling_p, mlir.lower_fun(lambda values, scale: values, multiple_results=False))
ad.primitive_jvps[set_scaling_p] = lambda primals, tangents: (
    set_scaling_p.bind(*primals),
    ad.instantiate_zeros(tangents[0]),
)
batching.primitive_batchers[set_scaling_p] = lambda args, dims: (args[0], dims[0])


@register_rule(set_scaling_p, "scaled-op", "data * (scale / s), scale s (s = 0: data 0).", always=True)
def _set_scaling_rule(eqn, values, scale):
    s = jnp.asarray(_value(scale), jnp.float32)
    return _set_scaling(values, s)


def set_scaling(values, scale):
    """The value of ``values`` with scale ``scale`` (a scalar) under ``scalify``; identity outside."""
    if isinstance(values, ScaledArray):
        return _set_scaling(values, scale)
    if is_tracer(values) or is_tracer(_value(scale)):
        return set_scaling_p.bind(values, _value(scale))
    return values


# -- stop_scaling -----------------------------------------------------------------------------------
def _cast(x, dtype):
    return x if dtype is None else x.astype(dtype)


stop_scaling_p = Primitive("scalify_stop_scaling")
stop_scaling_p.def_impl(lambda values, *, dtype: _cast(values, dtype))
stop_scaling_p.def_abstract_eval(lambda values, *, dtype: values.update(dtype=np.dtype(dtype or values.dtype)))
mlir.register_lowering(
    stop_scaling_p, mlir.lower_fun(lambda values, *, dtype: _cast(values, dtype), multiple_results=False)
)
ad.primitive_jvps[stop_scaling_p] = lambda primals, tangents, *, dtype: (
    stop_scaling_p.bind(*primals, dtype=dtype),
    _cast(ad.instantiate_zeros(tangents[0]), dtype),
)
batching.primitive_batchers[stop_scaling_p] = lambda args, dims, *, dtype: (_cast(args[0], dtype), dims[0])

register_rule(stop_scaling_p, "scaled-op", "plain value data * scale, cast to dtype (leaves scaled arithmetic).")(
    lambda eqn, values: values.to_array(eqn.params["dtype"]) if isinstance(values, ScaledArray) else values
)


def stop_scaling(values, dtype=None):
    """The plain value of ``values`` (cast to ``dtype``): under ``scalify``, ``data * scale``."""
    dtype = None if dtype is None else np.dtype(dtype)
    if isinstance(values, ScaledArray):
        return values.to_array(dtype)
    if is_tracer(values):
        return stop_scaling_p.bind(values, dtype=dtype)
    return _cast(values, dtype)


# -- get_data_scale ---------------------------------------------------------------------------------
def _scale_dtype(values):
    return np.dtype(get_config().scale_dtype or values.dtype)


def _plain_data_scale(values, *, scale_dtype):
    return values, jnp.ones((), scale_dtype)


get_data_scale_p = Primitive("scalify_get_data_scale")
get_data_scale_p.multiple_results = True
get_data_scale_p.def_impl(_plain_data_scale)
get_data_scale_p.def_abstract_eval(
    lambda values, *, scale_dtype: [values, jax.core.ShapedArray((), np.dtype(scale_dtype))]
)
mlir.register_lowering(get_data_scale_p, mlir.lower_fun(_plain_data_scale, multiple_results=True))
batching.primitive_batchers[get_data_scale_p] = lambda args, dims, *, scale_dtype: (
    list(_plain_data_scale(args[0], scale_dtype=scale_dtype)),
    [dims[0], batching.not_mapped],
)


@register_rule(get_data_scale_p, "scaled-op", "(data, scale) of the scaled operand (scale cast to the scale dtype).")
def _get_data_scale_rule(eqn, values):
    if not isinstance(values, ScaledArray):
        return list(_plain_data_scale(values, scale_dtype=eqn.params["scale_dtype"]))
    # The traced program expects a scale of `scale_dtype` (ScalifyConfig.scale_dtype, default the
    # array's dtype): cast the float32 carrier scale to it so later equations type-check.
    return [values.data, jnp.asarray(values.scale).astype(eqn.params["scale_dtype"])]


def get_data_scale(values):
    """``(data, scale)`` of a ScaledArray; ``(values, 1)`` for a plain array.

    The scale of a plain array has ``ScalifyConfig.scale_dtype`` (default: the array's dtype).
    """
    if isinstance(values, ScaledArray):
        return values.data, values.scale
    if is_tracer(values):
        return tuple(get_data_scale_p.bind(values, scale_dtype=_scale_dtype(values)))
    return values, np.ones((), _scale_dtype(values))


# -- rebalance --------------------------------------------------------------------------------------
def rebalance(values, rebalance_scale):
    """``set_scaling(values, scale * rebalance_scale)``: data / r, scale * r (value unchanged).

    A no-op on plain arrays outside ``scalify`` (the very object is returned).
    """
    _, scale = get_data_scale(values)
    return set_scaling(values, scale * rebalance_scale)
