"""scalify: scale propagation through JAX programs, for every quantization format.

import scalify as jsa
sx = jsa.as_scaled_array(x, scale=2.0)              # carrier form: data = x / 2
mx = jsa.as_scaled_array(w, fmt=qformats.MXFP8)     # quantized with a format
y = jsa.scalify(fn)(sx, mx)                         # ScaledArray outputs
"""

from scalify import (
    _rules_additive,
    _rules_collectives,
    _rules_commuting,
    _rules_control,
    _rules_multiplicative,
    _rules_nonlinear,
    _serialization,
    amp,
    io,
    lax,
    ops,
    recipes,
    tree,
)
from scalify._config import Pow2RoundMode, ScalifyConfig, get_config
from scalify._interpreter import scalify
from scalify._pow2 import pow2_round
from scalify._registry import GROUPS, RULES, Group, Rule, ScalifyUnsupportedError, register_rule
from scalify._scaled_array import ScaledArray, as_scaled_array, asarray, is_scaled_leaf, scaled_array
from scalify._sharding import device_put, scaled_sharding
from scalify._vmap import vmap
from scalify.ops import debug_callback

_serialization.install()

del _rules_additive, _rules_collectives, _rules_commuting, _rules_control, _rules_multiplicative, _rules_nonlinear

__all__ = [
    "GROUPS",
    "RULES",
    "Group",
    "Pow2RoundMode",
    "Rule",
    "ScaledArray",
    "ScalifyConfig",
    "ScalifyUnsupportedError",
    "as_scaled_array",
    "amp",
    "asarray",
    "debug_callback",
    "device_put",
    "get_config",
    "io",
    "is_scaled_leaf",
    "lax",
    "ops",
    "pow2_round",
    "recipes",
    "register_rule",
    "scaled_array",
    "scaled_sharding",
    "scalify",
    "tree",
    "vmap",
]
