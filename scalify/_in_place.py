"""Functions that update their arguments in place (flax NNX) under scalify's transformations.

A flax NNX training step changes its model, optimizer and metrics in place
(``optimizer.update(model, grads)``, ``metrics.update(...)``, BatchNorm's running statistics,
``Rngs`` counters). ``scalify``, ``amp`` and ``recipes.apply`` trace a function on copies of its
arguments rebuilt from tracers, so such updates would stay on the copies and the caller's model
would silently not train. :func:`lift_in_place` carries them out the way flax's own transformations
(``nnx.jit``) do, through NNX's public functional API:

    graphdef, state = nnx.split(nodes)          # the graph nodes among the arguments
    out, state' = transform(step)(state, rest)  # step: nnx.merge, call fun, nnx.state of the nodes
    nnx.update(nodes, state')                   # the caller's nodes now hold the new state

``state`` is an ordinary pytree, so ScaledArray parameters inside ``nnx.Param`` s reach the
transformation as they are. Flax is never imported here: a program that passes NNX modules has
imported it already.
"""

from __future__ import annotations

import sys

import jax

from scalify._scaled_array import is_scaled_leaf


def _nnx_nodes(tree):
    """``(nnx, leaves, treedef, node_index)``: the leaves of ``tree`` down to NNX graph nodes, and
    where the nodes are among them; ``nnx`` is None when flax.nnx is not loaded.

    Plain Variables count as leaves, not nodes: they are what ``nnx.split`` returns, so a lifted
    step's state is not split again. (A plain Variable passed on its own is traced as the value it
    holds; pass the module that owns it to have its updates carried out.) A hijax Variable is a
    node: it is a leaf of its own to JAX, so only lifting reaches the value inside it."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None, None, None, ()

    def is_node(x):
        if isinstance(x, nnx.Variable):
            return x.hijax
        # flax counts a mutable array (a Variable's value in ``ref=True`` mode) as a graph node; it
        # is a leaf here, which the walker reads and writes through the ref primitives.
        return nnx.graph.is_graph_node(x) and not (
            isinstance(x, jax.ref.Ref | jax.core.Tracer) and isinstance(jax.typeof(x), jax.ref.AbstractRef)
        )

    # A ScaledArray among the other arguments (a quantized batch) stays one leaf, so that the
    # transformation traces it as the logical array it stands for.
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: is_scaled_leaf(x) or is_node(x))
    return nnx, leaves, treedef, tuple(i for i, x in enumerate(leaves) if is_node(x))


def holds_graph_nodes(tree) -> bool:
    """Whether ``tree`` (a function's ``(args, kwargs)``) holds NNX modules, optimizers, metrics,
    Rngs or hijax Variables."""
    return bool(_nnx_nodes(tree)[3])


def lift_in_place(transform, fun, args, kwargs):
    """``transform(fun)(*args, **kwargs)``, with the in-place updates ``fun`` makes to the NNX graph
    nodes among the arguments written back to the caller's nodes.

    ``transform`` maps a function to its transformed version (``scalify``, ``lambda f: amp(f, ...)``).
    The nodes are split together, so a module shared by two arguments stays one module.

    hijax Variables (``nnx.var_defaults(hijax=True)``) are JAX leaves of their own, so the values
    inside them (a ScaledArray among them) would reach ``transform`` as constants. They are traced
    as plain Variables holding the same values, and made hijax again inside the traced step, where
    its code (a loss that captures them and updates them under ``jax.grad``) sees them as it would
    under ``jax.jit``; the transformations lower them to the arrays they hold before interpreting.
    """
    nnx, leaves, treedef, at = _nnx_nodes((args, kwargs))
    nodes = tuple(leaves[i] for i in at)
    # Graph mode whatever flax's global default: it keeps a Variable shared by two modules one
    # Variable (tree mode refuses such programs, which nnx.jit(graph=True) accepts).
    graphdef, state = nnx.split(nodes, graph=True)
    hijax = frozenset(path for path, v in state.flat_state() if v.hijax)
    if hijax:
        state = nnx.with_vars(state, hijax=False)
    rest = [None if i in at else x for i, x in enumerate(leaves)]

    def on_state(state, rest):
        merged = nnx.merge(graphdef, state)
        if hijax:
            merged = nnx.with_vars(merged, hijax=True, only=lambda path, _: path in hijax)
        full = list(rest)
        for i, node in zip(at, merged, strict=True):
            full[i] = node
        a, k = treedef.unflatten(full)
        out = fun(*a, **k)
        new_state = nnx.state(merged, graph=True)
        return out, nnx.with_vars(new_state, hijax=False) if hijax else new_state

    out, new_state = transform(on_state)(state, rest)
    nnx.update(nodes, new_state)
    return out
