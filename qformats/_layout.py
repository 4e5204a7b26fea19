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
    return tuple(n // b for n, b in zip(shape, block, strict=True))


def block_reduce(x, block, reducer=jnp.max):
    """Reduce ``x`` over each block: result has the scale-grid shape.

    ``jnp.max`` on floats is a ``reduce_window`` with window = stride = block (fastest on CPU);
    other reducers reshape to interleaved ``(g_0, b_0, g_1, b_1, ...)`` and reduce the odd axes.
    """
    shape = x.shape
    if not shape:
        return reducer(x)
    if reducer is jnp.max and jnp.issubdtype(x.dtype, jnp.floating):
        # One strided window per block: XLA CPU emits this as a single vectorized loop, about twice
        # as fast as reshape + reduce (same values, NaN propagates the same way).
        blk = tuple(int(b) for b in block)
        return lax.reduce_window(x, jnp.array(-jnp.inf, x.dtype), lax.max, blk, blk, "VALID")
    grid = grid_shape(shape, block)
    inter = [d for pair in zip(grid, block, strict=True) for d in pair]
    return reducer(x.reshape(inter), axis=tuple(range(1, 2 * len(shape), 2)))


def block_amax(x, block):
    """``max(|x|)`` over each block as float32; NaN if the block holds a NaN.

    Reduces the float32 bit patterns as integers: for non-negative floats integer order equals
    float order, and NaN patterns sort above Inf. (XLA's vectorised float max-reduction on CPU does
    not reliably propagate NaN.)
    """
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32) & 0x7FFFFFFF
    return lax.bitcast_convert_type(block_reduce(bits, block, jnp.max), jnp.float32)


def expand(scale, shape, block):
    """Broadcast a scale-grid array to the full data ``shape`` (each block gets its scale)."""
    if not shape:
        return scale.reshape(())
    grid = grid_shape(shape, block)
    scale = jnp.reshape(scale, grid)
    inter = [d for g in grid for d in (g, 1)]
    full = [d for pair in zip(grid, block, strict=True) for d in pair]
    return jnp.broadcast_to(scale.reshape(inter), full).reshape(shape)


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


def block_count(shape, block) -> int:
    return math.prod(grid_shape(shape, block))
