"""A grouped GEMM under a recipe: ``lax.ragged_dot``, a mixture of experts' expert bank.

``y = ragged_dot(x, w, sizes)``: the rows (tokens) of ``x`` come in consecutive groups, group
``g`` of ``sizes[g]`` rows, and group ``g``'s rows are multiplied by the expert weight ``w[g]``.
For each group that is a dense linear layer, so each of its three GEMMs runs in the recipe's roles
one group at a time, as a grouped-GEMM kernel and Transformer Engine's ``GroupedLinear`` (which
quantizes each expert's weight and each group of tokens as a tensor of its own) do:

    y_g   = q_fwd(x_g) q_fwd(w[g])                  (x_g, dy_g: group g's rows)
    dx_g  = q_dgrad(dy_g) q_dgrad(w[g])^T
    dw[g] = sum_{m in g} q_wgrad(dy_g)_m q_wgrad(x_g)_m

each operand quantized per group by the dense layer's roles. Blocks along the features never mix
rows, so MX (and row-wise FP8) forward and input-gradient operands are the same as for the whole
tensor; what grouping changes is every statistic over rows or over the tensor: the weight gradient's
blocks, per-channel scales and Hadamard blocks along the tokens start at each group's first row
and stop at its last (zeros pad the rest, which change no amax and add nothing to a sum), and a
tensor-wide scale (float8 tensorwise, NVFP4's second level) is one per group and per expert.

This equals torchao's MXFP8 grouped-GEMM training path with token groups padded to the block
(``pad_token_groups_for_grouped_mm``; tests/recipes/test_torchao_grouped_vectors.py).

Where the forward's rows quantize alone (MX blocks and row-wise scales along the features,
rounded to nearest: :meth:`qformats.ScaledFormat.separable`), a group's rows are the whole
operand's, so the forward's token operand is quantized once. The other token operands are laid out
by group (:func:`by_group`: ``G`` copies of the rows, each zero but for its group's) and quantized
one group at a time. The forward and input-gradient GEMMs are then one
``ragged_dot`` of the dequantized operands; the weight gradient is one dense contraction over all
rows per group: ``G`` times its FLOPs, as JAX's CPU ``ragged_dot`` also spends, but not a native
grouped GEMM (GPU, TPU).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from scalify._jax_compat import lax_primitive
from scalify.recipes._gemm import (
    _F32,
    Contraction,
    _g_digest,
    _like,
    _quantizes_alike,
    backward_operands,
    check_operands,
    quantize_operand,
    rows_alone,
)
from scalify.recipes._recipe import ROLES, Recipe

RAGGED_DOT = lax_primitive("ragged_dot_general")


class Expert(NamedTuple):
    """One group's dense GEMM of a grouped one: ``op`` the ``dot_general`` of ``x``'s rows and one
    expert's weight (``w`` without its group axis ``group``); ``x_axis``, ``y_axis``: the ragged
    axis in ``x`` and in ``y``."""

    op: Contraction
    group: int
    x_axis: int
    y_axis: int

    @classmethod
    def of(cls, op: Contraction, lhs_ndim: int) -> Expert:
        """The expert GEMM of the ``ragged_dot_general`` ``op``, ragged along a free axis of its lhs
        (``lax.ragged_dot``'s mode); raises for the other modes, which no linear layer binds."""
        params = dict(op.params)
        dn = params["ragged_dot_dimension_numbers"]
        (lc, rc), (lb, rb) = dn.dot_dimension_numbers
        (ragged,) = dn.lhs_ragged_dimensions
        if ragged in lc or ragged in lb or params.get("group_offset") is not None:
            where = "a summed" if ragged in lc else "a batch" if ragged in lb else "a free"
            raise ValueError(
                "a recipe runs a grouped GEMM whose groups run along a free axis of the lhs (lax.ragged_dot: "
                f"tokens grouped by expert, all groups); this ragged_dot_general is ragged along {where} axis"
                f"{' with a group_offset' if params.get('group_offset') is not None else ''}. Keep it in the "
                "program's precision with recipe.replace(high_precision_scopes=(NAME,)) around it."
            )
        (group,) = dn.rhs_group_dimensions
        drop = lambda axes: tuple(a - (a > group) for a in axes)
        dims = ((tuple(lc), drop(rc)), (tuple(lb), drop(rb)))
        expert = {"dimension_numbers": dims, "precision": None, "preferred_element_type": None, "out_sharding": None}
        free = [a for a in range(lhs_ndim) if a not in lc and a not in lb]
        op = Contraction(lax.dot_general_p, tuple(sorted(expert.items())))
        return cls(op, group, ragged, len(lb) + free.index(ragged))

    def aims(self, lhs_ndim: int, rhs_ndim: int):
        """Each role's axes in the expert GEMM (the weight without its group axis)."""
        return self.op.aims(lhs_ndim, rhs_ndim - 1)

    def weight_shape(self, shape) -> tuple[int, ...]:
        """One expert's weight shape, from the expert bank's ``shape``."""
        return tuple(n for a, n in enumerate(shape) if a != self.group)


def _starts(sizes):
    """Each group's first row and one past its last, in int32 (a narrow sizes dtype would wrap)."""
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    return ends - sizes.astype(jnp.int32), ends


def by_group(x, axis: int, sizes):
    """``x`` laid out by group along ``axis``, ``[G, *x.shape]``: ``out[g, .., i, ..] = x[.., start_g + i, ..]``
    for ``i < sizes[g]`` and ``start_g + i < M`` (rows past the end belong to no group, as in
    ``ragged_dot``), zero after (``start_g``: the sum of the sizes before ``g``).

    A block along ``axis`` of ``out[g]`` starts at group ``g``'s first row, so it never spans two groups.
    """
    if sizes.ndim != 1:
        raise ValueError(
            f"a recipe's grouped GEMM takes one group size per expert (group_sizes of shape (G,)); got {sizes.shape}"
        )
    m = x.shape[axis]
    starts, ends = _starts(sizes)
    i = jnp.arange(m, dtype=jnp.int32)
    rows = starts[:, None] + i  # [G, M]
    taken = jnp.take(x, jnp.clip(rows, 0, max(m - 1, 0)), axis=axis)  # [.., G, M, ..]
    taken = jnp.moveaxis(taken, axis, 0)
    inside = ((rows < ends[:, None]) & (rows < m)).reshape(
        (sizes.shape[0], *(m if a == axis else 1 for a in range(x.ndim)))
    )
    return jnp.where(inside, taken, jnp.zeros((), taken.dtype))


def from_groups(groups, axis: int, sizes):
    """The inverse of :func:`by_group`: row ``m`` of group ``g`` back at ``start_g + m``; rows past the
    last group are zero (``ragged_dot`` gives them a zero output)."""
    m = groups.shape[axis + 1]
    starts, ends = _starts(sizes)
    row = jnp.arange(m, dtype=jnp.int32)
    gid = jnp.clip(jnp.searchsorted(ends, row, side="right"), 0, sizes.shape[0] - 1)
    picked = jnp.moveaxis(groups, axis + 1, 1)[gid, row - starts[gid]]  # [M, ..]
    return _in_groups(jnp.moveaxis(picked, 0, axis), axis, sizes)


def _in_groups(x, axis: int, sizes):
    """``x`` with its rows past the last group zero (they belong to no group)."""
    rows = jnp.arange(x.shape[axis], dtype=jnp.int32) < _starts(sizes)[1][-1]
    return jnp.where(rows.reshape([-1 if a == axis else 1 for a in range(x.ndim)]), x, jnp.zeros((), x.dtype))


def _per_group(fn, groups, *more):
    """``fn(group's operands..., g)`` for every group ``g`` (the operands' leading axis)."""
    return jax.vmap(fn)(groups, *more, jnp.arange(groups.shape[0]))


def _tokens(recipe: Recipe, role: str, aim, x, axis: int, sizes, source_digest=None):
    """``x`` through the role's format, each group's rows quantized as a tensor of their own (laid
    out by group, :func:`by_group`), back in ``x``'s layout (rows past the last group zero)."""
    quantize = lambda v, g: quantize_operand(recipe, role, v, aim, source_digest, g)
    return from_groups(_per_group(quantize, by_group(x, axis, sizes)), axis, sizes)


def _forward_tokens(recipe: Recipe, role: str, aim, x, axis: int, sizes):
    """:func:`_tokens` of the forward's token operand; quantized once, as a whole, where its rows
    quantize alone (:func:`scalify.recipes._gemm.rows_alone`: MX blocks and row-wise scales along the
    features, rounded to nearest), since a group's rows are then the whole operand's.

    The forward then holds no copy per group. The input gradient's ``dy`` stays laid out by group:
    that layout is the weight gradient's too, and quantizing ``dy`` whole measured more memory (the
    row-wise recipe's step at 32 experts: 680 MiB of XLA temporaries against 556, MXFP8's 560 both).
    """
    if rows_alone(recipe, role, aim, x.shape, axis):
        return _in_groups(quantize_operand(recipe, role, x, aim), axis, sizes)
    return _tokens(recipe, role, aim, x, axis, sizes)


def _experts(fn, w, group: int):
    """``fn(w[g], g)`` for every expert's weight, stacked along ``group`` again."""
    return jax.vmap(fn, in_axes=(group, 0), out_axes=group)(w, jnp.arange(w.shape[group]))


def _check(recipe, expert, roles, x_shape, w_shape, y_shape, scopes):
    """:func:`check_operands` on one group's operands (a group's rows are ``x``'s, padded)."""
    check_operands(recipe, expert.op, roles, x_shape, expert.weight_shape(w_shape), y_shape, scopes, grouped=True)


def _forward(recipe, op, out_dtype, scopes, x, w, sizes):
    """``y = ragged_dot(q_fwd(x_g), q_fwd(w[g]))`` and the quantized weight."""
    expert = Expert.of(op, x.ndim)
    _check(recipe, expert, ROLES[:2], x.shape, w.shape, (), scopes)
    aims = expert.aims(x.ndim, w.ndim)
    xq = _forward_tokens(recipe, "fwd_lhs", aims["fwd_lhs"], x, expert.x_axis, sizes)
    wq = _experts(lambda v, g: quantize_operand(recipe, "fwd_rhs", v, aims["fwd_rhs"], group=g), w, expert.group)
    return op.emulated(xq, wq, sizes).astype(out_dtype), wq


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def grouped_contraction(recipe: Recipe, op: Contraction, out_dtype, scopes: tuple, x, w, sizes):
    """``op(x, w, sizes)`` (a ``ragged_dot_general``) with its value and its gradients under ``recipe``,
    one group at a time (module docstring)."""
    return _forward(recipe, op, out_dtype, scopes, x, w, sizes)[0]


def _fwd(recipe, op, out_dtype, scopes, x, w, sizes):
    """The forward, keeping ``q_fwd(w)`` for the input gradient where its roles quantize alike."""
    y, wq = _forward(recipe, op, out_dtype, scopes, x, w, sizes)
    expert = Expert.of(op, x.ndim)
    aims = expert.aims(x.ndim, w.ndim)
    alike = _quantizes_alike(recipe, ("fwd_rhs", "dgrad_rhs"), aims, expert.weight_shape(w.shape))
    return y, (x, w, wq if alike else None, sizes)


def dgrad_operands(recipe: Recipe, expert: Expert, aims, g32, w, sizes, g_digest, wq=None):
    """The input-gradient GEMM's ``(dy, w)``, quantized per group and per expert, in their own layouts."""
    gq = _tokens(recipe, "dgrad_lhs", aims["dgrad_lhs"], g32, expert.y_axis, sizes, g_digest)
    if wq is None:
        quantize = lambda v, g: quantize_operand(recipe, "dgrad_rhs", v, aims["dgrad_rhs"], group=g)
        wq = _experts(quantize, w, expert.group)
    return gq, wq


def wgrad_operands(recipe: Recipe, expert: Expert, aims, g32, x, sizes, g_digest):
    """The weight-gradient GEMM's ``(dy, x)`` laid out by group (:func:`by_group`), each group's
    rotated and quantized along its own rows (:func:`scalify.recipes._gemm.backward_operands`)."""
    gg, xg = by_group(g32, expert.y_axis, sizes), by_group(x.astype(_F32), expert.x_axis, sizes)
    return _per_group(lambda gv, xv, g: backward_operands(recipe, "wgrad", aims, gv, xv, g_digest, group=g), gg, xg)


def _bwd(recipe, op, out_dtype, scopes, res, g):
    """``dx = ragged_dot(q_dgrad(dy_g), q_dgrad(w[g])^T)`` and ``dw[g] = sum_i q(dy_g)_i q(x_g)_i``."""
    del out_dtype
    x, w, wq_fwd, sizes = res
    expert = Expert.of(op, x.ndim)
    _check(recipe, expert, ROLES[2:], x.shape, w.shape, g.shape, scopes)
    aims = expert.aims(x.ndim, w.ndim)
    g32 = g.astype(_F32)
    g_digest = _g_digest(recipe, g32)
    gq, wq = dgrad_operands(recipe, expert, aims, g32, w, sizes, g_digest, wq_fwd)
    (dx,) = jax.linear_transpose(lambda a: op.emulated(a, wq, sizes), _like(x))(gq)
    gg, xg = wgrad_operands(recipe, expert, aims, g32, x, sizes, g_digest)
    # dw[g] = sum_i dy_g[i] x_g[i]: the transpose in w of every expert's dense GEMM on its rows
    by_expert = lambda b: jax.vmap(expert.op.emulated)(xg, jnp.moveaxis(b, expert.group, 0))
    (dw,) = jax.linear_transpose(by_expert, _like(w))(gg)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


grouped_contraction.defvjp(_fwd, _bwd)


def transposed_operands(recipe: Recipe, op: Contraction, gemm: str, scopes: tuple, x_shape, w_shape, g, r, sizes):
    """The quantized operands of one backward GEMM of the grouped ``op(x, w, sizes)`` that the program
    computes itself (a gradient taken inside the function the recipe is applied to): the input
    gradient's ``(dy, w)`` in their layouts, the weight gradient's ``(dy, x)`` laid out by group."""
    expert = Expert.of(op, len(x_shape))
    _check(recipe, expert, (f"{gemm}_lhs", f"{gemm}_rhs"), x_shape, w_shape, g.shape, scopes)
    aims = expert.aims(len(x_shape), len(w_shape))
    g32 = g.astype(_F32)
    operands = dgrad_operands if gemm == "dgrad" else wgrad_operands
    return operands(recipe, expert, aims, g32, r, sizes, _g_digest(recipe, g32))


def by_group_contraction(params, a_groups, b_groups):
    """The ``ragged_dot_general`` ragged along a summed axis that JAX's transposition emits for a
    grouped GEMM's weight gradient, on operands laid out by group: one dense contraction per group,
    in that primitive's output layout ``[G, batch, lhs free, rhs free]``."""
    dims = params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    hi = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    return jax.vmap(lambda a, b: lax.dot_general(a, b, dims, precision=hi, preferred_element_type=_F32))(
        a_groups, b_groups
    )
