"""Quantize / dequantize speed, speed relative to ``x * 2``, storage and accuracy, per format.

Parametrized at import time over every registered format (``qformats.list_formats()``, which
includes entry-point plug-ins) plus ``QFORMATS_BENCH_FORMATS``; see ``_common.py``.
"""

from __future__ import annotations

import numpy as np

from ._common import (
    DATA_KINDS,
    FORMAT_NAMES,
    RATIO_SHAPE,
    SHAPES,
    SQNR_SHAPE,
    block,
    get_format,
    interleaved_ratio,
    make_data,
    parse_shape,
    sqnr_db,
    times_two,
)


class _FormatShape:
    params = (FORMAT_NAMES, SHAPES)
    param_names = ("format", "shape")
    timeout = 300

    def setup(self, fmt_name, shape):
        import jax
        import jax.numpy as jnp

        self.shape = parse_shape(shape)
        self.fmt = get_format(fmt_name, self.shape)
        self.x = jnp.asarray(make_data("gaussian", self.shape))
        self.quantize = jax.jit(self.fmt.quantize)
        self.dequantize = jax.jit(self.fmt.dequantize)
        self.q = block(self.quantize(self.x))
        block(self.dequantize(*self.q))


class Quantize(_FormatShape):
    """Wall time of one jitted, warm quantize / dequantize (``block_until_ready``)."""

    def time_quantize(self, fmt_name, shape):
        block(self.quantize(self.x))

    def time_dequantize(self, fmt_name, shape):
        block(self.dequantize(*self.q))

    def peakmem_quantize(self, fmt_name, shape):
        block(self.quantize(self.x))


class Ratio(_FormatShape):
    """Median time over the median time of ``x * 2`` under jit on the same array, interleaved.

    Machine-independent: the targets in docs/performance.md are in these units.
    """

    params = (FORMAT_NAMES, [RATIO_SHAPE] if RATIO_SHAPE in SHAPES else SHAPES[-1:])
    unit = "ratio to x*2"
    repeats_inner = 31

    def setup(self, fmt_name, shape):
        super().setup(fmt_name, shape)
        self.ref = times_two()
        block(self.ref(self.x))

    def track_quantize_ratio(self, fmt_name, shape):
        return interleaved_ratio(self.quantize, (self.x,), self.ref, (self.x,), self.repeats_inner)

    def track_dequantize_ratio(self, fmt_name, shape):
        return interleaved_ratio(self.dequantize, self.q, self.ref, (self.x,), self.repeats_inner)

    def track_eager_quantize_ratio(self, fmt_name, shape):
        """``fmt.quantize(x)`` called eagerly over the same quantize under ``jax.jit``."""
        return interleaved_ratio(self.fmt.quantize, (self.x,), self.quantize, (self.x,), self.repeats_inner)


class FakeQuantize(_FormatShape):
    """``fmt.fake_quantize(x)`` (what recipes and amp feed their GEMMs) against the round trip
    ``dequantize(*quantize(x))`` it equals, and against ``x * 2``; both jitted, interleaved."""

    params = Ratio.params
    unit = "ratio"
    repeats_inner = 15

    def setup(self, fmt_name, shape):
        import jax

        super().setup(fmt_name, shape)
        fmt = self.fmt
        self.fake = jax.jit(fmt.fake_quantize)
        self.round_trip = jax.jit(lambda x: fmt.dequantize(*fmt.quantize(x)))
        self.ref = times_two()
        for f in (self.fake, self.round_trip, self.ref):
            block(f(self.x))

    def track_fake_quantize_over_round_trip(self, fmt_name, shape):
        return interleaved_ratio(self.fake, (self.x,), self.round_trip, (self.x,), self.repeats_inner)

    def track_fake_quantize_ratio(self, fmt_name, shape):
        return interleaved_ratio(self.fake, (self.x,), self.ref, (self.x,), self.repeats_inner)


class Storage:
    """Bits per element of ``data`` plus scales (from ``fmt.nbytes``); no timing."""

    params = (FORMAT_NAMES, SHAPES)
    param_names = ("format", "shape")
    unit = "bits/element"

    def track_bits_per_element(self, fmt_name, shape):
        return get_format(fmt_name).bits_per_element(parse_shape(shape))

    def track_bytes_per_element(self, fmt_name, shape):
        shape = parse_shape(shape)
        return get_format(fmt_name).nbytes(shape) / float(np.prod(shape))

    track_bytes_per_element.unit = "bytes/element"


class Accuracy:
    """SQNR (dB) of a quantize/dequantize round trip on three kinds of data."""

    params = (FORMAT_NAMES, list(DATA_KINDS))
    param_names = ("format", "data")
    unit = "dB"

    def setup(self, fmt_name, kind):
        get_format(fmt_name, parse_shape(SQNR_SHAPE))
        self.x = make_data(kind, parse_shape(SQNR_SHAPE), seed=1)

    def track_sqnr_db(self, fmt_name, kind):
        import jax
        import jax.numpy as jnp

        fmt = get_format(fmt_name)
        y = jax.jit(lambda a: fmt.dequantize(*fmt.quantize(a)))(jnp.asarray(self.x))
        return sqnr_db(self.x, y)
