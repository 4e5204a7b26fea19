"""The contraction a recipe puts in place of ``dot_general`` / ``conv_general_dilated``.

Both primitives are bilinear, ``y = f(x, w)``, so their gradients are linear transposes of ``f``
with one operand held fixed:

    y  = f(q_fwd_lhs(x),  q_fwd_rhs(w))
    dx = f(., q_dgrad_rhs(w))^T  q_dgrad_lhs(dy)
    dw = f(q_wgrad_rhs(x), .)^T  q_wgrad_lhs(dy)

where ``q_role`` quantizes and dequantizes through the role's format aimed at the axis that GEMM
sums over. Each GEMM then runs as one float32 contraction of the dequantized operands (the
emulated kernel; exact products, float32 accumulation), and ``jax.custom_vjp`` makes ``jax.grad``
run the two backward GEMMs this way, so the roles are known, not guessed from a jaxpr.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify._jax_compat import explicit_sharding, same_varying
from scalify.recipes._recipe import ROLES, Recipe

_F32 = jnp.dtype(jnp.float32)


class _Aim(NamedTuple):
    """Axes of one GEMM operand: those the GEMM sums over, and the free ones (kept in the output)."""

    contracted: tuple[int, ...]
    free: tuple[int, ...]


def _rest(ndim, *taken):
    used = {a for axes in taken for a in axes}
    return tuple(a for a in range(ndim) if a not in used)


def dot_aims(params, lhs_ndim: int, rhs_ndim: int) -> dict[str, _Aim]:
    """Each role's axes for ``dot_general``; the output is (batch, lhs free, rhs free)."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lf, rf = _rest(lhs_ndim, lc, lb), _rest(rhs_ndim, rc, rb)
    nb = len(lb)
    out_lf = tuple(range(nb, nb + len(lf)))
    out_rf = tuple(range(nb + len(lf), nb + len(lf) + len(rf)))
    return {
        "fwd_lhs": _Aim(tuple(lc), lf),
        "fwd_rhs": _Aim(tuple(rc), rf),
        "dgrad_lhs": _Aim(out_rf, out_lf),
        "dgrad_rhs": _Aim(rf, tuple(rc)),
        "wgrad_lhs": _Aim(out_lf, out_rf),
        "wgrad_rhs": _Aim(lf, tuple(lc)),
    }


def conv_aims(params, lhs_ndim: int, rhs_ndim: int) -> dict[str, _Aim]:
    """Each role's axes for ``conv_general_dilated``.

    The forward sums over input features (and the window), the input gradient over output
    features, the weight gradient over the batch (and positions); blocks go along the feature or
    batch axis, never along a spatial one.
    """
    del lhs_ndim, rhs_ndim
    dn = params["dimension_numbers"]
    (ln, lfeat), (ro, ri), (on, ofeat) = dn.lhs_spec[:2], dn.rhs_spec[:2], dn.out_spec[:2]
    return {
        "fwd_lhs": _Aim((lfeat,), (ln,)),
        "fwd_rhs": _Aim((ri,), (ro,)),
        "dgrad_lhs": _Aim((ofeat,), (on,)),
        "dgrad_rhs": _Aim((ro,), (ri,)),
        "wgrad_lhs": _Aim((on,), (ofeat,)),
        "wgrad_rhs": _Aim((ln,), (lfeat,)),
    }


def digest(x):
    """A wrapping int32 sum of ``x``'s float32 sign and mantissa bits: changes whenever an element's
    sign or significand does, and not when ``x`` is multiplied by a power of two.

    A loss scaler's ``2**k`` (normal range) moves each nonzero element's exponent field by ``k``
    and leaves the other bits, so the stochastic-rounding draws stay as they were, and the
    rounding, whose scales follow the amax, gives the unscaled operand times ``2**k`` bit for bit.
    (The exponent fields are left out rather than taken relative to the largest: that costs two
    more passes over a gradient, 10% of an NVFP4 MLP's step on a CPU; an element that alone
    doubles or halves is all it misses.)
    """
    bits = lax.bitcast_convert_type(x.astype(_F32), jnp.int32)
    return jnp.sum(bits & np.int32(-0x7F800001), dtype=jnp.int32)  # 0x807FFFFF: sign and mantissa


class _View(NamedTuple):
    """Where an operand is quantized: ``perm`` of its axes, then a reshape to ``shape``."""

    perm: tuple[int, ...]
    shape: tuple[int, ...]


def _gemm_view(aim: _Aim, shape) -> tuple[_View, _Aim]:
    """The GEMM's view of an operand: batch axes, then its free axes merged (M), then its summed
    axes merged (K), as torchao and TE quantize a 2-D ``M x K`` operand; and the aim on that view.

    A block along the merged K groups elements that share every batch and free index, so it still
    factors out of the GEMM's sum.
    """
    summed, free = sorted(aim.contracted), sorted(aim.free)
    batch = [a for a in range(len(shape)) if a not in summed and a not in free]
    n = len(batch)
    merged = (*(shape[a] for a in batch), math.prod(shape[a] for a in free), math.prod(shape[a] for a in summed))
    return _View((*batch, *free, *summed), merged), _Aim((n + 1,), (n,))


def _aimed(recipe: Recipe, role: str, aim: _Aim):
    """The role's format aimed at its GEMM's axes; ``None`` for a high-precision role or a GEMM
    that sums over nothing (an outer product)."""
    fmt = recipe.format_of(role)
    if fmt is None or not aim.contracted:
        return None
    return fmt.aim(aim.contracted[-1], aim.free[-1] if aim.free else None)


def _fit(recipe: Recipe, role: str, aim: _Aim, shape):
    """``(format, view)``: the role's aimed format and, when the format cannot block the operand's
    own axes (a summed axis shorter than the block, spread over several axes), the GEMM's view to
    quantize in (:func:`_gemm_view`); ``view`` is ``None`` when the operand's axes serve.

    The view is taken only where the operand's own axes fail, so every shape the recipes took before
    quantizes as it did. Raises the format's error on the operand's own axes when neither serves.
    """
    fmt = _aimed(recipe, role, aim)
    if fmt is None:
        return None, None
    try:
        fmt.block_shape(tuple(shape))
        return fmt, None
    except ValueError as own:
        if len(aim.contracted) < 2 and len(aim.free) < 2:
            raise
        view, view_aim = _gemm_view(aim, tuple(shape))
        try:
            fmt = _aimed(recipe, role, view_aim)
            fmt.block_shape(view.shape)
        except ValueError:
            raise own from None
        return fmt, view


def rows_alone(recipe: Recipe, role: str, aim: _Aim, shape, axis: int) -> bool:
    """Whether the role quantizes the slices of an operand of ``shape`` along ``axis`` each on its
    own (:meth:`qformats.ScaledFormat.separable` on the operand's own axes, rounding to nearest):
    then any group of slices quantized as a tensor of its own is the same as those slices of the
    whole operand quantized at once. True for a high-precision role."""
    if role in recipe.stochastic_rounding:
        return False
    fmt, view = _fit(recipe, role, aim, shape)
    return fmt is None or (view is None and fmt.separable(tuple(shape), axis))


def _quantizes_alike(recipe: Recipe, roles, aims, shape) -> bool:
    """Whether two roles quantize an operand of ``shape`` to the same values, so one result serves
    both: neither rounds stochastically, and their aimed formats differ at most in their axis
    fields while giving the same blocks (a block format's values depend on its partition into
    blocks, not on which axis names it: NVFP4's 16x16 weight tiles in the forward and input-gradient
    GEMMs)."""
    if set(roles) & recipe.stochastic_rounding:
        return False
    try:
        (f, vf), (g, vg) = (_fit(recipe, r, aims[r], shape) for r in roles)
    except ValueError:  # a shape one role cannot take: its GEMM says so, with context (check_operands)
        return False
    if f is None or g is None or type(f) is not type(g) or vf != vg:
        return False
    view = shape if vf is None else vf.shape
    if f.block_shape(view) != g.block_shape(view):
        return False
    return f.replace(**{n: getattr(g, n) for n in f.axis_fields}) == g


def quantize_operand(recipe: Recipe, role: str, x, aim: _Aim, source_digest=None, group=None):
    """``x`` through the role's format aimed at its GEMM's contracted axis, dequantized to float32.

    A stochastically rounded role draws its bits from a key made of the recipe's seed, the role
    and ``source_digest`` (:func:`digest` of the data ``x`` is computed from; default ``x``), and
    ``group``: the index of a grouped GEMM's group ``x`` belongs to, if it is one.
    High-precision roles, and operands of a GEMM that sums over nothing (an outer product), are
    returned as float32 unchanged.
    """
    fmt, view = _fit(recipe, role, aim, x.shape)
    x32 = x.astype(_F32)
    if fmt is None:
        return x32
    key = None
    if role in recipe.stochastic_rounding:
        d = digest(x32) if source_digest is None else source_digest
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(recipe.seed), ROLES.index(role)), d)
        key = key if group is None else jax.random.fold_in(key, group)
    return _straight_through(_Quantizer(fmt, view), x32, key)


class _Quantizer(NamedTuple):
    """``fmt.fake_quantize`` in ``view``: the non-differentiated argument of :func:`_straight_through`."""

    fmt: object
    view: _View | None

    def __call__(self, x, key):
        return _through(self.view, lambda v: self.fmt.fake_quantize(v, key), x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _straight_through(fake_quantize, x, key):
    """``fake_quantize(x, key)`` whose derivative is the identity.

    The quantizer is piecewise constant in ``x`` (integer codes; scales read from bits), so its own
    derivative is zero or, through a tensor's amax, meaningless. A gradient that differentiates a
    recipe's GEMMs again (a gradient penalty, a Hessian-vector product: the backward GEMMs read
    quantized operands) treats each quantizer as the value it approximates: ``d q(x) = dx``.
    """
    return fake_quantize(x, key)


@_straight_through.defjvp
def _straight_through_jvp(fake_quantize, primals, tangents):
    x, key = primals
    return _straight_through(fake_quantize, x, key), tangents[0]


def _through(view: _View | None, fn, x):
    """``fn`` applied to ``x`` in ``view`` (transposed and reshaped), the result in ``x``'s layout;
    ``fn(x)`` when ``view`` is ``None``."""
    if view is None:
        return fn(x)
    moved = x.transpose(view.perm)
    out = fn(moved.reshape(view.shape)).reshape(moved.shape)
    return out.transpose(tuple(int(a) for a in np.argsort(view.perm)))


def rotate(hadamard, x, aim: _Aim):
    """``x`` with ``hadamard``'s blocks applied along the GEMM's summed index.

    Along the last summed axis where it holds whole blocks; otherwise along the summed axes merged
    into one, e.g. 32 tokens x 1 query group in grouped-query attention. Both weight-gradient
    operands take the same branch, as their summed axes pair up in order with equal lengths, so
    ``sum_k (H dy)_k (H x)_k = sum_k dy_k x_k`` holds blockwise (``H`` orthogonal).

    The merged axis comes first, as the token axis of a 2-D layer's operand (tokens x features):
    the transform is then the same dot as that layer's, bit for bit. (Along a transposed view the
    dot summed in another order on some CPUs: one float32 ulp apart.)

    The result keeps ``x``'s sharding where the mesh makes it part of the type (``Explicit`` axes):
    the transform's dot with the replicated ``H`` would drop it, and the transposed GEMM then
    refuses a cotangent typed unlike its output.
    """
    axis = aim.contracted[-1]
    if x.shape[axis] % hadamard.size == 0 or len(aim.contracted) < 2:
        out = hadamard.apply(x, axis)
    else:
        perm = (*aim.contracted, *(a for a in range(x.ndim) if a not in aim.contracted))
        summed = math.prod(x.shape[a] for a in aim.contracted)
        view = _View(perm, (summed, x.size // summed if summed else 0))
        out = _through(view, lambda v: hadamard.apply(v, 0), x)
    sharding = explicit_sharding(x)
    return out if sharding is None else jax.sharding.reshard(out, sharding)


_OPERAND = {"fwd_lhs": "x", "fwd_rhs": "w", "dgrad_lhs": "dy", "dgrad_rhs": "w", "wgrad_lhs": "dy", "wgrad_rhs": "x"}
_GEMM = {
    "fwd": "forward GEMM y = x.w",
    "dgrad": "input-gradient GEMM dx = dy.w",
    "wgrad": "weight-gradient GEMM dw = dy.x",
}


def check_operands(recipe: Recipe, op, roles, x_shape, w_shape, y_shape, scopes=(), grouped=False) -> None:
    """Raise, naming the GEMM, the operand, where the contraction is and the fixes, when one of
    ``roles``' formats cannot block its operand (the forward roles when the forward is traced, the
    backward ones when the gradient is: a forward-only program never needs the backward's shapes).
    ``grouped``: ``op`` is one expert's GEMM of a grouped one (``ragged_dot_general``)."""
    aims = op.aims(len(x_shape), len(w_shape))
    shapes = {"x": tuple(x_shape), "w": tuple(w_shape), "dy": tuple(y_shape)}
    for role in roles:
        operand = _OPERAND[role]
        try:
            _fit(recipe, role, aims[role], shapes[operand])
        except ValueError as e:
            # The format's own first sentence says which axis fails; its remedies (pad, another
            # axis) are not a recipe user's, whose axes the library chooses.
            reason = str(e).split(". ")[0].rstrip(".")
            where = "/".join(scopes) or "no jax.named_scope"
            name = "ragged_dot_general" if grouped else op.primitive.name
            # What the summed axis is, for the user to resize: a convolution's weight gradient sums
            # over the batch alone along the blocks (a last partial batch of a dataset meets this).
            sizes = (
                "the batch for a convolution's weight gradient: drop a last partial batch"
                if op.primitive is lax.conv_general_dilated_p and role.startswith("wgrad")
                else "the rows of a grouped GEMM for its weight gradient (its groups need not be multiples of "
                "the block: each is blocked from its own first row)"
                if grouped and role.startswith("wgrad")
                else "sequence length, batch x sequence for the weight gradient"
            )
            raise ValueError(
                f"recipe {recipe.name!r} cannot quantize {operand} ({role}, shape {shapes[operand]}) for the "
                f"{_GEMM[role.split('_')[0]]} of the {name} at {where} (x {shapes['x']}, w "
                f"{shapes['w']}): {reason}. Fixes: make the summed axis a multiple of the block ({sizes}); "
                f"or keep this contraction in the program's precision "
                f"with recipe.replace(high_precision_scopes=(NAME,)), NAME one of the scopes above (wrap it in a "
                f"jax.named_scope if it has none); or recipe.replace({role}=None) for high precision in that role "
                "everywhere."
            ) from e


class Contraction(NamedTuple):
    """A bilinear primitive with its static parameters (hashable: a ``custom_vjp`` static argument);
    its operands are ``(lhs, rhs, *rest)``, ``rest`` a grouped GEMM's group sizes."""

    primitive: object
    params: tuple  # sorted (name, value) pairs of the bind parameters

    def __call__(self, a, b, *rest, **overrides):
        # bound directly: inside shard_map the operands' varying axes are unified here, as lax's
        # wrappers do (a replicated weight's gradient is then summed over the sharded axes)
        return self.primitive.bind(*same_varying(a, b, *rest), **{**dict(self.params), **overrides})

    def aims(self, lhs_ndim, rhs_ndim):
        aims_fn = conv_aims if self.primitive is lax.conv_general_dilated_p else dot_aims
        return aims_fn(dict(self.params), lhs_ndim, rhs_ndim)

    def emulated(self, a, b, *rest):
        """The float32 contraction of dequantized operands (exact float32 products and sums)."""
        return self(a, b, *rest, precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST), preferred_element_type=_F32)


def _forward(recipe, op, out_dtype, scopes, x, w):
    check_operands(recipe, op, ROLES[:2], x.shape, w.shape, (), scopes)
    aims = op.aims(x.ndim, w.ndim)
    xq = quantize_operand(recipe, "fwd_lhs", x, aims["fwd_lhs"])
    wq = quantize_operand(recipe, "fwd_rhs", w, aims["fwd_rhs"])
    return op.emulated(xq, wq).astype(out_dtype), wq


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def recipe_contraction(recipe: Recipe, op: Contraction, out_dtype, scopes: tuple, x, w):
    """``op(x, w)`` with every GEMM of its value and its gradients under ``recipe`` (``scopes``: the
    contraction's ``jax.named_scope`` names, for error messages)."""
    return _forward(recipe, op, out_dtype, scopes, x, w)[0]


def _fwd(recipe, op, out_dtype, scopes, x, w):
    y, wq = _forward(recipe, op, out_dtype, scopes, x, w)
    # The forward's quantized weight is kept for the input gradient when that GEMM would
    # quantize the weight to the same values (a weight-sized residual instead of a second quantize).
    alike = _quantizes_alike(recipe, ("fwd_rhs", "dgrad_rhs"), op.aims(x.ndim, w.ndim), w.shape)
    return y, (x, w, wq if alike else None)


def _like(x):
    """A float32 stand-in for ``x`` to transpose at, typed as ``x`` is: its sharding (part of its
    type on an explicit mesh, where the transposed GEMM's cotangent must carry it) and, inside
    ``shard_map``, the mesh axes it varies over (which its gradient must vary over too)."""
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(x.shape, _F32, sharding=aval.sharding, manual_axis_type=aval.manual_axis_type)


def _g_digest(recipe: Recipe, g32):
    """Both gradient GEMMs' stochastic-rounding keys hash dy once (the weight gradient's rotated
    operand is a function of it); ``None`` when neither rounds stochastically."""
    return digest(g32) if recipe.stochastic_rounding & {"dgrad_lhs", "wgrad_lhs"} else None


def backward_operands(recipe: Recipe, gemm: str, aims, g32, r, g_digest, rq=None, group=None):
    """The quantized operands ``(dy, w)`` of the input-gradient GEMM (``gemm="dgrad"``, ``r = w``) or
    ``(dy, x)`` of the weight-gradient GEMM (``"wgrad"``, ``r = x``; both optionally rotated along
    the summed M axis), ``dy`` in the forward output's layout. ``rq``: ``r`` already quantized;
    ``group``: see :func:`quantize_operand`."""
    lhs, rhs = f"{gemm}_lhs", f"{gemm}_rhs"
    if rq is None:
        rq = r.astype(_F32)
        if gemm == "wgrad" and recipe.wgrad_hadamard is not None and aims[lhs].contracted:
            g32 = rotate(recipe.wgrad_hadamard, g32, aims[lhs])
            rq = rotate(recipe.wgrad_hadamard, rq, aims[rhs])
        rq = quantize_operand(recipe, rhs, rq, aims[rhs], group=group)
    return quantize_operand(recipe, lhs, g32, aims[lhs], g_digest, group), rq


def _bwd(recipe, op, out_dtype, scopes, res, g):
    del out_dtype
    x, w, wq_fwd = res
    check_operands(recipe, op, ROLES[2:], x.shape, w.shape, g.shape, scopes)
    aims = op.aims(x.ndim, w.ndim)
    g32 = g.astype(_F32)
    g_digest = _g_digest(recipe, g32)
    gq, wq = backward_operands(recipe, "dgrad", aims, g32, w, g_digest, wq_fwd)  # dx = f(., w)^T dy
    (dx,) = jax.linear_transpose(lambda a: op.emulated(a, wq), _like(x))(gq)
    gq, xq = backward_operands(recipe, "wgrad", aims, g32, x, g_digest)  # dw = f(x, .)^T dy
    (dw,) = jax.linear_transpose(lambda b: op.emulated(xq, b), _like(w))(gq)
    return dx.astype(x.dtype), dw.astype(w.dtype)


def transposed_operands(recipe: Recipe, op: Contraction, gemm: str, scopes: tuple, x_shape, w_shape, g, r):
    """The quantized operands of one backward GEMM of ``op(x, w)`` that the program computes itself
    (a gradient taken inside the function the recipe is applied to): as :func:`backward_operands`,
    with the operands checked against the role's formats as the custom VJP checks them."""
    check_operands(recipe, op, (f"{gemm}_lhs", f"{gemm}_rhs"), x_shape, w_shape, g.shape, scopes)
    g32 = g.astype(_F32)
    return backward_operands(recipe, gemm, op.aims(len(x_shape), len(w_shape)), g32, r, _g_digest(recipe, g32))


recipe_contraction.defvjp(_fwd, _bwd)
