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


def _nnx_nodes(tree):
    """``(nnx, leaves, treedef, node_index)``: the leaves of ``tree`` down to NNX graph nodes, and
    where the nodes are among them; ``nnx`` is None when flax.nnx is not loaded.

    Variables count as leaves, not nodes: they are what ``nnx.split`` returns, so a lifted step's
    state is not split again. (A Variable passed on its own is traced as the value it holds; pass
    the module that owns it to have its updates carried out.)"""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None, None, None, ()

    def is_node(x):
        return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)

    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_node)
    return nnx, leaves, treedef, tuple(i for i, x in enumerate(leaves) if is_node(x))


def holds_graph_nodes(tree) -> bool:
    """Whether ``tree`` (a function's ``(args, kwargs)``) holds NNX modules, optimizers, metrics or Rngs."""
    return bool(_nnx_nodes(tree)[3])


def lift_in_place(transform, fun, args, kwargs):
    """``transform(fun)(*args, **kwargs)``, with the in-place updates ``fun`` makes to the NNX graph
    nodes among the arguments written back to the caller's nodes.

    ``transform`` maps a function to its transformed version (``scalify``, ``lambda f: amp(f, ...)``).
    The nodes are split together, so a module shared by two arguments stays one module.
    """
    nnx, leaves, treedef, at = _nnx_nodes((args, kwargs))
    nodes = tuple(leaves[i] for i in at)
    graphdef, state = nnx.split(nodes)
    rest = [None if i in at else x for i, x in enumerate(leaves)]

    def on_state(state, rest):
        merged = nnx.merge(graphdef, state)
        full = list(rest)
        for i, node in zip(at, merged, strict=True):
            full[i] = node
        a, k = treedef.unflatten(full)
        out = fun(*a, **k)
        return out, nnx.state(merged)

    out, new_state = transform(on_state)(state, rest)
    nnx.update(nodes, new_state)
    return out
