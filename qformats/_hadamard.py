"""The random Hadamard transform of NVIDIA's NVFP4 training recipe.

``H = hadamard(n) @ diag(s) / sqrt(n)`` with Sylvester's ``n x n`` Hadamard matrix and a fixed
random sign vector ``s``: an orthogonal matrix (``H^T H = I``), applied to blocks of ``n``
consecutive elements along one axis. Transforming both inputs of a GEMM along its contracted axis
leaves the product unchanged (``(H a)^T (H b) = a^T b``) while spreading each block's outliers over
the block, which makes 4-bit block quantization of the two inputs more accurate.
"""

from __future__ import annotations

import attrs
import jax.numpy as jnp
import numpy as np
from jax import lax

from qformats import _layout


def sylvester(n: int) -> np.ndarray:
    """Sylvester's ``n x n`` Hadamard matrix (entries +-1), ``n`` a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@attrs.frozen
class RandomHadamard:
    """The ``size x size`` random Hadamard transform with sign vector drawn from ``seed``."""

    size: int = 16
    seed: int = 0

    def _signs(self) -> np.ndarray:
        """The random sign vector ``s`` (entries +-1) drawn from ``seed``."""
        return np.where(np.random.default_rng(self.seed).random(self.size) < 0.5, -1.0, 1.0)

    def matrix(self) -> np.ndarray:
        """``H = sylvester(size) @ diag(signs) / sqrt(size)`` as float32 (orthogonal)."""
        return (sylvester(self.size) * self._signs()[None, :] / np.sqrt(self.size)).astype(np.float32)

    def apply(self, x, axis: int):
        """``x`` with every block of ``size`` consecutive elements along ``axis`` multiplied by ``H``.

        A contraction of the ``(..., n / size, size, ...)`` view with ``H`` laid out so that its result
        is already in that view's order: along the last axis ``blocks @ H^T``; along another axis a
        dot batched over the leading axes and the block index, with ``H`` broadcast to each batch
        (a ``tensordot`` would put the transformed axis last and need a transpose of the result).
        """
        x = jnp.asarray(x)
        a = _layout.normalize_axis(axis, x.ndim, f"The {self.size}x{self.size} Hadamard transform")
        n = x.shape[a]
        if n % self.size:
            raise ValueError(
                f"the {self.size}x{self.size} Hadamard transform acts on blocks of {self.size} along axis {a}, "
                f"but that axis has length {n}; pad it to a multiple of {self.size} or turn the transform off."
            )
        lead = (*x.shape[:a], n // self.size)
        blocks = _layout.reshape(x, (*lead, self.size, *x.shape[a + 1 :]))
        h = jnp.asarray(self.matrix(), x.dtype)
        hi = lax.Precision.HIGHEST
        if a == x.ndim - 1:
            out = lax.dot_general(blocks, h, (((blocks.ndim - 1,), (1,)), ((), ())), precision=hi)
        else:
            batch = tuple(range(len(lead)))
            hb = jnp.broadcast_to(h, (*lead, self.size, self.size))
            out = lax.dot_general(hb, blocks, (((len(lead) + 1,), (len(lead),)), (batch, batch)), precision=hi)
        return _layout.reshape(out, x.shape)
