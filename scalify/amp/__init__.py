"""Automatic mixed precision and dynamic loss scaling (jaxamp-compatible API).

``amp(fn)`` runs matmuls, convolutions, additions and subtractions in ``compute_dtype`` (float16 by
default), ``exp`` / ``log`` / ``mul`` / ``div`` in float32 and the rest of ``fn`` in its own precision
(jaxamp's default policy); policies keyed by lax primitive or ``jax.named_scope`` change that and
reach inside nested ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint`` and custom derivative rules.
A policy value may be a precision function, a dtype or a qformats format (fake quantization with a
straight-through gradient). ``dynamic_scale_grad`` / ``dynamic_scale_value_and_grad`` /
``dynamic_scale_tx`` add dynamic loss scaling. See ``docs/amp.md``.
"""

from scalify.amp._interpreter import amp, amp_stop
from scalify.amp._loss_scaling import (
    DynamicScalerState,
    all_finite,
    default_scale_fn,
    default_unscale_fn,
    dynamic_scale_grad,
    dynamic_scale_tx,
    dynamic_scale_value_and_grad,
)
from scalify.amp._policy import (
    HIGH_PRECISION_PRIMITIVES,
    LOW_PRECISION_PRIMITIVES,
    MATMUL_PRIMITIVES,
    QuantizeInputs,
    cast_if_float,
    cast_tree,
    default_amp_policy,
    fake_quantize,
    matmul_amp_policy,
    use_compute_precision,
    use_format,
    use_original_precision,
    use_precision,
    use_widest_precision,
)

__all__ = [
    "HIGH_PRECISION_PRIMITIVES",
    "LOW_PRECISION_PRIMITIVES",
    "MATMUL_PRIMITIVES",
    "DynamicScalerState",
    "QuantizeInputs",
    "all_finite",
    "amp",
    "amp_stop",
    "cast_if_float",
    "cast_tree",
    "default_amp_policy",
    "default_scale_fn",
    "default_unscale_fn",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
    "fake_quantize",
    "matmul_amp_policy",
    "use_compute_precision",
    "use_format",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
]
