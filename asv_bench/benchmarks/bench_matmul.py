"""``dot_general`` of two scaled operands under ``scalify``, per format, against float32 and bfloat16.

Skipped (asv shows ``n/a``) while ``scalify.scalify`` is not importable, or when scalify has no
rule for a format's contraction.
"""

from __future__ import annotations

from ._common import (
    FORMAT_NAMES,
    MATMUL_SHAPES,
    block,
    get_format,
    interleaved_ratio,
    make_data,
    scalify_or_skip,
)


def _to_array(y):
    return y.to_array() if hasattr(y, "to_array") else y


class Matmul:
    params = (FORMAT_NAMES, list(MATMUL_SHAPES))
    param_names = ("format", "mxkxn")
    timeout = 300

    def setup(self, fmt_name, mkn):
        import jax
        import jax.numpy as jnp

        m, k, n = (int(d) for d in mkn.split("x"))
        a = jnp.asarray(make_data("gaussian", (m, k), seed=2))
        b = jnp.asarray(make_data("gaussian", (k, n), seed=3))
        self.f32 = jax.jit(jnp.matmul)
        self.bf16 = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        self.f32_args = (a, b)
        self.bf16_args = (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
        block(self.f32(*self.f32_args))
        block(self.bf16(*self.bf16_args))
        scalify, as_scaled_array = scalify_or_skip()
        fmt = get_format(fmt_name)
        fmt_b = fmt.replace(axis=0) if hasattr(fmt, "axis") else fmt  # rhs scaled along k too
        try:
            self.scaled_args = (as_scaled_array(a, fmt=fmt), as_scaled_array(b, fmt=fmt_b))
            self.scaled = jax.jit(lambda x, y: _to_array(scalify(jnp.matmul)(x, y)))
            block(self.scaled(*self.scaled_args))
        except Exception as e:  # no rule for this format yet: skip, do not fail the suite
            raise NotImplementedError(f"scalify cannot run a {fmt_name} matmul: {type(e).__name__}: {e}") from e

    def time_matmul_scaled(self, fmt_name, mkn):
        block(self.scaled(*self.scaled_args))

    def time_matmul_f32(self, fmt_name, mkn):
        block(self.f32(*self.f32_args))

    def time_matmul_bf16(self, fmt_name, mkn):
        block(self.bf16(*self.bf16_args))

    def track_matmul_ratio_to_f32(self, fmt_name, mkn):
        return interleaved_ratio(self.scaled, self.scaled_args, self.f32, self.f32_args, 11)

    def track_matmul_ratio_to_bf16(self, fmt_name, mkn):
        return interleaved_ratio(self.scaled, self.scaled_args, self.bf16, self.bf16_args, 11)

    track_matmul_ratio_to_f32.unit = track_matmul_ratio_to_bf16.unit = "ratio"
