"""Every non-public JAX import used by :mod:`scalify.amp` lives here, so a JAX upgrade touches one file.

Everything else in the subpackage uses public ``jax`` / ``jax.extend`` names through this module.
"""

from __future__ import annotations

import contextlib

import jax.extend.core as jex_core
import jax.extend.linear_util as _lu
from jax.extend.core import primitives as _prims

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
DropVar = jex_core.DropVar
Primitive = jex_core.Primitive

jit_p = _prims.jit_p
scan_p = _prims.scan_p
while_p = _prims.while_p
cond_p = _prims.cond_p
remat_p = _prims.remat_p
custom_jvp_call_p = _prims.custom_jvp_call_p
custom_vjp_call_p = _prims.custom_vjp_call_p

try:  # private: name stacks carry the jax.named_scope of every equation
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - depends on the JAX version
    _siu = None


def scope_names(name_stack) -> list[str]:
    """Named scopes of an equation's name stack, outermost first, transform wrappers removed.

    ``jvp(outer)/inner`` gives ``["outer", "inner"]``.
    """
    stack = getattr(name_stack, "stack", None)
    if stack is not None and _siu is not None:
        names = [e.name for e in stack if isinstance(e, _siu.Scope)]
    else:  # fall back on parsing the string form
        names = []
        for part in str(name_stack).split("/"):
            while part.endswith(")") and "(" in part:
                part = part[part.index("(") + 1 : -1]
            names.append(part)
    out = []
    for n in names:
        out.extend(p for p in n.split("/") if p)
    return out


def current_name_stack():
    """The name stack of the code being traced right now (``jax.named_scope`` blocks around us)."""
    if _siu is None:  # pragma: no cover
        return ""
    return _siu.current_name_stack()


@contextlib.contextmanager
def eqn_context(eqn, base_name_stack):
    """Re-emit an equation with its own traceback, name stack (so scopes survive amp) and context."""
    eqn_ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with contextlib.ExitStack() as stack:
        if _siu is not None:
            ns = base_name_stack + eqn.source_info.name_stack
            stack.enter_context(_siu.user_context(eqn.source_info.traceback, name_stack=ns))
        if eqn_ctx is not None:
            stack.enter_context(eqn_ctx)
        yield


def get_bind_params(primitive, params):
    """``(leading_args, params)`` such that ``primitive.bind(*leading_args, *invals, **params)`` works.

    Older JAX returned ``(subfuns, params)``; JAX 0.10 returns params holding ``subfuns`` itself.
    """
    out = primitive.get_bind_params(params)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return tuple(out[0]), out[1]
    return (), dict(out)


def fresh_name_stack():
    """Trace a sub-jaxpr with an empty name stack, as ``jax.jit`` does for its body."""
    if _siu is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _siu.reset_name_stack()


def wrap_init(f, like):
    """``lu.wrap_init(f)`` with the debug info of the WrappedFun ``like``."""
    return _lu.wrap_init(f, debug_info=getattr(like, "debug_info", None))
