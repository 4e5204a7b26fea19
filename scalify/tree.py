"""Pytree helpers that stop at ScaledArrays (jax-scalify's ``jsa.tree``).

``jax.tree`` functions see a ScaledArray as a node with two children (``data``, ``scale``); these
helpers treat it as one leaf, so a map or a cast applies to the logical array.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalify._scaled_array import ScaledArray, is_scaled_leaf

__all__ = ["all", "astype", "flatten", "leaves", "map", "settle_state", "structure", "unflatten"]

# Scale of a zero state leaf rebuilt by settle_state: far below any real value's scale, so the first
# value added to it (a gradient into an optimizer moment) sets the sum's scale.
_ZERO_SCALE = 2.0**-100


def astype(tree: Any, dtype, floating_only: bool = False) -> Any:
    """Cast every leaf (array or ScaledArray) with its ``astype(dtype)``.

    With ``floating_only``, leaves with a non-floating dtype (integer labels, masks) are kept.
    """

    def cast(v):
        if floating_only and not jnp.issubdtype(v.dtype, jnp.floating):
            return v
        return v.astype(dtype)

    return jax.tree.map(cast, tree, is_leaf=is_scaled_leaf)


def all(tree: Any) -> bool:
    """True when every element of every leaf is true (a ScaledArray counts by its value).

    jax-scalify's version recurses into itself; this one is ``builtins.all`` over the leaves, each
    reduced with ``np.all``.
    """
    return builtins.all(bool(np.all(np.asarray(v))) for v in leaves(tree))


def flatten(tree: Any):
    """``(leaves, treedef)`` of ``tree`` with ScaledArrays as leaves (depth-first, left to right)."""
    return jax.tree.flatten(tree, is_leaf=is_scaled_leaf)


def leaves(tree: Any) -> list:
    """Leaves of ``tree`` (arrays and ScaledArrays)."""
    return jax.tree.leaves(tree, is_leaf=is_scaled_leaf)


def map(f: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``f`` applied leaf-wise over ``tree`` and ``rest`` (ScaledArrays passed whole to ``f``)."""
    return jax.tree.map(f, tree, *rest, is_leaf=is_scaled_leaf)


def structure(tree: Any):
    """Treedef of ``tree`` with ScaledArrays as leaves."""
    return jax.tree.structure(tree, is_leaf=is_scaled_leaf)


def unflatten(treedef, leaves_: list) -> Any:
    """Inverse of :func:`flatten`."""
    return jax.tree.unflatten(treedef, leaves_)


def _layout(leaf):
    """What ``jax.jit`` keys a leaf on: the (shape, dtype) of its arrays (data and scale)."""
    return tuple((a.shape, a.dtype) for a in jax.tree.leaves(leaf))


def _rebuild(value, out):
    """``value`` in the layout of ``out`` (a ShapeDtypeStruct or a ScaledArray of them)."""
    if isinstance(value, ScaledArray) and value.fmt is not None:
        return value  # a format's data and scale are not ours to re-express
    if not isinstance(out, ScaledArray):
        plain = value.to_array(out.dtype) if isinstance(value, ScaledArray) else value
        return jnp.asarray(plain, out.dtype)
    if out.fmt is not None:
        return value
    plain = value.to_array() if isinstance(value, ScaledArray) else value
    if not np.any(np.asarray(plain)):
        return ScaledArray(
            jnp.zeros(out.data.shape, out.data.dtype), jnp.full(out.scale.shape, _ZERO_SCALE, out.scale.dtype)
        )
    # scale 1 (data = value), as ``as_scaled_array`` holds a value; the scale grid is the step's
    return ScaledArray(jnp.asarray(plain, out.data.dtype), jnp.ones(out.scale.shape, out.scale.dtype))


def settle_state(step: Callable, state: tuple, *args: Any, max_rounds: int = 3) -> tuple:
    """``state`` with the same values, in the pytree layout that ``step`` returns for it.

    Under ``scalify`` a training step can return its state in another layout than it was given: an
    optimizer moment built with ``zeros_like(params)`` comes back with its gradient's scale grid, a
    carrier parameter on its update's grid, a plain zero as a ScaledArray. ``jax.jit`` keys its cache
    on that layout, so step 2 compiles the step again (and a step that alternates, every step).
    Build the initial state, settle it, then loop::

        # train_step(params, opt_state, x, y) -> (params, opt_state, loss)
        step = jax.jit(scalify.scalify(train_step))
        params, opt_state = scalify.tree.settle_state(step, (params, opt_state), x0, y0)
        for x, y in batches:
            params, opt_state, loss = step(params, opt_state, x, y)   # compiles once

    Contract:
      * ``step(*state, *args)`` returns a tuple (or list) whose first ``len(state)`` items are the new
        state, with the same pytree structure as ``state`` when ScaledArrays count as leaves.
      * The step is only traced (``jax.eval_shape``: no compilation, no device work), up to
        ``max_rounds`` times, until the returned layout is the given one (a fixed point).
      * Each leaf whose layout differs is rebuilt in the returned layout with the same value: a zero
        leaf as zeros with scale ``2**-100`` (so that the first value added to it, a gradient into a
        moment, keeps its own scale), any other leaf with scale 1 (``data = value``, as
        ``scalify.as_scaled_array`` holds it), or as a plain array where the step returns one.
        Leaves whose layout already matches, and leaves held in a qformats format, keep their
        values and layout; NumPy leaves become jax arrays (``jit`` keys them apart).
      * Leaf values must be concrete (call it outside ``jit``): the zero test reads them.

    Returns:
      The settled state, a tuple of ``len(state)`` pytrees. If no fixed point is reached within
      ``max_rounds`` the last state is returned; the step then compiles more than once.

    Raises:
      ValueError: the step returns fewer items than ``state`` or a state of another structure.
    """
    # jit keys a NumPy argument apart from a jax one (as_scaled_array holds a scale as a NumPy
    # scalar, the step returns jax arrays): every leaf becomes a jax array, values unchanged.
    state = jax.device_put(tuple(state))
    for _ in range(max_rounds):
        out = jax.eval_shape(step, *state, *args)
        if not isinstance(out, (tuple, list)) or len(out) < len(state):
            raise ValueError(f"settle_state: the step must return its {len(state)} state items first; got {out!r}")
        out = tuple(out[: len(state)])
        if structure(out) != structure(state):
            raise ValueError(
                "settle_state: the step returns its state with another pytree structure "
                f"({structure(out)} for {structure(state)})"
            )
        if [_layout(v) for v in leaves(out)] == [_layout(v) for v in leaves(state)]:
            break
        state = map(lambda v, o: v if _layout(v) == _layout(o) else _rebuild(v, o), state, out)
    return state
