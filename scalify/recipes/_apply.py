"""``apply(fn, recipe)``: the recipe as a rule table over amp's jaxpr walker.

Every floating ``dot_general`` and ``conv_general_dilated`` of ``fn`` (inside nested ``jit``,
``scan``, ``while``, ``cond``, ``checkpoint`` and custom derivative rules too) is replaced by
:func:`scalify.recipes._gemm.recipe_contraction`, whose custom VJP runs the backward GEMMs under
the recipe; every grouped GEMM (``ragged_dot_general``) by
:func:`scalify.recipes._grouped.grouped_contraction`, which does so one group at a time.
Contractions under ``amp_stop`` or a scope named in ``recipe.high_precision_scopes`` keep the
program's precision, and so do products of two activations under ``recipe.weights_only``.
A gradient taken inside ``fn`` reaches the walker as contractions of its own; each is paired with
its forward contraction (:mod:`scalify.amp._transposes`) and runs as its dgrad or wgrad GEMM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify.amp._interpreter import amp
from scalify.amp._policy import BindRule, use_original_precision
from scalify.recipes import _grouped
from scalify.recipes._builtins import get_recipe
from scalify.recipes._gemm import Contraction, recipe_contraction, transposed_operands
from scalify.recipes._recipe import Recipe


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


class Quantized(NamedTuple):
    """What the recipe made of a forward contraction: ``op(x, w)`` with the weight as the rhs;
    ``unswap``: the permutation taking ``op``'s output to the program's, when the program bound the
    weight first (``None`` otherwise). ``op`` is recorded without ``out_sharding``: it names the
    axes the backward GEMMs quantize along and is compared, never bound."""

    op: Contraction
    unswap: tuple[int, ...] | None
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]


class RecipeContraction(BindRule):
    """Binds a contraction as :func:`recipe_contraction` under ``recipe``; a backward contraction
    of a gradient taken inside the walked function as its forward's dgrad or wgrad GEMM."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def __repr__(self):
        return f"RecipeContraction({self.recipe.name!r})"

    def bind(self, primitive, invals, params, out_avals, scopes=(), sources=(), site=None):
        if _grouped_conv(primitive, params):
            # A grouped (depthwise) convolution, and its gradients, which JAX also writes as grouped
            # convolutions: no linear layer's GEMM (torchao and TE convert linear layers only).
            return [primitive.bind(*invals, **params)]
        paired = None if site is None else site.resolve(_backward_gemm)
        if paired is not None:
            return [self._backward(primitive, invals, params, out_avals, scopes, *paired)]
        y, decision = self._forward(primitive, invals, params, out_avals, scopes, sources, site)
        if site is not None:
            site.decide(decision)
        return [y]

    def _forward(self, primitive, invals, params, out_avals, scopes, sources, site=None):
        """The forward contraction and what the recipe made of it (``None``: the program's precision)."""
        x, w, *rest = invals  # rest: a grouped GEMM's group sizes
        plain = lambda: (primitive.bind(*invals, **params), None)
        if not (_is_float(x) and _is_float(w)):
            return plain()
        if self.recipe.weights_only and sources and 1 not in sources:
            # No operand is a weight (both mix inputs, or one is a constant): not a linear layer.
            return plain()
        if self.recipe.weights_only and _times_a_vector(primitive, params, x.ndim, w.ndim):
            # A weight times a vector (a spectral norm's power iteration, W v and u W) is no linear
            # layer's GEMM either: its operand has no token axis to block or scale over.
            return plain()
        op = Contraction(primitive, tuple(sorted(params.items())))
        grouped = primitive is _grouped.RAGGED_DOT
        aims = _grouped.Expert.of(op, x.ndim).aims(x.ndim, w.ndim) if grouped else op.aims(x.ndim, w.ndim)
        if math.prod(x.shape[a] for a in aims["fwd_lhs"].contracted) == 1:
            # An outer product (rotary embeddings' positions x frequencies, also written as a matmul
            # summing over one element) is no GEMM of a linear layer; its gradients are reductions
            # against a vector. All three keep the program's precision.
            return plain()
        if not (aims["fwd_lhs"].free or aims["fwd_rhs"].free):
            # An inner product (a sampler's kinetic energy v.p, a U-turn criterion, a squared norm;
            # batched or not) multiplies no matrix: no linear layer's GEMM, as an outer product is not.
            return plain()
        unswap = None
        if _weight_first(primitive, params, sources, site):
            # The weight came first (jnp.einsum orders operands as it finds cheapest): bind the
            # weight as the rhs, so its roles (2-D tiles, the weight gradient) are the weight's.
            params, unswap = _rhs_first(params, x.ndim, w.ndim)
            x, w = w, x
        op = Contraction(primitive, tuple(sorted(params.items())))
        out_dtype = self.recipe.out_dtype or out_avals[0].dtype
        contraction = _grouped.grouped_contraction if grouped else recipe_contraction
        y = contraction(self.recipe, op, out_dtype, tuple(scopes), x, w, *rest).astype(out_avals[0].dtype)
        if unswap is not None:
            y = jnp.transpose(y, unswap)
        # The backward GEMMs read the axes, shapes and the weight's side of the decision, not where
        # the output is placed: a contraction JAX's transposition binds with pmap's out_sharding and
        # a forward one without it, both quantized alike, are one outcome to the pairing.
        axes_only = Contraction(primitive, tuple((k, v) for k, v in op.params if k != "out_sharding"))
        return y, Quantized(axes_only, unswap, x.shape, w.shape)

    def _backward(self, primitive, invals, params, out_avals, scopes, partner, decision):
        """A contraction JAX's transposition emitted for ``partner``: the dgrad or wgrad GEMM of the
        forward's recipe, on the program's own operands (the gradient was taken inside the walked
        function, so the forward's custom VJP never runs). Kept in the program's precision where
        the forward was."""
        if decision is None:
            return primitive.bind(*invals, **params)
        g, r, rest = invals[1 - partner.residual], invals[partner.residual], invals[2:]
        gemm = _gemm_of(partner, decision)
        if self.recipe.out_dtype is not None:  # the custom VJP's cotangent is that of the rounded output
            g = g.astype(self.recipe.out_dtype)
        if decision.unswap is not None:  # dy in the layout of the contraction the recipe ran
            g = jnp.transpose(g, tuple(int(a) for a in np.argsort(decision.unswap)))
        # A convolution's input gradient reads its kernel reversed: quantize the kernel itself (its
        # stochastic rounding draws by position), then reverse it as the program does.
        spatial = _kernel_spatial_axes(decision.op) if partner.residual == 1 else ()
        r = lax.rev(r, spatial) if spatial else r
        if decision.op.primitive is _grouped.RAGGED_DOT:
            gq, rq = _grouped.transposed_operands(
                self.recipe, decision.op, gemm, tuple(scopes), decision.x_shape, decision.w_shape, g, r, *rest
            )
            if gemm == "wgrad":  # JAX's ragged_dot_general(x, dy) over each group's rows, laid out by group
                return _grouped.by_group_contraction(params, rq, gq).astype(out_avals[0].dtype)
        else:
            gq, rq = transposed_operands(
                self.recipe, decision.op, gemm, tuple(scopes), decision.x_shape, decision.w_shape, g, r
            )
        rq = lax.rev(rq, spatial) if spatial else rq
        if decision.unswap is not None:
            gq = jnp.transpose(gq, decision.unswap)
        operands = (gq, rq) if partner.residual == 1 else (rq, gq)
        op = Contraction(primitive, tuple(sorted(params.items())))
        return op.emulated(*operands, *rest).astype(out_avals[0].dtype)


def _gemm_of(partner, decision) -> str:
    """``"dgrad"`` or ``"wgrad"``: the backward GEMM a contraction paired with ``partner`` is. The
    walker's weight is the program's rhs, or its lhs when it bound the weight first."""
    weight = 0 if decision.unswap is not None else 1
    return "wgrad" if partner.grad_of == weight else "dgrad"


def _backward_gemm(partner, decision):
    """What :meth:`RecipeContraction._backward` computes for a backward ``dot_general`` paired with
    ``partner``: the GEMM, the roles' axes (as :func:`transposed_operands` quantizes along them),
    the weight's side and which operand is the residual. The operands it quantizes are the
    backward's own (the forward's shapes name them in an error message only). Convolutions and
    grouped GEMMs read more of the forward (kernel reversal, group layout): their whole decision."""
    if decision.op.primitive is not lax.dot_general_p:
        return decision, partner.residual, partner.grad_of
    gemm = _gemm_of(partner, decision)
    aims = decision.op.aims(len(decision.x_shape), len(decision.w_shape))
    return gemm, aims[f"{gemm}_lhs"], aims[f"{gemm}_rhs"], decision.unswap, partner.residual


def _weight_first(primitive, params, sources, site) -> bool:
    """Whether a ``dot_general``'s lhs is its weight: computed from one input while the rhs mixes
    several, and not taken as an activation by an earlier contraction (a sampler's data, read at
    the first position's gradient, then times a position that mixes the first and the momentum)."""
    if primitive is not lax.dot_general_p or params.get("out_sharding") is not None:
        return False
    return tuple(sources) == (1, 2) and (site is None or not site.taken_as_activation(0))


def _times_a_vector(primitive, params, lhs_ndim: int, rhs_ndim: int) -> bool:
    """Whether a ``dot_general`` has an operand with no free axis (every axis summed or batch): a
    matrix-vector or vector-vector product."""
    if primitive is not lax.dot_general_p:
        return False
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    return len(lc) + len(lb) == lhs_ndim or len(rc) + len(rb) == rhs_ndim


def _grouped_conv(primitive, params) -> bool:
    return primitive is lax.conv_general_dilated_p and (
        params["feature_group_count"] > 1 or params["batch_group_count"] > 1
    )


def _kernel_spatial_axes(op) -> tuple[int, ...]:
    """The spatial axes of the forward convolution ``op``'s kernel (which its input gradient
    reverses); ``()`` for a ``dot_general``."""
    if op.primitive is not lax.conv_general_dilated_p:
        return ()
    return tuple(dict(op.params)["dimension_numbers"].rhs_spec[2:])


def _rhs_first(params, lhs_ndim: int, rhs_ndim: int):
    """``dot_general(rhs, lhs)``'s params for ``dot_general(lhs, rhs, **params)``, and the
    permutation taking its output (batch, rhs free, lhs free) to the original's (batch, lhs free,
    rhs free)."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    nb = len(lb)
    lf, rf = lhs_ndim - len(lc) - nb, rhs_ndim - len(rc) - nb
    swapped = {**params, "dimension_numbers": ((rc, lc), (rb, lb))}
    if isinstance(params.get("precision"), tuple):
        swapped["precision"] = params["precision"][::-1]
    return swapped, (*range(nb), *range(nb + rf, nb + rf + lf), *range(nb, nb + rf))


def policy(recipe: Recipe) -> dict:
    """The amp policy that applies ``recipe``."""
    rule = RecipeContraction(recipe)
    out = {lax.dot_general_p: rule, lax.conv_general_dilated_p: rule}
    if _grouped.RAGGED_DOT is not None:  # a grouped GEMM, on the JAX versions that have it
        out[_grouped.RAGGED_DOT] = rule
    out.update({scope: use_original_precision for scope in recipe.high_precision_scopes})
    return out


def apply(fn: Callable, recipe: Recipe | str) -> Callable:
    """``fn`` with every contraction, and its gradients under ``jax.grad``, run under ``recipe``.

    Args:
      fn: an unchanged JAX function: a model's loss, whose gradient is then taken
        (``jax.grad(apply(loss, recipe))``: the recipe replaces forward contractions with ones whose
        custom VJP quantizes the backward GEMMs' operands), or a training step that takes the
        gradient inside (``apply(train_step, recipe)``: each backward contraction JAX's
        transposition emitted is paired with its forward one and runs in the same roles).
      recipe: a :class:`Recipe` or a built-in recipe's name (``"mxfp8"``, ``"float8_rowwise"``, ...).

    Returns:
      A function with ``fn``'s signature and output dtypes. Each GEMM is emulated as one float32
      contraction of the quantized-then-dequantized operands.
    """
    recipe = get_recipe(recipe)
    return amp(fn, compute_dtype=jnp.float32, amp_policy=policy(recipe))
