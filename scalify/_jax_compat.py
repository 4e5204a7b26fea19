"""The one module that touches JAX internals (``jax.extend.core``, ``jax.interpreters``).

Everything version-sensitive lives here, so a JAX upgrade is fixed in one place.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as prims
from jax.interpreters import ad, batching, mlir

Primitive = jex.Primitive
Literal = jex.Literal
ClosedJaxpr = jex.ClosedJaxpr
Jaxpr = jex.Jaxpr
Var = jex.Var
DropVar = jex.DropVar

p = prims

# Primitives that carry sub-jaxprs.
jit_p = prims.jit_p
custom_jvp_call_p = prims.custom_jvp_call_p
custom_vjp_call_p = prims.custom_vjp_call_p
cond_p = prims.cond_p
while_p = prims.while_p
scan_p = prims.scan_p
remat_p = prims.remat_p
closed_call_p = prims.closed_call_p
add_any_p = prims.add_jaxvals_p


def _lax_modules():
    import importlib

    mods = [prims]
    for name in (
        "jax._src.lax.lax",
        "jax._src.lax.slicing",
        "jax._src.lax.convolution",
        "jax._src.lax.windowed_reductions",
        "jax._src.lax.special",
        "jax._src.lax.control_flow",
        "jax._src.lax.parallel",
        "jax._src.lax.linalg",
        "jax._src.lax.fft",
        "jax._src.lax.ann",
    ):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:  # pragma: no cover - layout of jax._src changes between versions
            pass
    return mods


def all_lax_primitives() -> dict[str, Primitive]:
    """Every primitive that ``jax.extend.core.primitives`` or the ``lax`` modules define, by name."""
    out = {}
    for mod in _lax_modules():
        for attr in dir(mod):
            obj = getattr(mod, attr, None)
            if isinstance(obj, Primitive) and attr.endswith("_p"):
                out.setdefault(obj.name, obj)
    return dict(sorted(out.items()))


def lax_primitive(name: str):
    """A primitive by name (None when this JAX version does not have it)."""
    return all_lax_primitives().get(name)


def bind_eqn(eqn, invals):
    """Bind ``eqn``'s primitive on ``invals`` exactly as ``jax.core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
        invals = [*subfuns, *invals]
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def sub_jaxprs(jaxpr):
    """Jaxprs nested in the params of ``jaxpr``'s equations (one level)."""
    for eqn in jaxpr.eqns:
        yield from jex.jaxprs_in_params(eqn.params)


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def define_elementwise_primitive(name, impl, *, jvp=None):
    """A primitive whose output has its input's aval, lowered through ``impl``.

    ``jvp(primals, tangents, **params)`` defaults to straight-through (the tangent passes unchanged).
    Batching applies the primitive to the batched operand (the operation sees the whole batch).
    """
    prim = Primitive(name)
    prim.def_impl(impl)
    prim.def_abstract_eval(lambda x, **_: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))

    def default_jvp(primals, tangents, **params):
        return prim.bind(*primals, **params), tangents[0]

    ad.primitive_jvps[prim] = jvp or default_jvp

    def batcher(args, dims, **params):
        return prim.bind(*args, **params), dims[0]

    batching.primitive_batchers[prim] = batcher
    return prim
