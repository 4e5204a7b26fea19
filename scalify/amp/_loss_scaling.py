"""Dynamic loss scaling, with jaxamp's API.

The loss is multiplied by ``state.scaler`` before differentiation, so small gradients survive
float16 backward passes; the gradients (and the value) are divided by it afterwards. A step whose
gradients are not all finite divides the scaler by ``adjust_factor`` (never below ``min_scaler``) and
resets the count; ``patience`` finite steps in a row multiply it by ``adjust_factor`` (never above
``max_scaler``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_FIELDS = ("patience", "adjust_factor", "scaler", "count", "min_scaler", "max_scaler")
_DTYPES = (jnp.int32, jnp.float32, jnp.float32, jnp.int32, jnp.float32, jnp.float32)


@jax.tree_util.register_pytree_node_class
class DynamicScalerState:
    """State of the dynamic loss scaler (a pytree of six scalar arrays).

    Attributes:
      patience: finite steps in a row after which the scaler grows (int32, default 2000).
      adjust_factor: growth / back-off factor (float32, default 2.0).
      scaler: the current loss scale (float32, default 2**15).
      count: finite steps in a row since the scaler last changed (int32, default 0).
      min_scaler: the scaler never drops below this (float32, default 1.0).
      max_scaler: the scaler never grows above this (float32, default 2**24).

    Every field is a pytree leaf, so the bounds survive ``jax.jit``, ``jax.tree.map`` and flattening.
    Positional order matches jaxamp's NamedTuple (``patience, adjust_factor, scaler, count``) with
    the two bounds appended.
    """

    __slots__ = _FIELDS

    def __init__(
        self,
        patience=2000,
        adjust_factor=2.0,
        scaler=2.0**15,
        count=0,
        min_scaler=1.0,
        max_scaler=2.0**24,
    ):
        values = (patience, adjust_factor, scaler, count, min_scaler, max_scaler)
        for name, value, dtype in zip(_FIELDS, values, _DTYPES, strict=True):
            object.__setattr__(self, name, jnp.asarray(value, dtype=dtype))

    def __setattr__(self, name, value):
        raise AttributeError("DynamicScalerState is immutable; use state.replace(field=value).")

    # pytree protocol: unflatten bypasses __init__ so any leaf (tracer, None, object()) round-trips
    def tree_flatten(self):
        return tuple(getattr(self, f) for f in _FIELDS), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        obj = object.__new__(cls)
        for name, value in zip(_FIELDS, children, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    def replace(self, **changes) -> DynamicScalerState:
        """A copy with some fields changed (values are converted to the field's dtype)."""
        unknown = set(changes) - set(_FIELDS)
        if unknown:
            raise TypeError(f"DynamicScalerState has no field(s) {sorted(unknown)}; fields: {_FIELDS}")
        values = {f: getattr(self, f) for f in _FIELDS}
        for name, dtype in zip(_FIELDS, _DTYPES, strict=True):
            if name in changes:
                values[name] = jnp.asarray(changes[name], dtype=dtype)
        return DynamicScalerState.tree_unflatten(None, [values[f] for f in _FIELDS])

    _replace = replace  # NamedTuple spelling, for code written against jaxamp

    def _asdict(self) -> dict:
        return {f: getattr(self, f) for f in _FIELDS}

    def __repr__(self):
        inner = ", ".join(f"{f}={getattr(self, f)}" for f in _FIELDS)
        return f"DynamicScalerState({inner})"


def all_finite(tree) -> jax.Array:
    """True when every floating leaf of ``tree`` is finite (non-floating leaves are ignored)."""
    leaves = [x for x in jax.tree.leaves(tree) if _is_float_array(x)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def _is_float_array(x) -> bool:
    return isinstance(x, (jax.Array, jnp.ndarray)) and jnp.issubdtype(x.dtype, jnp.inexact)


def _as_state(state) -> DynamicScalerState:
    if not isinstance(state, DynamicScalerState):
        raise TypeError(f"dynamic_scaler_state must be a DynamicScalerState, got {type(state).__name__}.")
    # fields may hold Python numbers after tree.map; bring them back to their dtypes
    return DynamicScalerState.tree_unflatten(
        None, [jnp.asarray(getattr(state, f), dtype=d) for f, d in zip(_FIELDS, _DTYPES, strict=True)]
    )


def update_state(state: DynamicScalerState, finite) -> DynamicScalerState:
    """The next state after a step whose gradients were (``finite``) or were not all finite."""
    count = state.count + 1
    grow = count >= state.patience
    grown = jnp.where(grow, jnp.minimum(state.scaler * state.adjust_factor, state.max_scaler), state.scaler)
    shrunk = jnp.maximum(state.scaler / state.adjust_factor, state.min_scaler)
    scaler = jnp.where(finite, grown, shrunk)
    count = jnp.where(finite & ~grow, count, 0).astype(jnp.int32)
    return state.replace(scaler=scaler, count=count)


def _unscale(tree, scaler):
    def one(x):
        if _is_float_array(x):
            return (x.astype(jnp.float32) / scaler).astype(x.dtype)
        return x

    return jax.tree.map(one, tree)


def _scale_value(out, scaler, has_aux):
    value, aux = out if has_aux else (out, None)
    value = value * scaler.astype(jnp.result_type(value))
    return (value, aux) if has_aux else value


def _choose_transform(filter: bool, value_and_grad: bool):
    if filter:
        try:
            import equinox as eqx
        except ImportError:
            eqx = None
        if eqx is not None:
            return eqx.filter_value_and_grad if value_and_grad else eqx.filter_grad
    return jax.value_and_grad if value_and_grad else jax.grad


def _dynamic_scale(fun, *, value_and_grad, has_aux, redo_on_nan, filter, kwargs):
    transform = _choose_transform(filter, value_and_grad)

    def attempt(state, f_args, f_kwargs):
        scaler = state.scaler

        def scaled_fun(*a, **k):
            return _scale_value(fun(*a, **k), scaler, has_aux)

        results = transform(scaled_fun, has_aux=has_aux, **kwargs)(*f_args, **f_kwargs)
        if value_and_grad:
            (value, grads) = results
            if has_aux:
                value, aux = value
                value = _unscale(value, scaler)
                out = ((value, aux), _unscale(grads, scaler))
                checked = (value, out[1])
            else:
                out = (_unscale(value, scaler), _unscale(grads, scaler))
                checked = out
        else:
            if has_aux:
                grads, aux = results
                out = (_unscale(grads, scaler), aux)
                checked = out[0]
            else:
                out = _unscale(results, scaler)
                checked = out
        finite = all_finite(checked)
        return update_state(state, finite), out, finite

    @functools.wraps(fun)
    def scaled_grad_fn(*f_args, dynamic_scaler_state: DynamicScalerState, **f_kwargs):
        state = _as_state(dynamic_scaler_state)
        state, out, finite = attempt(state, f_args, f_kwargs)
        if not redo_on_nan:
            return state, out

        def cond(carry):
            _, _, finite, i = carry
            return jnp.logical_and(jnp.logical_not(finite), i < redo_on_nan)

        def body(carry):
            state, _, _, i = carry
            state, out, finite = attempt(state, f_args, f_kwargs)
            return state, out, finite, i + 1

        state, out, _, _ = lax.while_loop(cond, body, (state, out, finite, jnp.array(0, jnp.int32)))
        return state, out

    return scaled_grad_fn


def dynamic_scale_grad(
    fun: Callable, *, has_aux: bool = False, redo_on_nan: int = 0, filter: bool = True, **kwargs: Any
) -> Callable:
    """``jax.grad`` with dynamic loss scaling.

    Args:
      fun: the function to differentiate; it returns a scalar loss (``(loss, aux)`` with ``has_aux``).
      has_aux: as in ``jax.grad``.
      redo_on_nan: if the gradients are not finite, shrink the scaler and recompute up to this many
        times (inside a ``lax.while_loop``); if they stay non-finite, return them.
      filter: differentiate with ``equinox.filter_grad`` when equinox is installed (so models may hold
        non-array leaves), else ``jax.grad``.
      **kwargs: passed on to the grad transform (e.g. ``argnums`` when ``filter=False``).

    Returns:
      A function taking ``fun``'s arguments plus the keyword argument ``dynamic_scaler_state`` and
      returning ``(next_state, grads)``, or ``(next_state, (grads, aux))`` with ``has_aux``.
    """
    return _dynamic_scale(
        fun, value_and_grad=False, has_aux=has_aux, redo_on_nan=redo_on_nan, filter=filter, kwargs=kwargs
    )


def dynamic_scale_value_and_grad(
    fun: Callable, *, has_aux: bool = False, redo_on_nan: int = 10, filter: bool = True, **kwargs: Any
) -> Callable:
    """``jax.value_and_grad`` with dynamic loss scaling.

    Same arguments as :func:`dynamic_scale_grad` (``redo_on_nan`` defaults to 10, as in jaxamp). The
    returned function takes the keyword argument ``dynamic_scaler_state`` and returns
    ``(next_state, (value, grads))``, or ``(next_state, ((value, aux), grads))`` with ``has_aux``. The
    value is unscaled; it and the gradients are checked for finiteness, the aux is not.
    """
    return _dynamic_scale(
        fun, value_and_grad=True, has_aux=has_aux, redo_on_nan=redo_on_nan, filter=filter, kwargs=kwargs
    )
