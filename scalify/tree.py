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

from scalify._scaled_array import is_scaled_leaf

__all__ = ["all", "astype", "flatten", "leaves", "map", "structure", "unflatten"]


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
