"""Helpers shared by the rule modules: promotion, alignment to a common scale, folding, re-quantizing.

All helpers take *carrier* ScaledArrays (see :mod:`scalify._scaled_array`) and plain arrays; the
block structure of a carrier is read from the shapes alone (``block = data.shape // scale.shape``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qformats as qf
from scalify._config import Pow2RoundMode, get_config
from scalify._jax_compat import bind_eqn, explicit_sharding, is_tracer
from scalify._pow2 import pow2_ceil_np, pow2_round, pow2_round_down, pow2_round_np, pow2_round_up
from scalify._scaled_array import ScaledArray, block_of, cast, expand_scale, to_carrier

F32 = jnp.float32


def staged(*static: str):
    """Run the decorated helper ``fn(..., mode=...)`` as a nested ``jax.jit``; the config's rounding
    mode and the keyword arguments named in ``static`` (dtypes) are static.

    Rules call a few scale helpers (combine, rescale, renormalise) at every application. Inlined,
    their equations are traced and lowered again each time; a nested jit is traced once per
    signature and lowered once per program, which is most of scalify's trace-and-lower price.
    ``Pow2RoundMode.STOCHASTIC`` draws a fresh key per call, so it must not be cached: inlined.
    """

    def decorate(fn):
        jitted = jax.jit(fn, static_argnames=("mode", *static))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            mode = get_config().rounding_mode
            if mode == Pow2RoundMode.STOCHASTIC:
                return fn(*args, mode=mode, **kwargs)
            return jitted(*args, mode=mode, **kwargs)

        return wrapper

    return decorate


def is_scaled(x) -> bool:
    return isinstance(x, ScaledArray)


def is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def per_tensor(x: ScaledArray) -> bool:
    return jnp.ndim(x.scale) == 0


# Traced arrays known to be filled with one static value (``broadcast_in_dim`` of a literal, such as
# the zeros of a relu or ``where`` cotangent), keyed by id, for the jaxpr being interpreted (per
# thread and context, like the tracing itself).
_FILLS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("scalify_fills", default=None)


# Static upper bounds of carriers' data amax (``|data| <= hi``), keyed by the data array's id: known
# where a rule measured or constructed the data (settled, renormalised, decoded from a format,
# a bounded function), carried through data-moving rules, static multipliers and products. A
# product of two carriers is formed directly when the bound of the result stays small, and only
# operands of unknown magnitude are renormalised first (a reduction over the operand each).
_BOUNDS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("scalify_bounds", default=None)


def product_bound(dtype) -> float:
    """Largest data bound a product in carrier ``dtype`` may have without renormalising its
    operands: a quarter of the dtype's range above 1, in powers of two (float16: 2^4 of headroom
    below its max 2^16 for the adds and static multipliers that follow; float32, bfloat16: 2^32)."""
    maxexp = jnp.finfo(dtype).maxexp
    return 2.0 ** (maxexp - 3 if maxexp <= 16 else maxexp // 4)


@contextlib.contextmanager
def fill_scope(args=()):
    """Fresh tables of known fills (see :func:`note_fill`) and data bounds for one jaxpr evaluation;
    the fills and bounds of ``args`` (the evaluation's inputs, as the caller knew them) stay known."""
    inherited = {id(a): (a, v) for a in args if (v := _fill_of(a)) is not None}
    bounds = {id(a.data): (a.data, b) for a in args if is_scaled(a) and (b := bound_of(a)) is not None}
    token, btoken = _FILLS.set(inherited), _BOUNDS.set(bounds)
    try:
        yield
    finally:
        _FILLS.reset(token)
        _BOUNDS.reset(btoken)


def note_bound(x, hi: float):
    """Record ``max|x.data| <= hi`` for the carrier ``x``; returns ``x``."""
    bounds = _BOUNDS.get()
    if bounds is not None and is_scaled(x):
        bounds[id(x.data)] = (x.data, float(hi))
    return x


def bound_of(x):
    """The recorded bound of ``max|x.data|`` of a carrier, or None."""
    bounds = _BOUNDS.get()
    hit = bounds.get(id(x.data)) if bounds is not None and is_scaled(x) else None
    return hit[1] if hit is not None and hit[0] is x.data else None


def operand_bound(x):
    """The data bound ``x`` has as a carrier operand (see :func:`promote`): its recorded bound, 2
    for a static non-zero scalar (its mantissa), 0 for a static zero; None when unknown."""
    if is_scaled(x):
        return bound_of(x)
    v = static_scalar(x)
    if v is None or not np.isfinite(v):
        return None
    return 0.0 if v == 0.0 else 2.0


def note_fill(x, value: float):
    """Record that the traced array ``x`` holds ``value`` everywhere (it counts as a static scalar)."""
    fills = _FILLS.get()
    if fills is not None:
        fills[id(x)] = (x, value)  # the reference keeps the id from being reused


def _fill_of(x):
    fills = _FILLS.get()
    hit = fills.get(id(x)) if fills is not None else None
    return hit[1] if hit is not None and hit[0] is x else None


def _concrete(x):
    """A concrete operand as a NumPy array, or None for what has no NumPy form and is never a
    static scalar: a mutable ``jax.ref.Ref`` (reading it is a ``get``), a PRNG key."""
    aval = jax.typeof(x)
    if isinstance(aval, jax.ref.AbstractRef) or jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return None
    return np.asarray(x)


def static_scalar(x):
    """The Python float of a concrete size-1 array or scalar, or of a known fill; else None."""
    if is_scaled(x):
        return None
    v = _fill_of(x)
    if v is not None or is_tracer(x):
        return v if isinstance(v, float) else None
    arr = _concrete(x)
    if arr is None or arr.size != 1 or not np.issubdtype(arr.dtype, np.floating):
        return None
    return float(arr.reshape(()))


def static_operand(x):
    """A static scalar operand as a 0-d NumPy value of its own dtype (ints too), or None."""
    if is_scaled(x):
        return None
    v = _fill_of(x)
    if v is not None or is_tracer(x):
        return np.asarray(v, x.dtype) if isinstance(v, float) else None
    arr = _concrete(x)
    return arr.reshape(()) if arr is not None and arr.size == 1 else None


def runtime_fill(x):
    """The traced 0-d float of a broadcast runtime scalar (a learning rate, a loss scale), or None.

    jax-scalify tracks such broadcast scalars too: their power of two belongs in the scale.
    """
    if is_scaled(x) or not is_tracer(x):
        return None
    v = _fill_of(x)
    return None if v is None or isinstance(v, float) else v


class _Zero:
    """Marker scale of a static zero operand: it adopts whatever common scale the others pick."""


ZERO = _Zero()


def is_runtime_plain(x) -> bool:
    """A plain floating operand whose magnitude is unknown (neither a static nor a runtime scalar fill)."""
    return not is_scaled(x) and is_float(x) and static_scalar(x) is None and runtime_fill(x) is None


def split_static(v: float) -> tuple[float, float]:
    """``(m, e)`` with ``v = m * e`` exactly: ``e`` a power of two, ``1 <= |m| < 2`` (``v`` finite, non-zero)."""
    e = pow2_round_np(abs(v), Pow2RoundMode.DOWN)
    return v / e, e


def promote(x, *, zero_adopts=True):
    """A carrier ScaledArray for a plain operand.

    A static scalar is split exactly into ``data * 2**e`` with data in ``[1, 2)``; a static zero
    gets the marker scale ``ZERO`` (it adopts the other operands' scale); other plain arrays get
    ``scale = 1`` (the jax-scalify convention).
    """
    if is_scaled(x):
        return x
    v = static_scalar(x)
    arr = jnp.asarray(x)
    rv = runtime_fill(x) if v is None else None
    if rv is not None:
        # A broadcast runtime scalar: its power of two goes to the scale, the mantissa to the data.
        e = safe_scale(pow2_round(lax.abs(cast(rv, F32)), Pow2RoundMode.DOWN))
        m = cast(lax.div(cast(rv, F32), e), arr.dtype)
        return ScaledArray(lax.broadcast_in_dim(m, arr.shape, (), out_sharding=explicit_sharding(arr)), e)
    if v is not None:
        if v == 0.0 and zero_adopts:
            return ScaledArray(arr, ZERO)
        if np.isfinite(v) and v != 0.0:
            m, e = split_static(v)
            return ScaledArray(lax.full_like(arr, m, arr.dtype), jnp.asarray(e, F32))
    return ScaledArray(arr, jnp.ones((), F32))


def finite_or_zero(v):
    """``v`` with its NaN and Inf entries replaced by 0 (for maxima that must ignore them)."""
    return lax.select(lax.is_finite(v), v, lax.full_like(v, 0.0))


def finite_max(s):
    """The largest finite entry of a scale grid, 1 when there is none.

    A NaN or Inf block scale (a format's block holding a NaN or Inf) must not become the scale of
    the other blocks: divided by this finite scale, it moves into the data of its own block only.
    """
    return safe_scale(jnp.max(finite_or_zero(cast(s, F32))))


def fold(x: ScaledArray) -> ScaledArray:
    """Per-tensor form of a carrier: scale = max block scale (power of two), data rescaled in f32.

    The max is taken over the finite block scales: a NaN / Inf block keeps its NaN / Inf in its
    own data (``data * (NaN / smax)``) instead of spreading to the whole tensor.
    """
    if per_tensor(x):
        return x
    smax = finite_max(x.scale)
    if get_config().rounding_mode != Pow2RoundMode.NONE:
        smax = pow2_round_up(smax)
    out = ScaledArray(rescale(x.data, lax.div(x.scale, smax)), smax)
    # Each block's data is multiplied by s / smax <= 1: the data bound stays.
    hi = bound_of(x)
    return out if hi is None else note_bound(out, hi)


def dequant(x, dtype=F32):
    """The value of a scaled or plain operand as ``dtype`` (plain non-floats pass unchanged)."""
    if is_scaled(x):
        return cast(lax.mul(cast(x.data, F32), expand_scale(x.scale, x.data.shape)), dtype)
    if not is_float(x):
        return x
    return jnp.asarray(x).astype(dtype)


def safe_scale(s):
    """Replace zero / non-finite scales by 1 (a tensor of zeros keeps scale 1)."""
    s = cast(s, F32)
    ok = lax.bitwise_and(lax.is_finite(s), lax.gt(s, lax.full_like(s, 0.0)))
    return lax.select(ok, s, lax.full_like(s, 1.0))


def renormalize(v, scale, dtype) -> ScaledArray:
    return note_bound(ScaledArray(*_renormalize(v, scale, dtype=np.dtype(dtype))), 2.0)


@staged("dtype")
def _renormalize(v, scale, *, dtype, mode):
    """Carrier of the float32 data ``v`` on the block-grid (or 0-d) ``scale``, renormalised per block.

    Each block's data is divided by its absolute max rounded to a power of two (moved into the
    scale), so the data fits the carrier ``dtype`` whatever its float32 magnitude was.
    """
    v = jnp.asarray(v, F32)
    scale = jnp.asarray(scale, F32)
    grid = () if v.ndim == 0 else tuple(scale.shape)
    amax = block_amax(v, grid)
    r = safe_scale(pow2_round(safe_scale(amax), mode))
    return (v * expand_scale(1.0 / r, v.shape)).astype(dtype), _zero_rescaled(amax, scale * r)


def measured() -> bool:
    """Whether drifting rules take their output scale from the measured amax (the default policy)."""
    return get_config().renormalize == "amax"


# Data amax window of the measured policy: inside it a rule's static choice of scale stands (the
# jax-scalify scale, bit for bit); outside it the measured amax moves into the scale.
WINDOW = 2.0**7


def settle(v, scale, dtype, *, per_block: bool = False) -> ScaledArray:
    """Carrier of the float32 value ``v * expand(scale)`` whose data's amax lies in ``[2^-7, 2^7]``.

    One reduction: if the absolute max of ``v`` lies outside the window, it is rounded down to a
    power of two ``r`` that moves from the data into the scale (``data = v / r``, ``scale * r``:
    exact), so the data's amax lands in ``[1, 2)``; inside the window (and for a non-finite ``v``)
    nothing changes, and an all-zero ``v`` whose scale drifted out of ``[2^-32, 2^32]`` gets scale 1
    (:func:`_zero_rescaled`). A block grid keeps its shape (the factor is common to all
    blocks), so per-channel and outer-product grids stay as the rule built them; with
    ``per_block`` each block of the grid is settled on its own amax instead.
    """
    return note_bound(ScaledArray(*_settle(v, scale, dtype=np.dtype(dtype), per_block=per_block)), WINDOW)


def _settle_factor(v, scale, per_block):
    """``(keep, r, amax)``: per block of the grid, whether the amax of ``v`` is inside the window (or
    has no power of two to move: zero, NaN, Inf), the power of two ``r`` that moves into the scale,
    and the amax."""
    grid = tuple(scale.shape) if per_block and scale.ndim and scale.ndim == v.ndim else ()
    amax = block_amax(v, grid)
    inside = (amax >= np.float32(1 / WINDOW)) & (amax <= np.float32(WINDOW))
    keep = inside | ~(lax.is_finite(amax) & (amax > 0))
    # A select, not a conditional: under shard_map's varying-axis checking the two branches of a
    # cond would have different types (the measured factor varies, the kept scale may not).
    return keep, lax.select(keep, lax.full_like(amax, 1.0), pow2_round(amax, Pow2RoundMode.DOWN)), amax


def _zero_rescaled(amax, scale):
    """``scale``, with 1 where the block's ``amax`` is 0 and the scale has left ``[2^-32, 2^32]``
    (Inf included; a scale of exactly 0 stays, as jax-scalify's ``set_scaling(x, 0)`` gives it):
    the value is zero either way.

    A block of zeros measures nothing, so its scale is the rule's static product of its operands'
    scales. Along a chain of zero cotangents (the exactly-zero BatchNorm gradients of a ResNet's
    deep blocks) that product drifted without bound: 2^121 after 16 Haiku ResNet blocks, then Inf,
    and a zero times an Inf scale is NaN (jmp's loss scaling then skipped every step). Only the
    scale changes, so the data's fusion does not read the scale chain.
    """
    drifted = (amax == 0) & ((scale > SCALE_WINDOW) | ((scale < 1 / SCALE_WINDOW) & (scale != 0)))
    return jnp.where(drifted, np.float32(1.0), scale)


@staged("dtype", "per_block")
def _settle(v, scale, *, dtype, per_block, mode):
    del mode
    v, scale = jnp.asarray(v, F32), jnp.asarray(scale, F32)
    _, r, amax = _settle_factor(v, scale, per_block)
    return (v * expand_scale(1.0 / r, v.shape)).astype(dtype), _zero_rescaled(amax, scale * r)


@staged("per_block")
def _settle_stored(data, scale, *, per_block, mode):
    """:func:`_settle` of a value that is stored (it leaves the program or a loop iteration): the
    rescale runs only when some block is outside the window.

    Inside a program the rescale is one multiply that XLA fuses into the data's consumer; a stored
    value has no consumer to fuse with, so the multiply is a pass of its own (read and write the
    whole array) on top of the amax's read. A trained model's parameters and optimizer moments
    stay in the window from step to step, so skipping the pass there is most of the settle's cost.
    """
    del mode
    scale = jnp.asarray(scale, F32)
    keep, r, amax = _settle_factor(jnp.asarray(data, F32), scale, per_block)
    return _divide_unless(data, r, jnp.all(keep)), _zero_rescaled(amax, scale * r)


# Up to this many elements, a pass that a conditional or a loop would skip costs no more than the
# conditional itself: to dispatch (on CPU, per call at 2^14 float32 elements: masked max 12.7 us,
# plain max behind the conditional 13.2 us; at 2^16 the conditional wins, 35 us to 43 us) and to
# compile (two branch computations with fusions of their own). block_amax and _divide_unless run
# straight-line code there; larger arrays keep the skip.
STRAIGHT_LINE = 1 << 14


@jax.custom_jvp
def _divide_unless(d, r, skip):
    """``d / expand(r)`` in ``d``'s dtype, where ``r`` is 1 wherever ``skip`` holds: the division is
    not run at all then.

    A loop of zero or one iterations, not a ``cond``: XLA gives a ``cond`` a new output buffer, so
    its untaken branch still copied the whole array (on CPU as slow as the multiply), while a
    loop's state is updated in place. Up to :data:`STRAIGHT_LINE` elements the multiply runs
    unconditionally (same bits: ``r`` is 1 where ``skip`` holds).
    """

    def divide(d):
        return (d.astype(F32) * expand_scale(1.0 / r, d.shape)).astype(d.dtype)

    if d.size <= STRAIGHT_LINE:
        return divide(d)
    return lax.while_loop(lambda carry: carry[1], lambda carry: (divide(carry[0]), ~carry[1]), (d, ~skip))[0]


@_divide_unless.defjvp
def _divide_unless_jvp(primals, tangents):
    # ``r`` is piecewise constant in ``d`` (a power of two of its amax): the derivative is the
    # division's, and linear in ``d``'s tangent (so reverse mode transposes it; a while loop does
    # not differentiate in reverse mode).
    d, r, skip = primals
    return _divide_unless(d, r, skip), (tangents[0].astype(F32) * expand_scale(1.0 / r, d.shape)).astype(d.dtype)


def wide(dtype) -> bool:
    """Whether a carrier dtype has float32's exponent range (float32, bfloat16): its data cannot
    overflow or flush where the float32 program's values do not."""
    return jnp.finfo(dtype).maxexp >= 128


def _settles(x) -> bool:
    """Whether :func:`settle_carried` measures ``x``: a floating carrier (no format) under the
    measured policy."""
    return is_scaled(x) and x.fmt is None and measured() and is_float(x.data)


def settle_carried(x):
    """A carrier value that leaves the program or a loop iteration, settled on its measured amax.

    Within one program the rules bound the data's drift (a static multiplier's mantissa, an
    alignment's rounding: a factor below 2 per operation); state carried across steps or
    iterations (an optimizer's moments ``b * m + (1 - b) * g``, a loop carry) would compound it
    without bound. Settling what is carried keeps the data's amax in the window (one reduction);
    a value already inside it (an explicit ``set_scaling``, jax-scalify's outputs) is unchanged and
    not rewritten (:func:`_settle_stored`).
    Formatted values (quantized by their format) and plain values pass unchanged.
    """
    if not _settles(x):
        return x
    # Per block: a factor common to all blocks, taken from the largest (the 2^125 of a ``-1e38``
    # mask fill in an MX block), overflowed the larger block scales to Inf and flushed the other
    # blocks' data (0 * Inf = NaN in every other block).
    return note_bound(ScaledArray(*_settle_stored(x.data, x.scale, per_block=True)), WINDOW)


# Scale window of wide carriers that are not settled on their amax (contraction outputs, loop
# carries): a power of two outside it moves into the data.
SCALE_WINDOW = 2.0**32


def static_in_window(scale) -> bool:
    """Whether ``scale`` is a constant of the program (a NumPy value, known at trace time) whose
    largest entry lies in ``[2^-32, 2^32]``: a wide carrier on it needs no re-centring."""
    return isinstance(scale, np.ndarray | np.generic) and 1 / SCALE_WINDOW <= np.max(scale) <= SCALE_WINDOW


def settle_output(x):
    """A value the scalified program returns, settled where the program produces it (its later
    readers take the settled value, the same value): as a carried value (:func:`settle_carried`),
    unless it is a wide carrier (float32, bfloat16) on a constant scale (:func:`static_in_window`).
    :func:`finish_output` completes it at the exit.

    Such a value's data is its value divided by that constant (a contraction of formatted
    operands, whose scales the GEMM already applied, has the constant scale 1): returned and fed
    to the program again, its data is the same function of its value at every step, so there is
    no drift to compound. Settling it cost two passes over the output (its amax, then a rescale
    that ``to_array`` multiplies back): on an H100 an MXFP8 8192^3 matmul under the measured
    policy took 1.21x the bfloat16 GEMM's time, 1.06x without it. Loop carries are always
    settled: their data bound inside the body relies on it.

    Settled at the exit instead, an output that the program also reads (a gradient that the
    optimizer reads, the new moments that the parameter update reads) was one buffer read by two
    parties, and the in-place rescale of :func:`_settle_stored` had to copy it first.
    """
    return x if _leaves_unsettled(x) else settle_carried(x)


def _leaves_unsettled(x) -> bool:
    return _settles(x) and wide(x.data.dtype) and static_in_window(x.scale)


def finish_output(x):
    """At the exit, a value :func:`settle_output` left unsettled gets its constant scale as a JAX
    array, as every other output's scale is (a constant under jit)."""
    return ScaledArray(x.data, jnp.asarray(x.scale)) if _leaves_unsettled(x) else x


def recentre(data, scale):
    """``(data * r, scale / r)``: a scale whose largest entry leaves ``[2^-32, 2^32]`` moves into
    the data as the power of two ``r`` at or below that entry (exact).

    A factor that a format keeps out of its GEMM values (a per-tensor scale, NVFP4's tensor
    scale, per-channel scales) multiplies into a contraction's output scale, while the values stay
    at the element's magnitude (up to 57344 for fp8_e5m2). Along a chain of contractions the scale
    then shrinks by the element max each time and the accumulator grows by as much: the eighth
    fp8_e5m2 matmul's scale (2^-128) flushed to zero while its data overflowed. Re-centring keeps
    both in range at the cost of one multiply, which XLA fuses into the data's consumer; no amax
    reduction is needed (the scale alone shows the drift). A wide carrier's data then holds
    ``value / scale`` within float32's range for every ``|value|`` in ``[2^-94, 2^96]``.
    """
    if static_in_window(scale):
        return data, scale  # known at trace time and inside the window: no multiply at all
    s = cast(scale, F32)
    m = jnp.max(s) if s.ndim else s
    inside = ((m >= np.float32(1 / SCALE_WINDOW)) & (m <= np.float32(SCALE_WINDOW))) | ~(lax.is_finite(m) & (m > 0))
    r = lax.select(inside, np.float32(1.0), pow2_round_down(m))
    return lax.mul(data, r.astype(data.dtype)), lax.div(s, r)


def loop_entry(x, accumulates: bool):
    """``(carry, anchor)``: a loop carry ``x`` (a per-tensor value) as it enters the loop, and the
    scale it keeps for the whole loop (None for a carry that is settled each iteration).

    An accumulator (the body returns ``carry + term``, as a gradient accumulated over a scan's
    steps) of a wide carrier (float32, bfloat16 data) needs no amax to stay in range: expressed on
    one scale ``S`` for the whole loop (the entry scale, re-centred into ``[2^-32, 2^32]``), its
    data is the float32 sum divided by a constant power of two, so it grows exactly as the value
    does and overflows only where ``|value| > 2^96`` (:func:`recentre`). Settling it instead cost
    two passes over the carry per iteration (its amax, then the rescale). A narrow carrier
    (float16, float8) has too little range for that, and a carry the body multiplies is better
    settled: its data bound is then known and its products need no renormalising pass.
    """
    if not (accumulates and _settles(x)) or x.scale.ndim or not wide(x.data.dtype):
        return settle_carried(x), None
    # The entry re-expressed by recentre's own (data * r, scale / r), not as data * (scale / S):
    # XLA rewrites s / (s / r) into (s * r) / s, which overflows for an out-of-window s.
    data, anchor = recentre(x.data, x.scale)
    return ScaledArray(data, anchor), anchor


def carried(x, anchor):
    """A loop carry leaving an iteration: on the loop's ``anchor`` scale (``data * scale /
    anchor``, one multiply that XLA fuses into the carry's producer), else settled
    (:func:`settle_carried`; its data bound inside the body is then the window's)."""
    if anchor is None:
        return settle_carried(x)
    return ScaledArray(lax.mul(x.data, cast(lax.div(cast(x.scale, F32), anchor), x.data.dtype)), anchor)


def loop_bound(x, anchor):
    """The data bound a carry has inside the loop body (see :func:`carried`), or None."""
    if anchor is None and _settles(x):
        return WINDOW
    return None


def block_amax(v, grid_shape):
    """``max(|v|)`` over each block of a rank-matched (or empty: per-tensor) grid.

    A float reduction over the finite elements: ``max(|v|)`` in one pass, and only where that pass
    met a non-finite element (or its sum overflowed) ``max(where(isfinite(v), |v|, 0))`` (up to
    :data:`STRAIGHT_LINE` elements, the masked max directly). Unlike :func:`qformats.block_amax` it need not propagate
    NaN: the result only picks a power of two to move into the scale, and a NaN or Inf element stays
    NaN / Inf in the data. Leaving them out matters: an Inf amax (one overflowed element) would keep
    the other elements' data unnormalised, so that a float16 carrier's ``y * y`` overflowed in every
    row, not only in the row of the Inf. (qformats needs the NaN-exact reduction because a NaN must
    reach the encoded scale.)
    """
    v = jnp.asarray(v, F32)
    if v.size == 0:
        return jnp.ones(grid_shape, F32)
    if not grid_shape or v.ndim == 0:
        reduce = lambda v, reducer: reducer(v)
    else:
        block = block_of(grid_shape, v.shape)
        reduce = lambda v, reducer: qf.block_reduce(v, block=block, reducer=reducer)
    masked = lambda v: reduce(finite_or_zero(jnp.abs(v)), jnp.max)
    if v.size <= STRAIGHT_LINE:
        return masked(v)
    # The plain max fuses with |v| into one pass; masking the non-finite elements first costs two
    # more (XLA on CPU keeps the select out of the reduction), so the mask is applied only where
    # the pass met a non-finite element. The max alone cannot tell: XLA's vectorised float max on
    # CPU lets a NaN reset the running max of its lane (a finite result below the finite elements'
    # max; openxla/xla#21461). ``sum(v) * 0`` can: it is 0 when every element (and the sum) is
    # finite and NaN otherwise, whatever the summation order (a sum that overflows only sends a
    # finite tensor to the exact fallback). It costs one more reduction of ``v``:
    # Float16MLPStep 1.22-1.29x -> 1.25-1.31x the plain step, where ``sum(v * 0)``
    # cost 8% and a select on NaN more than the pass itself.
    fast = reduce(jnp.abs(v), jnp.max)
    seen = fast + reduce(v, jnp.sum) * 0
    return lax.cond(jnp.all(lax.is_finite(seen)), lambda v: fast, masked, v)


def requant_blocks(v, grid_shape, dtype) -> ScaledArray:
    """Carrier of the float32 value ``v`` on a block grid: per block, scale = amax rounded to 2^k."""
    return renormalize(v, jnp.ones(tuple(grid_shape), F32), dtype)


def requant(v, dtype) -> ScaledArray:
    """Per-tensor carrier of a float32 value ``v``: scale = amax rounded to a power of two."""
    return requant_blocks(v, (), dtype)


def unit(v, dtype, bound=None) -> ScaledArray:
    """Carrier with scale 1 (for bounded outputs such as tanh or logistic: ``|v| <= bound``)."""
    out = ScaledArray(cast(v, dtype), jnp.ones((), F32))
    return out if bound is None else note_bound(out, bound)


def rescale(data, ratio, dtype=None):
    """``data * ratio`` computed in float32 and cast to ``dtype`` (default: the data's own).

    ``ratio`` is a 0-d or grid scale. Inlined, not staged: its signature is the data's shape, which
    rarely repeats within a program, and a nested call costs more to lower than these few equations.
    """
    dtype = data.dtype if dtype is None else dtype
    return cast(lax.mul(cast(data, F32), expand_scale(ratio, data.shape)), dtype)


def _wide_live(ps) -> bool:
    """Whether every scaled operand is a float32 / bfloat16 carrier."""
    return all(is_float(p.data) and wide(p.data.dtype) for p in ps if not _is_marker(p.scale))


def _per_tensor_meets_grid(ps) -> bool:
    """Whether a per-tensor operand meets a block-grid one (an MX embedding row plus a position
    embedding, a residual add). For wide carriers the grid buys no precision (float32's exponent
    holds what the blocks would), but kept it would go down the residual stream into every later
    alignment and reduction (XLA on CPU reduces 5x slower with a block scale broadcast into the
    reduction); so :func:`align` folds it to per-tensor, exact in float32 above its subnormals."""
    live = [p for p in ps if not _is_marker(p.scale)]
    return any(per_tensor(p) for p in live) and any(not per_tensor(p) for p in live)


def _outer_grid(ps, grid_shape) -> bool:
    """Whether wide carriers' grids combine into one larger than each of them (a per-row grid
    plus a per-column one: one scale per element). All but the largest are then folded to
    per-tensor (exact in float32 above its subnormals), so the output keeps a grid no larger than
    an operand's instead of one that every later rule would align and carry like data. Narrow
    carriers keep the outer grid: a fold could flush their small blocks."""
    grids = [p for p in ps if not _is_marker(p.scale) and jnp.ndim(p.scale) > 0]
    if len(grids) < 2 or math.prod(grid_shape) <= max(math.prod(jnp.shape(p.scale)) for p in grids):
        return False
    return _wide_live(grids)


def _grid_shapes_compatible(xs):
    """Common grid shape of the non-zero operands, or None if their blocks do not line up."""
    grids = [x.scale for x in xs if x.scale is not ZERO and not isinstance(x.scale, _Static)]
    shaped = [g for g in grids if jnp.ndim(g) > 0]
    if not shaped:
        return ()
    ndim = jnp.ndim(shaped[0])
    if any(jnp.ndim(g) != ndim for g in shaped):
        return None
    common = []
    for ax in range(ndim):
        sizes = {g.shape[ax] for g in shaped} - {1}
        if len(sizes) > 1:
            return None
        common.append(sizes.pop() if sizes else 1)
    return tuple(common)


def combine_l2(scales, mode):
    """``sqrt(sum(s**2))`` rounded to a power of two, without squaring the scales themselves.

    The scales are normalised by their maximum first: squaring a raw scale leaves float32's range
    for scales beyond ~2**64 (or below ~2**-64), and under ``jit`` XLA may re-associate the static
    power-of-two factors of a scale chain (``to_carrier``'s shift, sqrt(K) allowances, literals)
    into one constant that overflows while the remaining factor underflows (0 * inf = NaN).
    """
    if len(scales) == 1:
        return pow2_round(jnp.asarray(scales[0], F32), mode)
    # The plain max: a NaN block scale makes the sum's block NaN, as its values are.
    m = safe_scale(functools.reduce(lax.max, scales))
    s2 = functools.reduce(lax.add, [lax.square(s / m) for s in scales])
    return pow2_round(lax.sqrt(s2) * m, mode)


def combine_max(scales, mode):
    """The largest finite scale (per block): operands with smaller scales shift right, none can
    overflow. A NaN / Inf scale (a format's NaN block) is left out: its ratio ``NaN / common`` puts
    the NaN into that operand's data, so a ``select`` of the other operand stays finite."""
    del mode
    return safe_scale(functools.reduce(lax.max, [finite_or_zero(s) for s in scales]))


@staged("combine", "floor")
def _common_scale(scales, *, combine, floor, mode):
    """The common scale ``c = max(combine(scales), floor)`` and each operand's ratio ``s_i / c``, as
    one nested computation (one equation per alignment instead of a combine and a division each)."""
    common = combine(scales, mode)
    if floor:
        common = lax.max(common, np.float32(floor))
    return common, tuple(lax.div(s, common) for s in scales)


class _Static:
    """Marker scale of a fill under a max alignment: it adopts the common scale of the scaled
    operands, raised to ``floor`` where the fill would not fit the carrier otherwise. ``value`` and
    ``floor`` are Python floats for a static fill, traced 0-d float32 for a runtime one."""

    def __init__(self, value, floor):
        self.value, self.floor = value, floor

    @property
    def static(self) -> bool:
        return isinstance(self.floor, float)

    def data_like(self, data):
        """The fill as float32 data of ``data``'s shape."""
        if self.static:
            return lax.full_like(data, self.value, F32)
        return lax.broadcast_in_dim(self.value, jnp.shape(data), (), out_sharding=explicit_sharding(data))


def _static_floor(v: float, dtype) -> float:
    """Smallest power-of-two scale ``s`` with ``|v| / s`` at most a quarter of ``dtype``'s max (0: any
    normal scale will do). A quarter leaves room for the differences softmax takes of masked logits."""
    if not np.isfinite(v):
        return 0.0
    q = abs(v) / (float(jnp.finfo(dtype).max) / 4)
    return pow2_ceil_np(q) if q >= float(np.finfo(np.float32).tiny) else 0.0


def _runtime_floor(v, dtype):
    """:func:`_static_floor` of a traced 0-d ``v``; the smallest normal float32 where it would be 0."""
    q = lax.div(lax.abs(v), np.float32(float(jnp.finfo(dtype).max) / 4))
    q = lax.max(finite_or_zero(q), np.float32(np.finfo(np.float32).tiny))
    return pow2_round_up(q)


def _adopting(x, dtype):
    """Promotion under a max alignment (select, max, min, clamp): a fill (``-1e38`` of an attention
    mask, ``finfo.min``, ``inf``) must not set the common scale, else a scaled operand's data would
    be shifted by up to 2^-127 and flushed; it takes the others' scale instead. So does a runtime
    fill (a mask value that is a model's array, traced under ``jit`` or ``jax.checkpoint``)."""
    v = static_scalar(x)
    rv = runtime_fill(x) if v is None else None
    if (v is None and rv is None) or v == 0.0:
        return promote(x)
    arr = jnp.asarray(x)
    carrier = dtype or arr.dtype
    if rv is not None:
        rv = cast(rv, F32)
        return ScaledArray(arr, _Static(rv, _runtime_floor(rv, carrier)))
    return ScaledArray(arr, _Static(v, _static_floor(v, carrier)))


def _is_marker(scale) -> bool:
    return scale is ZERO or isinstance(scale, _Static)


def align(xs, combine=combine_max, *, dtype=None, finite=False):
    """Bring scaled and plain operands to one common scale (per block).

    ``combine`` is :func:`combine_max` (the largest scale: nothing can overflow) or
    :func:`combine_l2` (jax-scalify's ``sqrt(sum(s**2))`` for sums). Returns ``(datas, scale)`` with
    each data in its own dtype (or ``dtype``). Blocks that do not line up are first folded to
    per-tensor; a static zero adopts the common scale; under ``combine_max`` every static fill does
    (the common scale is raised only as far as the fill needs to stay finite in the carrier).

    ``finite``: the common scale is finite even when one scaled operand meets only static
    operands (``where(m, x, 0)``, ``x > 0``): a NaN / Inf scale then moves into that operand's
    data, so selects and comparisons see the NaN element by element, as the values do (a static
    zero selected next to a NaN block stays zero).
    """
    adopt = combine is combine_max and any(is_scaled(x) for x in xs)
    ps = [_adopting(x, dtype) if adopt else promote(x) for x in xs]
    # Rank-0 operands (scalar literals) with a 0-d scale broadcast against any grid.
    grid_shape = _grid_shapes_compatible(ps)
    if grid_shape is None or (_wide_live(ps) and _per_tensor_meets_grid(ps)):
        ps = [p if _is_marker(p.scale) else fold(p) for p in ps]
        grid_shape = ()
    elif _outer_grid(ps, grid_shape):
        keep = max((p for p in ps if not _is_marker(p.scale)), key=lambda p: math.prod(jnp.shape(p.scale)))
        ps = [p if p is keep or _is_marker(p.scale) else fold(p) for p in ps]
        grid_shape = _grid_shapes_compatible(ps)
    live = [p for p in ps if not _is_marker(p.scale)]
    fills = [p.scale for p in ps if isinstance(p.scale, _Static)]
    floor = max([f.floor for f in fills if f.static], default=0.0)
    runtime_floors = [f.floor for f in fills if not f.static]
    if len(live) == 1 and not floor and not runtime_floors and not (finite and len(ps) > 1):
        common, ratios = live[0].scale, (None,)
    elif not live:
        common, ratios = jnp.ones((), F32), ()
    else:
        scales = tuple(jnp.broadcast_to(p.scale, grid_shape) if grid_shape else p.scale for p in live)
        # A runtime fill's floor joins the maximum as one more scale; its own ratio is not needed.
        extra = tuple(jnp.broadcast_to(f, grid_shape) if grid_shape else f for f in runtime_floors)
        common, ratios = _common_scale(scales + extra, combine=combine, floor=floor)
        ratios = ratios[: len(scales)]
    ratio_of = dict(zip(map(id, live), ratios, strict=True))
    out_shape = None
    datas = []
    for p in ps:
        dt = p.data.dtype if dtype is None else dtype
        if isinstance(p.scale, _Static):
            # The fill's data is v / common, a division: 1 / common is subnormal for a common scale
            # above 2^126, which XLA flushes to zero (and -inf * 0 is NaN).
            op, factor, data = lax.div, cast(common, F32), p.scale.data_like(p.data)
        else:
            op, factor, data = lax.mul, ratio_of.get(id(p)), p.data
        if factor is None:
            datas.append(cast(data, dt))
            continue
        if jnp.ndim(factor) > 0 and (
            data.ndim != factor.ndim or any(g > n for g, n in zip(factor.shape, data.shape, strict=True))
        ):
            # Scalar operands and the implicit size-1 broadcasting of lax binary ops: a block
            # grid needs the data at the output shape.
            out_shape = out_shape or np.broadcast_shapes(*[q.data.shape for q in ps])
            data = jnp.broadcast_to(data, out_shape)
        datas.append(cast(op(cast(data, F32), expand_scale(factor, data.shape)), dt))
    return datas, common


def times(scale, r: float):
    """``scale * r`` for a static ``r``; no equation when ``r == 1``."""
    return scale if r == 1.0 else lax.mul(cast(scale, F32), np.float32(r))


def sqrt_rescale(n: int) -> float:
    """Power of two near ``sqrt(n)`` (rounded down): the growth allowance of an n-term sum."""
    return pow2_round_np(math.sqrt(max(n, 1)), Pow2RoundMode.DOWN)


# -- static layout inference for structural ops ---------------------------------------------------

_MAX_LAYOUT_SIZE = 1 << 24


def _divisors_desc(n):
    return [d for d in range(n, 0, -1) if n % d == 0]


def grid_from_ids(ids: np.ndarray):
    """Coarsest block grid on which the block-id map ``ids`` is constant: ``(grid_ids, block)``."""
    block = []
    for ax, n in enumerate(ids.shape):
        moved = np.moveaxis(ids, ax, -1)
        for d in _divisors_desc(n):
            a = moved.reshape((*moved.shape[:-1], n // d, d))
            if (a == a[..., :1]).all():
                block.append(d)
                break
    g = ids[tuple(slice(None, None, b) for b in block)]
    return g, tuple(block)


def block_ids(grid_shape, shape) -> np.ndarray:
    """Block index of every element of ``shape`` for a rank-matched ``grid_shape``."""
    ids = np.arange(math.prod(grid_shape), dtype=np.int32).reshape(grid_shape)
    for ax, (n, g) in enumerate(zip(shape, grid_shape, strict=True)):
        ids = np.repeat(ids, n // g, axis=ax)
    return ids


def _grid_scale(x_scale, new_ids):
    g, _ = grid_from_ids(np.asarray(new_ids))
    if g.size == 1:
        return x_scale.reshape(-1)[int(g.reshape(-1)[0])]
    if np.array_equal(g.reshape(-1), np.arange(x_scale.size)):
        return x_scale.reshape(g.shape)
    return jnp.take(x_scale.reshape(-1), jnp.asarray(g))


def decoded(x: ScaledArray) -> ScaledArray:
    """``to_carrier(x)``; decoded format elements are below 2 (the element max over its power of
    two moved into the scale), a bound the rules use to skip renormalising passes."""
    c = to_carrier(x)
    return c if x.fmt is None else note_bound(c, 2.0)


def moves_as_stored(x: ScaledArray, out_shapes) -> bool:
    """Whether a data-movement op can act on the stored codes of the formatted ``x``: its format has
    one scale for the whole tensor and one code per element, before and after (``out_shapes``), so
    the codes move exactly as the values do and the result stays in the format (per-tensor FP8
    into an FP8 GEMM, say, through the ``w.T`` of a linear layer)."""
    fmt, shape = x.fmt, tuple(x.data.shape)
    try:
        return all(
            tuple(fmt.scale_shape(s)) == () and tuple(fmt.value_shape(s)) == s for s in [shape, *map(tuple, out_shapes)]
        )
    except (ValueError, IndexError):
        return False


def structural(eqn, x: ScaledArray, *rest):
    """Apply a data-movement primitive to ``x.data`` and carry the block scales along.

    The new layout is found statically: the same primitive is applied to the map of block ids
    (eagerly, at trace time) and the coarsest block grid on which the result is constant is read
    off. This serves every layout and every static data-movement op with one code path.
    """
    multi = eqn.primitive.multiple_results
    if not per_tensor(x) and x.data.size > _MAX_LAYOUT_SIZE:
        x = fold(x)
    datas = bind_eqn(eqn, [x.data, *rest])
    if per_tensor(x):
        outs = [ScaledArray(d, x.scale) for d in datas]
    else:
        ids = block_ids(tuple(x.scale.shape), tuple(x.data.shape))
        with jax.ensure_compile_time_eval():
            new_ids = bind_eqn(eqn, [jnp.asarray(ids), *rest])
        outs = [ScaledArray(d, _grid_scale(x.scale, i)) for d, i in zip(datas, new_ids, strict=True)]
    return outs if multi else outs[0]


def isolate_scale(x):
    """``x`` with its (traced) scale sealed: behind an ``optimization_barrier`` and materialised
    once (:func:`_materialize`); other values unchanged.

    A rule builds its output scale from its operands' scales and static powers of two
    (``to_carrier``'s shift, split literals, sqrt(K) allowances). Under ``jit`` XLA re-associates
    such products across equations and folds the static factors of a long chain (e.g. the ``scale**2``
    of an l2 combine after ``scale**3``) into one constant, which can overflow float32 while the
    runtime factor underflows (``inf * 0 = NaN``), although every scale of the chain is in range.
    Sealing each rule's output scale keeps the compiled arithmetic what the rules wrote (as eagerly).
    """
    if isinstance(x, ScaledArray) and is_tracer(x.scale):
        scale = jax.lax.optimization_barrier(x.scale)
        if scale.dtype == F32:
            scale = _materialize(scale)
        return ScaledArray(x.data, scale, fmt=x.fmt, dtype=x._dtype)
    return x


@jax.custom_jvp
def _materialized(s):
    """``s`` (float32), computed once by XLA instead of again inside every consumer.

    XLA drops optimisation barriers before fusion and then copies cheap scalar producers into each
    consumer fusion. A scale is a chain of cheap scalar operations through every rule before it,
    and each scaled value feeds several consumers, so the chains were copied again and again: a
    scalified training step compiled to ~18x the instructions of the plain one, and a fusion's
    compile time grows faster than its size. XLA counts a division by a runtime value as expensive
    and never copies one, so ``s`` goes through an integer division of its bits,
    ``bits(s) / one`` with ``one = min(bits(s) | 1, 1)``: 1 for every bit pattern (the bits, NaN
    payloads and subnormals included, come through unchanged), but not a constant XLA can fold.
    The rule's scale chain then compiles once, as the root of its own small fusion.
    """
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    one = lax.min(lax.bitwise_or(bits, np.uint32(1)), np.uint32(1))
    return lax.bitcast_convert_type(lax.div(bits, one), F32)


@_materialized.defjvp
def _materialized_jvp(primals, tangents):
    return _materialized(*primals), tangents[0]


# A nested jit: traced once per scale shape and lowered once per program, not once per rule.
_materialize = jax.jit(_materialized)
