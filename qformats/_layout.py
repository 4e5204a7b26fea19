"""Scale layouts: which elements share one scale.

Every built-in layout is a *block grid*: for a data shape ``(n_0, ..., n_k)`` it names a block
shape ``(b_0, ..., b_k)`` with ``b_i`` dividing ``n_i``; the scale has shape ``(n_i // b_i)`` and
element ``x[i_0, ..., i_k]`` uses ``scale[i_0 // b_0, ..., i_k // b_k]``.

* per-tensor: ``b = n`` (one block, scale shape ``()`` is kept as a 0-d array);
* per-channel on axis ``a``: ``b_a = 1``, ``b_i = n_i`` elsewhere;
* blocked (MX, NVFP4): ``b_a = block_size``, ``b_i = 1`` elsewhere.

Rules in ``scalify`` reason about the block tuple alone, so they work for any layout a user writes.
"""

from __future__ import annotations

import abc
import math

import attrs
import jax
import jax.numpy as jnp
from jax import lax


class Layout(abc.ABC):
    """Maps a data shape to the block shape whose elements share one scale."""

    @abc.abstractmethod
    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-axis block extent for data of ``shape`` (validates the shape)."""

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the scale array for data of ``shape``."""
        return grid_shape(shape, self.block_shape(shape))

    def describe(self) -> str:
        return repr(self)


def normalize_axis(axis: int, ndim: int, what: str) -> int:
    """``axis`` as a non-negative index, with an error naming the format and the fix."""
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{what} scales along axis {axis}, but the input has only {ndim} dimension(s). "
            f"Pass an array with at least {axis + 1 if axis >= 0 else -axis} dimensions, or choose "
            f"another axis with fmt.replace(axis=...)."
        )
    return axis % ndim


def grid_shape(shape, block):
    """``shape // block`` per axis; a block spanning a whole empty axis (extent 0) is one block, so
    per-tensor and per-channel layouts of a 0-size array keep their usual scale shapes."""
    return tuple(n // b if b else 1 for n, b in zip(shape, block, strict=True))


def block_reduce(x, block, reducer=jnp.max):
    """Reduce ``x`` over each block: result has the scale-grid shape.

    Implemented as a reshape to interleaved ``(g_0, b_0, g_1, b_1, ...)`` then a reduction over the
    odd axes, which XLA fuses into the producer.
    """
    shape = x.shape
    if not shape:
        return reducer(x)
    grid = grid_shape(shape, block)
    inter = [d for pair in zip(grid, block, strict=True) for d in pair]
    return reducer(reshape(x, inter), axis=tuple(range(1, 2 * len(shape), 2)))


def reshape(x, shape):
    """``x.reshape(shape)``, also for arrays sharded over ``Explicit`` mesh axes.

    With explicit sharding, the sharding is part of the array's type and JAX infers a reshape's
    output sharding only for one split or one merge of an axis. The layouts reshape more freely
    (``(16, 256) -> (16, 1, 8, 32)`` and back), so the output sharding is worked out here and
    passed as ``out_sharding``: within each group of axes whose sizes multiply to the same number,
    the sharding of the group's leading axis moves to the group's leading output axis when that
    axis splits evenly over it (no data moves), and the group is replicated otherwise (XLA then
    moves the data, as GSPMD does for such reshapes under ``Auto`` axes).
    """
    shape = tuple(int(d) for d in shape)
    out_sharding = _explicit_reshape_sharding(x, shape)
    if out_sharding is None:
        return x.reshape(shape) if hasattr(x, "reshape") else jnp.reshape(x, shape)
    return jnp.reshape(x, shape, out_sharding=out_sharding)


def explicit_sharding(x):
    """The sharding in ``x``'s type when some axis of it is explicitly sharded, else ``None``."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None or not isinstance(x, jax.Array) or not x.size:  # numpy, Python scalars, empty
        return None
    sharding = getattr(typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(e is None for e in spec):
        return None
    return sharding


def _explicit_reshape_sharding(x, shape):
    """The output sharding for :func:`reshape`, or ``None`` when ``x`` has no explicit sharding."""
    sharding = explicit_sharding(x)
    if sharding is None:
        return None
    spec = sharding.spec
    mesh_shape = dict(sharding.mesh.shape)
    in_shape = tuple(x.shape)
    entries = tuple(spec) + (None,) * (len(in_shape) - len(tuple(spec)))
    out = [None] * len(shape)
    i = j = 0
    while i < len(in_shape) and j < len(shape):
        # the smallest run of input axes [i, i2) and output axes [j, j2) with equal products
        i2, j2, pi, pj = i + 1, j + 1, in_shape[i], shape[j]
        while pi != pj:
            if pi < pj:
                pi, i2 = pi * in_shape[i2], i2 + 1
            else:
                pj, j2 = pj * shape[j2], j2 + 1
        lead_in = next((a for a in range(i, i2) if in_shape[a] != 1), None)
        lead_out = next((b for b in range(j, j2) if shape[b] != 1), None)
        entry = None if lead_in is None else entries[lead_in]
        if entry is not None and all(entries[a] is None for a in range(i, i2) if a != lead_in):
            names = entry if isinstance(entry, tuple) else (entry,)
            if shape[lead_out] % math.prod(int(mesh_shape[n]) for n in names) == 0:
                out[lead_out] = entry
        i, j = i2, j2
    return sharding.update(spec=spec.update(partitions=tuple(out)))


def _abs_bits(x):
    return lax.bitcast_convert_type(x, jnp.int32) & 0x7FFFFFFF


def _max_over_rows(bits):
    """Max over axis 0 of non-negative int32 ``bits`` of shape ``(R, C)``, as int32 ``(C,)``.

    Reduced first in groups of a few rows (``max`` over axis 1 of ``(R // g, g, C)``), which XLA
    emits as one vectorised loop along ``C`` (a pass at memory speed), then over the ``R // g``
    partial rows. The partial result is viewed as ``uint32`` (same order for these values) so that
    XLA does not merge the two reductions back into one large reduction, which it would rewrite
    into a much slower tree of reduce-windows.
    """
    rows, cols = bits.shape
    for g in (16, 8, 32, 4):
        if rows % g == 0 and rows >= 2 * g:
            part = jnp.max(reshape(bits, (rows // g, g, cols)), axis=1)
            part = lax.bitcast_convert_type(part, jnp.uint32)
            return lax.bitcast_convert_type(jnp.max(part, axis=0), jnp.int32)
    return jnp.max(bits, axis=0)


def _columns_view(shape, block):
    """``(R, C)`` when each block is all of some leading axes (and one element of the rest), so
    that the block maxima are column maxima of ``x.reshape(R, C)``; else ``None``.

    Covers per-tensor layouts (all axes reduced; the flat array is then viewed with a row of a
    power-of-two length) and per-channel layouts whose channel axes are trailing.
    """
    nd = len(shape)
    lead = 0
    while lead < nd and block[lead] == shape[lead]:
        lead += 1
    if any(b != 1 for b in block[lead:]):
        return None
    size = math.prod(shape)
    if lead == nd:  # whole tensor
        for cols in (2048, 1024, 512, 256, 128, 64):
            if size % cols == 0 and size // cols >= 32:
                return size // cols, cols
        return None
    rows, cols = math.prod(shape[:lead]), math.prod(shape[lead:])
    return (rows, cols) if rows >= 8 and cols >= 8 else None


def fast_block_max(x, block):
    """Float ``max(|x|)`` over blocks along the last axis, with a ``reduce_window`` (window = stride
    = block); ``None`` for other layouts, where :func:`block_amax` is exact and as fast.

    About 2x faster on CPU than reducing the bit patterns, but blind to NaN (XLA's vectorised float
    max on CPU drops it), and a block whose largest magnitude is subnormal may come out as 0 or as
    another of its subnormals (XLA on CPU treats subnormals as zero). Callers must check for NaN
    themselves (see :func:`block_amax`), and must not depend on the value of a subnormal maximum.
    """
    x = jnp.asarray(x, jnp.float32)
    if not has_fast_block_max(x.shape, block):
        return None
    blk = tuple(int(b) for b in block)
    return lax.reduce_window(jnp.abs(x), -jnp.inf, lax.max, blk, blk, "VALID")


def has_fast_block_max(shape, block) -> bool:
    """Whether :func:`fast_block_max` applies to this layout (blocks along the last axis)."""
    shape = tuple(shape)
    if not shape or math.prod(shape) == 0:
        return False
    grid = grid_shape(shape, block)
    if block[-1] == 1 and any(g > 1 for g in grid[:-1]):
        return False
    if any(b > 1 and g > 1 for b, g in zip(block[:-1], grid[:-1], strict=True)):
        # 2-D tiles: a windowed float max over several rows is ~3x slower on CPU than the
        # integer reduction over the reshaped tiles (block_reduce), which is exact as well.
        return False
    return _columns_view(shape, block) is None


def block_amax(x, block, *, exact: bool = False):
    """``max(|x|)`` over each block as float32; NaN if the block holds a NaN.

    The exact result is the maximum of the float32 bit patterns as integers: for non-negative
    floats integer order equals float order, and NaN patterns sort above Inf. (XLA's vectorised
    float max-reduction on CPU does not reliably propagate NaN.)

    Per-tensor layouts, per-channel layouts with trailing channel axes and blocks along a leading
    axis always get the exact result, from an integer reduction that XLA vectorises. For blocks
    along the last axis a faster float reduction is used when ``x`` holds no NaN; it equals the
    exact result except in a block whose largest magnitude is subnormal, which may come out as 0
    (XLA on CPU treats subnormals as zero). ``exact=True`` always gives the exact result.
    """
    x = jnp.asarray(x, jnp.float32)
    grid = grid_shape(x.shape, block)
    if not x.size:  # the max over no elements: 0, as for an all-zero block
        return jnp.zeros(grid, jnp.float32)
    cols = _columns_view(x.shape, block)
    if cols is not None:
        # One vectorised pass over the rows of a 2-D view: exact, and NaN-aware at no extra cost.
        m = _max_over_rows(reshape(_abs_bits(x), cols))
        if math.prod(grid) == 1:  # per-tensor: the columns of the view are not the scale grid
            m = jnp.max(m)
        return reshape(lax.bitcast_convert_type(m, jnp.float32), grid)

    def exact_amax(x):
        return lax.bitcast_convert_type(block_reduce(_abs_bits(x), block, jnp.max), jnp.float32)

    fast = None if exact else fast_block_max(x, block)
    if fast is None:
        # blocks along a leading axis: the integer reduce over the reshaped array is
        # already contiguous and fast there.
        return exact_amax(x)
    # The float reduce_window is blind to NaN; a whole-tensor sum is NaN whenever x holds a NaN
    # (or +Inf and -Inf). Only then is the integer reduction run, so the result equals it bit for
    # bit. lax.cond runs one branch (under vmap both, which is still correct).
    return lax.cond(has_nan(x), lambda: exact_amax(x), lambda: fast)


def has_nan(x):
    """Scalar bool, true when ``x`` holds a NaN (also when it holds both +Inf and -Inf): one sum."""
    return jnp.isnan(jnp.sum(x))


def expand(scale, shape, block):
    """Broadcast a scale-grid array to the full data ``shape`` (each block gets its scale)."""
    if not shape:
        return reshape(scale, ())
    grid = grid_shape(shape, block)
    scale = reshape(scale, grid)
    inter = [d for g in grid for d in (g, 1)]
    full = [d for pair in zip(grid, block, strict=True) for d in pair]
    return reshape(jnp.broadcast_to(reshape(scale, inter), full), shape)


@attrs.frozen
class PerTensor(Layout):
    """One scale for the whole tensor."""

    def block_shape(self, shape):
        return tuple(shape)

    def scale_shape(self, shape):
        return ()

    def describe(self):
        return "per-tensor"


@attrs.frozen
class PerChannel(Layout):
    """One scale per index of ``axis`` (the channel axis)."""

    axis: int = -1

    def block_shape(self, shape):
        a = normalize_axis(self.axis, len(shape), "This per-channel format")
        return tuple(1 if i == a else n for i, n in enumerate(shape))

    def describe(self):
        return f"per-channel (axis {self.axis})"


@attrs.frozen
class Blocked(Layout):
    """Blocks of ``size`` consecutive elements along ``axis``; one scale per block."""

    axis: int = -1
    size: int = 32

    def block_shape(self, shape):
        a = normalize_axis(self.axis, len(shape), f"This block-{self.size} format")
        n = shape[a]
        if n % self.size:
            raise ValueError(
                f"Block scaling groups {self.size} consecutive elements along axis {self.axis}, but "
                f"the input has shape {tuple(shape)}: axis {self.axis} has length {n}, which is not "
                f"a multiple of {self.size}. Pad that axis to a multiple of {self.size} (e.g. with "
                f"jnp.pad) or block along another axis with fmt.replace(axis=...)."
            )
        return tuple(self.size if i == a else 1 for i in range(len(shape)))

    def describe(self):
        return f"blocks of {self.size} along axis {self.axis}"


@attrs.frozen
class Tiles(Layout):
    """Square tiles: ``size`` elements along ``axis`` by ``size`` along ``tile_axis``; one scale each.

    NVIDIA's NVFP4 training recipe quantizes weights in 16 x 16 tiles, so that a weight and its
    transpose quantize to the same values (the forward GEMM contracts one tile axis, the input
    gradient GEMM the other).
    """

    axis: int = -1
    tile_axis: int = -2
    size: int = 16

    def block_shape(self, shape):
        what = f"This {self.size}x{self.size}-tile format"
        a = normalize_axis(self.axis, len(shape), what)
        t = normalize_axis(self.tile_axis, len(shape), what)
        if a == t:
            raise ValueError(f"{what} needs two different axes; axis and tile_axis are both {a}.")
        for i in (a, t):
            if shape[i] % self.size:
                raise ValueError(
                    f"{what} tiles axes {a} and {t}, but the input has shape {tuple(shape)}: axis {i} has "
                    f"length {shape[i]}, not a multiple of {self.size}. Pad that axis, or use 1-D blocks."
                )
        return tuple(self.size if i in (a, t) else 1 for i in range(len(shape)))

    def describe(self):
        return f"{self.size}x{self.size} tiles on axes ({self.axis}, {self.tile_axis})"


@attrs.frozen
class AlongAxis(Layout):
    """One scale per line along ``axis``: a block is all of ``axis`` and one index of every other.

    For a matrix contracted along ``axis`` this is one scale per row (or column) of the GEMM,
    torchao's "rowwise" / "axiswise" float8 scaling.
    """

    axis: int = -1

    def block_shape(self, shape):
        a = normalize_axis(self.axis, len(shape), "This axiswise format")
        return tuple(n if i == a else 1 for i, n in enumerate(shape))

    def describe(self):
        return f"one scale per line along axis {self.axis}"
