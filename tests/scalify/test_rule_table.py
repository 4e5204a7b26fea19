"""The rule table is strict: groups are declared properties, a primitive has one rule, and the
properties a group declares are the ones the interpreter applies (keep_format on ``mul``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qformats as qf
import scalify as jsa
from scalify._registry import GROUPS, RULES, Group, register_rule

X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))


def _mx_ref(v):
    """The MXFP8 value of a float32 array (NumPy in, qformats' own round trip out)."""
    return np.asarray(qf.MXFP8.dequantize(*qf.MXFP8.quantize(jnp.asarray(v, jnp.float32))))


@pytest.mark.parametrize(
    "fn",
    [lambda v: v * v, lambda v: v * 3.0, lambda v: v / 3.0, lambda v: v + v, lambda v: -v],
    ids=["mul", "mul-scalar", "div-scalar", "add", "neg"],
)
def test_keep_format_applies_to_elementwise_rules(fn):
    sx = jsa.as_scaled_array(X, fmt=qf.MXFP8)
    with jsa.ScalifyConfig(keep_format=True):
        out = jsa.scalify(lambda v: fn(v))(sx)
    assert out.fmt == qf.MXFP8
    # The float32 result of the dequantized input, re-quantized: exactly the format's rounding.
    np.testing.assert_array_equal(np.asarray(out), _mx_ref(fn(np.asarray(sx))))


def test_keep_format_off_gives_a_carrier():
    out = jsa.scalify(lambda v: v * v)(jsa.as_scaled_array(X, fmt=qf.MXFP8))
    assert out.fmt is None


def test_every_rule_has_a_declared_group():
    assert RULES
    for prim, rule in RULES.items():
        assert isinstance(rule.group, Group), prim
        assert GROUPS[rule.group.name] is rule.group, prim


def test_second_registration_raises_unless_overwrite():
    old = RULES[lax.exp_p]
    with pytest.raises(ValueError, match=r"already have a scalify rule.*overwrite=True"):
        register_rule(lax.exp_p, "nonlinear", "again")(lambda eqn, x: x)
    assert RULES[lax.exp_p] is old
    try:
        register_rule(lax.exp_p, "nonlinear", "replaced", overwrite=True)(old.fn)
        assert RULES[lax.exp_p].doc == "replaced"
    finally:
        RULES[lax.exp_p] = old


def test_unknown_group_raises():
    with pytest.raises(ValueError, match="unknown rule group 'multiplicative-elementwise'"):
        register_rule(lax.exp_p, "multiplicative-elementwise", "typo")


def test_user_rule_on_a_new_primitive():
    """The extension point: a new primitive gets a rule once; the rule sees carriers."""
    from jax.extend.core import Primitive

    double_p = Primitive("test_double")
    double_p.def_impl(lambda x: 2 * x)
    double_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    try:

        @register_rule(double_p, "commuting", "doubles the scale.")
        def _rule(eqn, x):
            return jsa.ScaledArray(x.data, 2 * x.scale)

        sx = jsa.as_scaled_array(X, scale=np.float32(4.0))
        out = jsa.scalify(lambda v: double_p.bind(v))(sx)
        assert float(out.scale) == 8.0
        np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(X))
    finally:
        RULES.pop(double_p, None)
