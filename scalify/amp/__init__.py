"""Automatic mixed precision and dynamic loss scaling (jaxamp-compatible API).

``amp(fn)`` runs matmuls and convolutions in ``compute_dtype`` (float16 by default) and the rest of
``fn`` in its own precision; policies keyed by lax primitive or ``jax.named_scope`` change that and
reach inside nested ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint`` and custom derivative rules.
A policy value may be a precision function, a dtype or a qformats format (fake quantization with a
straight-through gradient). ``dynamic_scale_grad`` / ``dynamic_scale_value_and_grad`` add dynamic
loss scaling. See ``docs/amp.md``.
"""

from scalify.amp._interpreter import amp, amp_stop
from scalify.amp._loss_scaling import (
    DynamicScalerState,
    all_finite,
    dynamic_scale_grad,
    dynamic_scale_value_and_grad,
)
from scalify.amp._policy import (
    MATMUL_PRIMITIVES,
    QuantizeInputs,
    cast_if_float,
    cast_tree,
    default_amp_policy,
    fake_quantize,
    use_compute_precision,
    use_format,
    use_original_precision,
    use_precision,
    use_widest_precision,
)

__all__ = [
    "MATMUL_PRIMITIVES",
    "DynamicScalerState",
    "QuantizeInputs",
    "all_finite",
    "amp",
    "amp_stop",
    "cast_if_float",
    "cast_tree",
    "default_amp_policy",
    "dynamic_scale_grad",
    "dynamic_scale_value_and_grad",
    "fake_quantize",
    "use_compute_precision",
    "use_format",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
]
