"""Scaled contractions at the sizes people train, under ``ScalifyConfig(contraction=...)``.

* ``ContractionMatmul``: ``n x n @ n x n`` with both operands in a format blocked along K
  (``fmt.aim``), n = 2048 and 4096 (``QFORMATS_BENCH_SMALL=1``: 128), against the float32 matmul
  of the dequantized operands in the same process: time ratio (interleaved medians) and memory
  ratio (``compiled.memory_analysis()``: arguments + outputs + temporaries).
* ``GPTBlockScalified``: a GPT block (d_model 1024, 4 heads, MLP 4096, sequence 256, batch 8)
  forward + backward with MXFP8 / NVFP4 parameters and input under ``scalify``, against the plain
  float32 step.
"""

from __future__ import annotations

import functools

from ._common import SMALL, block, get_format, interleaved_ratio, make_data, scalify_or_skip
from .bench_recipes import BATCH, D_MODEL, SEQ, gpt_block_loss, gpt_block_params

CONTRACTION_FORMATS = ("fp8_e4m3", "mxfp8", "mxfp4", "nvfp4")
SIZES = (128,) if SMALL else (2048, 4096)
STRATEGIES = ("auto", "dequantize", "native", "scaled_dot")


def _footprint(jitted, *args) -> int:
    m = jitted.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


class ContractionMatmul:
    params = (CONTRACTION_FORMATS, list(SIZES), ["auto"])
    param_names = ("format", "n", "contraction")
    timeout = 900

    def setup(self, fmt_name, n, strategy):
        import jax
        import jax.numpy as jnp

        import scalify

        _, as_scaled_array = scalify_or_skip()
        fmt = get_format(fmt_name)
        a = jnp.asarray(make_data("gaussian", (n, n), seed=2))
        b = jnp.asarray(make_data("gaussian", (n, n), seed=3))
        self.scaled_args = (as_scaled_array(a, fmt=fmt.aim(1, 0)), as_scaled_array(b, fmt=fmt.aim(0, 1)))
        self.f32_args = tuple(x.to_array() for x in self.scaled_args)
        self.f32 = jax.jit(jnp.matmul)
        # A fresh function per configuration: jit's cache does not see the ScalifyConfig.
        with scalify.ScalifyConfig(contraction=strategy):
            fn = jax.jit(lambda x, y: scalify.scalify(jnp.matmul)(x, y).to_array())
            self.scaled = fn.lower(*self.scaled_args).compile()
        self.memory_ratio = _footprint(fn, *self.scaled_args) / _footprint(self.f32, *self.f32_args)
        block(self.scaled(*self.scaled_args))
        block(self.f32(*self.f32_args))

    def time_scaled(self, fmt_name, n, strategy):
        block(self.scaled(*self.scaled_args))

    def time_f32(self, fmt_name, n, strategy):
        block(self.f32(*self.f32_args))

    def track_ratio_to_f32(self, fmt_name, n, strategy):
        return interleaved_ratio(self.scaled, self.scaled_args, self.f32, self.f32_args, 7 if n <= 2048 else 3)

    def track_memory_ratio(self, fmt_name, n, strategy):
        return self.memory_ratio

    track_ratio_to_f32.unit = track_memory_ratio.unit = "ratio"


class GPTBlockScalified:
    params = (("mxfp8", "nvfp4"),)
    param_names = ("format",)
    timeout = 900

    def setup(self, fmt_name):
        import jax
        import jax.numpy as jnp

        scalify, as_scaled_array = scalify_or_skip()
        fmt = get_format(fmt_name)
        loss = functools.partial(gpt_block_loss, heads=4)
        params = gpt_block_params()
        x = jnp.asarray(make_data("gaussian", (BATCH, SEQ, D_MODEL), seed=99))
        self.plain_args = (params, x)
        self.scaled_args = (jax.tree.map(lambda w: as_scaled_array(w, fmt=fmt), params), as_scaled_array(x, fmt=fmt))
        self.plain = jax.jit(jax.value_and_grad(loss))
        self.scaled = jax.jit(scalify(jax.value_and_grad(loss)))
        block(self.plain(*self.plain_args))
        block(self.scaled(*self.scaled_args))

    def time_plain(self, fmt_name):
        block(self.plain(*self.plain_args))

    def time_scaled(self, fmt_name):
        block(self.scaled(*self.scaled_args))

    def track_step_ratio(self, fmt_name):
        return interleaved_ratio(self.scaled, self.scaled_args, self.plain, self.plain_args, 5)

    track_step_ratio.unit = "ratio"
