"""The walker under scalify: named scopes survive, errors name the user's source line."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import library_code
import numpy as np
import pytest

import qformats as qf
import scalify as jsa
from scalify import _walk

X = np.linspace(-2.0, 2.0, 64 * 32, dtype=np.float32).reshape(64, 32)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _walk.sub_jaxprs(eqn):
            yield from _all_eqns(getattr(sub, "jaxpr", sub))


def _scopes(closed) -> set[str]:
    return {str(e.source_info.name_stack) for e in _all_eqns(closed.jaxpr)}


def test_named_scope_survives_scalify():
    def f(x, w):
        with jax.named_scope("my_layer"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("my_head"):
            return jax.jit(lambda a: jnp.sum(a * a))(h)

    x = jsa.as_scaled_array(jnp.asarray(X[:8], jnp.float16))
    w = jsa.as_scaled_array(jnp.asarray(X[:32], jnp.float16))
    scopes = _scopes(jax.make_jaxpr(jsa.scalify(f))(x, w))
    assert "my_layer" in scopes and "my_head" in scopes, scopes


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _unsupported(v):
    return library_code.foreign_kernel(v)  # a library's jit around ffi_call, which has no scalify rule


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["plain", "user_jit"])
def test_rule_error_names_source_line_primitive_and_operands(wrap):
    sx = jsa.as_scaled_array(X, fmt=qf.MXFP8)
    with pytest.raises(jsa.ScalifyUnsupportedError, match=r"scalify\.ops\.dequantize") as info:
        jsa.scalify(wrap(_unsupported))(sx)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"test_walk.py:{_line_of(_unsupported, 'foreign_kernel')}" in notes, notes
    # foreign_kernel is a jit of library code (no user frames): its equation names the primitive and
    # operands, the jit equation around it the user's line; one note, not one per level
    assert "While transforming `ffi_call` (inside `jit` at " in notes, notes
    assert "ScaledArray[float32[64, 32], format mxfp8]" in notes, notes
    assert notes.count("While transforming") == 1


def test_error_from_a_registered_rule_is_annotated_too():
    def bad_rule(eqn, x):
        raise ValueError("rule failed")

    prim = jax.extend.core.Primitive("walk_test_op")
    prim.def_impl(lambda x: x)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    jsa.register_rule(prim, "nonlinear", "test only")(bad_rule)
    try:

        def f(v):
            return prim.bind(v)

        with pytest.raises(ValueError, match="rule failed") as info:
            jsa.scalify(f)(jsa.as_scaled_array(X))
        (note,) = [n for n in info.value.__notes__ if "While transforming" in n]
        assert "`walk_test_op`" in note and f"test_walk.py:{_line_of(f, 'prim.bind')}" in note
        assert "ScaledArray[float32[64, 32]" in note
    finally:
        from scalify._registry import RULES

        RULES.pop(prim, None)
