"""Dynamic loss scaling, with jaxamp's API and timing.

The loss is multiplied by ``state.scaler`` before differentiation, so small gradients survive
float16 backward passes; the results (gradients, and the value) are divided by it afterwards. Then:

- a step whose checked results are all finite: if ``count >= patience`` the scaler is multiplied by
  ``adjust_factor`` and ``count`` resets to 0, otherwise ``count += 1``. Starting from ``count = 0``
  the scaler therefore grows on the ``patience + 1``-th finite step in a row, as in jaxamp;
- a step with a NaN or Inf: the scaler is divided by ``adjust_factor``, ``count`` resets to 0 and
  ``total_resets += 1``.

The scaler stays within ``[min_scaler, max_scaler]`` (arguments of the transforms; jaxamp had no
bounds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DEFAULT_MIN_SCALER = 1.0
DEFAULT_MAX_SCALER = 2.0**24


class _StateFields(NamedTuple):
    # numpy scalars as defaults: immutable, right dtype, and importing scalify.amp starts no JAX backend
    patience: Any = np.int32(2000)
    adjust_factor: Any = np.float32(2.0)
    scaler: Any = np.float32(2.0**15)
    count: Any = np.int32(0)
    total_resets: Any = np.int32(0)


class DynamicScalerState(_StateFields):
    """State of the dynamic loss scaler: jaxamp's NamedTuple ``(patience, adjust_factor, scaler, count,
    total_resets)``.

    Attributes:
      patience: finite steps to wait before growing the scaler (default 2000).
      adjust_factor: growth / back-off factor (default 2.0).
      scaler: the current loss scale (default 2**15, float32).
      count: finite steps since the scaler last changed (default 0).
      total_resets: how many steps so far had a NaN or Inf (default 0).

    A NamedTuple, so a pytree with five leaves that unpacks positionally
    (``patience, adjust_factor, scaler, count, total_resets = state``) and supports ``_replace``.
    Fields are stored as given (Python numbers are fine); the transforms convert them to int32 /
    float32 (a floating ``scaler`` array keeps its dtype and ``adjust_factor`` follows it).
    """

    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        moved = sorted({"min_scaler", "max_scaler"} & set(kwargs))
        if moved:
            raise TypeError(
                f"DynamicScalerState has no field(s) {moved}: its fields are jaxamp's {cls._fields}. "
                f"Pass the bounds to the transform instead, e.g. dynamic_scale_grad(fun, {moved[0]}=...)."
            )
        return super().__new__(cls, *args, **kwargs)

    def replace(self, **changes) -> DynamicScalerState:
        """A copy with some fields changed (alias of the NamedTuple's ``_replace``)."""
        unknown = sorted(set(changes) - set(self._fields))
        if unknown:
            raise TypeError(f"DynamicScalerState has no field(s) {unknown}; its fields are {self._fields}.")
        return self._replace(**changes)


def all_finite(tree) -> jax.Array:
    """True when every floating leaf of ``tree`` (array or Python float) is finite; others are ignored."""
    leaves = [x for x in jax.tree.leaves(tree) if _is_float_array(x) or isinstance(x, (float, complex))]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def _is_float_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.inexact)


def _as_state(state) -> DynamicScalerState:
    """``state`` with int32 counters and a floating scaler (float32 unless it already is floating)."""
    missing = [f for f in DynamicScalerState._fields if not hasattr(state, f)]
    if missing:
        raise TypeError(
            f"dynamic_scaler_state must be a DynamicScalerState (got {type(state).__name__}, lacking "
            f"{missing}); start from dynamic_scaler_state=DynamicScalerState()."
        )
    scaler = state.scaler
    dtype = scaler.dtype if _is_float_array(scaler) else jnp.float32
    as_int = functools.partial(jnp.asarray, dtype=jnp.int32)
    return DynamicScalerState(
        patience=as_int(state.patience),
        adjust_factor=jnp.asarray(state.adjust_factor, dtype=dtype),
        scaler=jnp.asarray(scaler, dtype=dtype),
        count=as_int(state.count),
        total_resets=as_int(state.total_resets),
    )


def update_state(
    state: DynamicScalerState, finite, *, min_scaler=DEFAULT_MIN_SCALER, max_scaler=DEFAULT_MAX_SCALER
) -> DynamicScalerState:
    """The next state after a step whose results were (``finite``) or were not all finite.

    finite:     count >= patience ? (scaler * f, count = 0) : (scaler, count + 1)
    not finite: (scaler / f, count = 0, total_resets + 1)

    with ``f = adjust_factor`` and the scaler clamped to ``[min_scaler, max_scaler]`` (a scaler
    already outside the bounds is never moved further out, nor pulled in the wrong direction).
    """
    s, f = state.scaler, state.adjust_factor
    grow = state.count >= state.patience
    grown = jnp.where(grow, jnp.minimum(s * f, jnp.maximum(s, max_scaler)), s)
    shrunk = jnp.maximum(s / f, jnp.minimum(s, min_scaler))
    return DynamicScalerState(
        patience=state.patience,
        adjust_factor=f,
        scaler=jnp.where(finite, grown, shrunk).astype(s.dtype),
        count=jnp.where(finite & ~grow, state.count + 1, 0).astype(jnp.int32),
        total_resets=(state.total_resets + jnp.where(finite, 0, 1)).astype(jnp.int32),
    )


# ------------------------------------------------------------------------------------------------
# Scaling and unscaling results
# ------------------------------------------------------------------------------------------------


def _unscale(tree, scaler):
    """Every floating leaf divided by ``scaler`` (in float32 or wider), keeping the leaf's dtype."""

    def one(x):
        if not _is_float_array(x):
            return x
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            return x / scaler.astype(x.dtype)
        # explicit dtype choice: the test suite runs with strict promotion (no float16 -> float32)
        wide = jnp.float64 if max(x.dtype.itemsize, scaler.dtype.itemsize) == 8 else jnp.float32
        return (x.astype(wide) / scaler.astype(wide)).astype(x.dtype)

    return jax.tree.map(one, tree)


def _scale(value, scaler):
    """``value * scaler`` in the value's dtype (so a float16 loss stays float16)."""
    return value * scaler.astype(jnp.result_type(value))


def default_scale_fn(result, state: DynamicScalerState):
    """jaxamp's ``scale_fn``: ``loss -> scaler * loss``; a ``(loss, aux)`` pair scales the loss only."""
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise ValueError(
                f"the function returned a sequence of length {len(result)}; return a scalar loss or a "
                "(loss, aux) pair, or pass your own scale_fn to dynamic_scale_tx."
            )
        value, aux = result
        return _scale(value, state.scaler), aux
    return _scale(result, state.scaler)


def default_unscale_fn(results, state: DynamicScalerState):
    """jaxamp's ``unscale_fn``: every floating leaf of the results divided by ``scaler`` (dtype kept)."""
    return _unscale(results, state.scaler)


def _unscale_grad_aux(results, state):
    grads, aux = results
    return _unscale(grads, state.scaler), aux


def _unscale_value_and_grad_aux(results, state):
    (value, aux), grads = results
    return (_unscale(value, state.scaler), aux), _unscale(grads, state.scaler)


def _drop_grad_aux(results):
    return results[0]


def _drop_value_and_grad_aux(results):
    (value, _), grads = results
    return value, grads


# ------------------------------------------------------------------------------------------------
# Transforms
# ------------------------------------------------------------------------------------------------


def _check_bounds(min_scaler, max_scaler) -> None:
    lo, hi = float(min_scaler), float(max_scaler)
    if not (0.0 <= lo <= hi):
        raise ValueError(
            f"need 0 <= min_scaler <= max_scaler, got min_scaler={lo}, max_scaler={hi}; "
            "use min_scaler=0.0, max_scaler=float('inf') for an unbounded scaler."
        )


def _check_redo(redo_on_nan) -> int:
    if isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, (int, np.integer)) or redo_on_nan < 0:
        raise ValueError(f"redo_on_nan must be an int >= 0 (retries after a NaN/Inf step), got {redo_on_nan!r}.")
    return int(redo_on_nan)


def _scaled(transform, *, redo_on_nan, unscale_fn, scale_fn, checked_fn, min_scaler, max_scaler) -> Callable:
    """The ``scaled_transform(fun, *args, **kwargs)`` shared by all public transforms.

    ``checked_fn`` picks the part of the unscaled results whose finiteness drives the scaler.
    """
    redo_on_nan = _check_redo(redo_on_nan)
    _check_bounds(min_scaler, max_scaler)

    def scaled_transform(fun: Callable, *args, **kwargs) -> Callable:
        def attempt(state, f_args, f_kwargs):
            # the state is closed over (not passed as an argument) so any transform, even one that
            # maps or differentiates keyword arguments, leaves it alone
            def scaled_fun(*a, **k):
                return scale_fn(fun(*a, **k), state)

            results = unscale_fn(transform(scaled_fun, *args, **kwargs)(*f_args, **f_kwargs), state)
            finite = all_finite(checked_fn(results))
            return update_state(state, finite, min_scaler=min_scaler, max_scaler=max_scaler), results, finite

        @functools.wraps(fun)
        def scaled_fn(*f_args, dynamic_scaler_state: DynamicScalerState, **f_kwargs):
            state, results, finite = attempt(_as_state(dynamic_scaler_state), f_args, f_kwargs)
            if not redo_on_nan:
                return state, results

            def cond(carry):
                _, _, finite, i = carry
                return jnp.logical_and(jnp.logical_not(finite), i < redo_on_nan)

            def body(carry):
                state, _, _, i = carry
                state, results, finite = attempt(state, f_args, f_kwargs)
                return state, results, finite, i + 1

            init = (state, results, finite, jnp.array(0, jnp.int32))
            state, results, _, _ = lax.while_loop(cond, body, init)
            return state, results

        return scaled_fn

    return scaled_transform


def dynamic_scale_tx(
    transform: Callable,
    redo_on_nan: int = 0,
    unscale_fn: Callable = default_unscale_fn,
    scale_fn: Callable = default_scale_fn,
    *,
    min_scaler: float = DEFAULT_MIN_SCALER,
    max_scaler: float = DEFAULT_MAX_SCALER,
) -> Callable:
    """Add dynamic loss scaling to a differentiation transform (jaxamp's ``dynamic_scale_tx``).

    ``dynamic_scale_tx(jax.value_and_grad)(fun, has_aux=True)`` behaves like
    ``jax.value_and_grad(fun, has_aux=True)`` except that the result takes the keyword argument
    ``dynamic_scaler_state`` and returns ``(next_state, results)``. Inside, ``transform`` is applied to
    ``fun`` with its output passed through ``scale_fn(output, state)`` (default: the loss times
    ``scaler``); ``unscale_fn(results, state)`` undoes it (default: every floating leaf of the results
    divided by ``scaler``, aux included, so pass your own for an aux that is not scaled). The scaler
    is updated from whether every floating leaf of the unscaled results is finite.

    Args:
      transform: ``jax.grad``, ``jax.value_and_grad``, ``equinox.filter_grad``, ... Called as
        ``transform(scaled_fun, *args, **kwargs)`` with the arguments given after ``fun``.
      redo_on_nan: recompute a non-finite step with the smaller scaler up to this many times (inside a
        ``lax.while_loop``, so the results must be a pytree of arrays).
      unscale_fn, scale_fn: as above, both called with the (normalised) :class:`DynamicScalerState`.
      min_scaler, max_scaler: bounds on the scaler (jaxamp had none: ``0.0`` and ``inf`` reproduce that).
    """
    return _scaled(
        transform,
        redo_on_nan=redo_on_nan,
        unscale_fn=unscale_fn,
        scale_fn=scale_fn,
        checked_fn=lambda results: results,
        min_scaler=min_scaler,
        max_scaler=max_scaler,
    )


def _choose_transform(filter: bool, value_and_grad: bool):
    if filter:
        try:
            import equinox as eqx
        except ImportError:
            eqx = None
        if eqx is not None:
            return eqx.filter_value_and_grad if value_and_grad else eqx.filter_grad
    return jax.value_and_grad if value_and_grad else jax.grad


def _grad_variant(fun, *, value_and_grad, has_aux, redo_on_nan, filter, min_scaler, max_scaler, kwargs):
    if value_and_grad:
        unscale_fn = _unscale_value_and_grad_aux if has_aux else default_unscale_fn
        checked_fn = _drop_value_and_grad_aux if has_aux else (lambda results: results)
    else:
        unscale_fn = _unscale_grad_aux if has_aux else default_unscale_fn
        checked_fn = _drop_grad_aux if has_aux else (lambda results: results)

    def scale_fn(result, state):
        return (_scale(result[0], state.scaler), result[1]) if has_aux else _scale(result, state.scaler)

    scaled_transform = _scaled(
        _choose_transform(filter, value_and_grad),
        redo_on_nan=redo_on_nan,
        unscale_fn=unscale_fn,
        scale_fn=scale_fn,
        checked_fn=checked_fn,
        min_scaler=min_scaler,
        max_scaler=max_scaler,
    )
    return scaled_transform(fun, has_aux=has_aux, **kwargs)


def dynamic_scale_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    min_scaler: float = DEFAULT_MIN_SCALER,
    max_scaler: float = DEFAULT_MAX_SCALER,
    **kwargs: Any,
) -> Callable:
    """``jax.grad`` with dynamic loss scaling.

    Args:
      fun: the function to differentiate; it returns a scalar loss (``(loss, aux)`` with ``has_aux``).
      has_aux: as in ``jax.grad``.
      redo_on_nan: if the gradients are not finite, shrink the scaler and recompute up to this many
        times (inside a ``lax.while_loop``); if they stay non-finite, return them.
      filter: differentiate with ``equinox.filter_grad`` when equinox is installed (so models may hold
        non-array leaves), else ``jax.grad``.
      min_scaler, max_scaler: bounds on the scaler (not in jaxamp; ``0.0`` / ``inf`` remove them).
      **kwargs: passed on to the grad transform (e.g. ``argnums`` when ``filter=False``).

    Returns:
      A function taking ``fun``'s arguments plus the keyword argument ``dynamic_scaler_state`` and
      returning ``(next_state, grads)``, or ``(next_state, (grads, aux))`` with ``has_aux``. Only the
      gradients are checked for finiteness, not the aux.
    """
    return _grad_variant(
        fun,
        value_and_grad=False,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        filter=filter,
        min_scaler=min_scaler,
        max_scaler=max_scaler,
        kwargs=kwargs,
    )


def dynamic_scale_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 10,
    filter: bool = True,
    min_scaler: float = DEFAULT_MIN_SCALER,
    max_scaler: float = DEFAULT_MAX_SCALER,
    **kwargs: Any,
) -> Callable:
    """``jax.value_and_grad`` with dynamic loss scaling.

    Same arguments as :func:`dynamic_scale_grad` (``redo_on_nan`` defaults to 10, as in jaxamp). The
    returned function takes the keyword argument ``dynamic_scaler_state`` and returns
    ``(next_state, (value, grads))``, or ``(next_state, ((value, aux), grads))`` with ``has_aux``. The
    value is unscaled; it and the gradients are checked for finiteness, the aux is not.
    """
    return _grad_variant(
        fun,
        value_and_grad=True,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        filter=filter,
        min_scaler=min_scaler,
        max_scaler=max_scaler,
        kwargs=kwargs,
    )
