"""The one module that touches non-public JAX (``jax.extend``, ``jax.interpreters``, ``jax._src``).

Everything version-sensitive lives here, for scalify, amp and the recipes alike, so a JAX upgrade
is fixed in one place.
"""

from __future__ import annotations

import contextlib
import inspect

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as prims
import jax.extend.linear_util as _lu
from jax.interpreters import ad, batching, mlir

try:  # private: name stacks carry the jax.named_scope of every equation, tracebacks its source line
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - depends on the JAX version
    _siu = None

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
name_p = prims.name_p  # jax.ad_checkpoint.checkpoint_name
closed_call_p = prims.closed_call_p
linear_solve_p = prims.linear_solve_p  # jax.lax.custom_linear_solve
add_any_p = prims.add_jaxvals_p
jaxprs_in_params = jex.jaxprs_in_params


def _private(module: str, name: str):
    """``module.name`` from ``jax._src`` (None when this JAX version does not have it)."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:  # pragma: no cover - layout of jax._src changes between versions
        return None


shard_map_p = _private("jax._src.shard_map", "shard_map_p")
# Writes into a jax.ref (``r[...] = v`` binds swap, ``r[...] += v`` addupdate).
ref_write_ps = [q for q in (prims.swap_p, _private("jax._src.state.primitives", "addupdate_p")) if q is not None]
# jax.pure_callback and jax.experimental.io_callback (not named by jax.extend).
host_callback_ps = [c for c in (_private("jax._src.callback", n) for n in ("pure_callback_p", "io_callback_p")) if c]

# Collectives of shard_map and sharding annotations (JAX 0.10: psum of a varying value binds
# psum_invariant, the vma checker inserts pvary; older JAX has neither; reshard_p is what jnp inserts
# between differently sharded operands). Not all are named by jax.extend.
_PAR = "jax._src.lax.parallel"
psum_p = getattr(prims, "psum_p", None) or _private(_PAR, "psum_p")
psum_invariant_p = _private(_PAR, "psum_invariant_p")
pmax_p = getattr(prims, "pmax_p", None) or _private(_PAR, "pmax_p")
pmin_p = getattr(prims, "pmin_p", None) or _private(_PAR, "pmin_p")
all_gather_p = getattr(prims, "all_gather_p", None) or _private(_PAR, "all_gather_p")
ppermute_p = getattr(prims, "ppermute_p", None) or _private(_PAR, "ppermute_p")
all_to_all_p = getattr(prims, "all_to_all_p", None) or _private(_PAR, "all_to_all_p")
reduce_scatter_p = _private(_PAR, "reduce_scatter_p")  # psum_scatter
pvary_p = _private("jax._src.core", "pvary_p") or _private(_PAR, "pvary_p")
_PJIT = "jax._src.pjit"
sharding_constraint_p = getattr(prims, "sharding_constraint_p", None) or _private(_PJIT, "sharding_constraint_p")
device_put_p = getattr(prims, "device_put_p", None) or _private("jax._src.dispatch", "device_put_p")
reshard_p = _private(_PJIT, "reshard_p")


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
        "jax._src.lax.scaled_dot",
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


def lax_primitives(*names: str) -> list[Primitive]:
    """The primitives of ``names`` that this JAX version has (JAX adds and renames primitives)."""
    known = all_lax_primitives()
    return [known[n] for n in names if n in known]


def get_bind_params(primitive, params):
    """``(leading_args, params)`` such that ``primitive.bind(*leading_args, *invals, **params)`` works.

    Older JAX returned ``(subfuns, params)``; JAX 0.10 returns params holding ``subfuns`` itself.
    """
    out = primitive.get_bind_params(params)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return tuple(out[0]), out[1]
    return (), dict(out)


def bind_params(primitive, invals, params) -> list:
    """``primitive.bind`` on ``invals`` with an equation's ``params``; always a list of outputs."""
    subfuns, bind_params_ = get_bind_params(primitive, params)
    out = primitive.bind(*subfuns, *invals, **bind_params_)
    return list(out) if primitive.multiple_results else [out]


def bind_eqn(eqn, invals):
    """Bind ``eqn``'s primitive on ``invals`` exactly as ``jax.core.eval_jaxpr`` does."""
    with eqn.ctx.manager:
        return bind_params(eqn.primitive, invals, eqn.params)


def bind_eqn_with(eqn, invals, **changes):
    """:func:`bind_eqn` with some of the equation's parameters replaced."""
    return bind_eqn(eqn.replace(params={**eqn.params, **changes}), invals)


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


# -- custom derivative rules of `custom_jvp_call` / `custom_vjp_call` equations -------------------
# The rules' objects come from the walker's description (scalify._walk.derivative_rule); calling
# them (lazy linear_util functions, symbolic zeros) is what is version-sensitive.
def custom_jvp_jaxpr(jvp_rule, tangent_zeros):
    """``(jvp_jaxpr, consts, out_zeros)`` of a ``custom_jvp_call``'s rule, for the given zero tangents.

    The jaxpr takes ``(*primals, *nonzero_tangents)`` (no const operands) and returns
    ``(*primal_outs, *nonzero_out_tangents)``; ``out_zeros[i]`` says output ``i``'s tangent is zero.
    """
    return jvp_rule.call_wrapped(*tangent_zeros)


def custom_vjp_fwd_jaxpr(fwd_rule, out_trees, nonzeros):
    """``(fwd_jaxpr, consts, res_count, input_fwds)`` of a ``custom_vjp_call``'s ``fwd`` rule.

    The jaxpr takes the primals (no const operands) and returns ``(*residuals, *primal_outs)``, where
    only ``res_count`` residuals are computed: ``input_fwds[i]`` is the index of the primal input
    forwarded as residual ``i``, or None for a computed one.
    """
    fwd_jaxpr, consts = fwd_rule.call_wrapped(*nonzeros)
    _, res_tree, input_fwds = out_trees()
    res_count = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    return fwd_jaxpr, consts, res_count, list(input_fwds)


def _symbolic_zero(x) -> bool:
    return x is None or isinstance(x, (ad.Zero, jax.custom_derivatives.SymbolicZero))


def custom_vjp_bwd(bwd, residuals, cotangents, in_avals):
    """Call a ``custom_vjp_call``'s ``bwd`` rule; symbolic zeros and ``None`` become zero arrays."""
    outs = bwd.call_wrapped(*residuals, *cotangents)
    return [
        jax.numpy.zeros(aval.shape, aval.dtype) if _symbolic_zero(c) else c
        for c, aval in zip(outs, in_avals, strict=True)
    ]


def custom_vjp_bwd_jaxpr(bwd, args):
    """A ``custom_vjp_call``'s ``bwd`` rule on ``args`` (residuals, then cotangents), traced.

    Returns ``(closed, kept, put_back)``: ``closed`` takes the arguments that are JAX arrays
    (``kept[i]`` says whether argument ``i`` is one) and returns the rule's array outputs; the
    others (symbolic zeros, and NumPy or Python values a rule may branch on in Python, as equinox's
    checkpointed loop does on its residual flags) are fixed in the trace. ``put_back(outs)`` places
    the outputs among the symbolic zeros the rule returned, as JAX expects the rule's outputs.
    """
    kept = [isinstance(a, jax.Array) for a in args]  # tracers included
    zeros: dict = {}  # output index -> the symbolic zero the rule returned there
    count = []

    def arrays_only(*arrays):
        it = iter(arrays)
        outs = bwd.call_wrapped(*(next(it) if k else a for a, k in zip(args, kept, strict=True)))
        zeros.update({i: o for i, o in enumerate(outs) if _symbolic_zero(o)})
        count.append(len(outs))
        return [o for o in outs if not _symbolic_zero(o)]

    with fresh_name_stack():
        closed = jax.make_jaxpr(arrays_only)(*(a for a, k in zip(args, kept, strict=True) if k))

    def put_back(outs):
        it = iter(outs)
        return [zeros[i] if i in zeros else next(it) for i in range(count[0])]

    return closed, kept, put_back


_EXPLICIT = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)


def explicit_sharding(x):
    """The sharding in ``x``'s type when its mesh has ``Explicit`` axes (sharded or not), else ``None``.

    Under ``AxisType.Explicit`` mesh axes (the default of ``jax.make_mesh``), an array's sharding is
    part of its type (``jax.typeof(x).sharding``), and JAX checks it operation by operation; under
    ``Auto`` axes, and outside any mesh, the type carries no sharding (every entry is ``None``).
    """
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # pragma: no cover - JAX without explicit sharding
        return None
    try:
        sharding = getattr(typeof(x), "sharding", None)
    except TypeError:
        return None
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", None) or ()
    if getattr(sharding, "spec", None) is None or not any(t == _EXPLICIT for t in axis_types):
        return None
    return sharding


def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` varies (empty outside shard_map or with check_vma=False)."""
    try:
        aval = jax.typeof(x)
    except Exception:
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # JAX 0.6 - 0.9


def same_varying(*xs) -> list:
    """``xs`` cast to vary over the union of their varying mesh axes (inside ``shard_map``).

    ``lax``'s wrappers insert these casts (``pvary``) before binding a primitive; a primitive
    bound directly gets none and fails the varying-axes check. Under differentiation the cast's
    transpose is the ``psum`` a replicated operand's gradient needs.
    """
    axes = [varying_axes(x) for x in xs]
    union = frozenset().union(*axes)
    cast = lambda x, a: x if a == union else jax.lax.pcast(x, tuple(sorted(union - a)), to="varying")
    return [cast(x, a) for x, a in zip(xs, axes, strict=True)]


def logical_aval(shape, dtype, leaves):
    """``ShapeDtypeStruct(shape, dtype)`` carrying the explicit sharding and the shard_map varying
    axes of ``leaves`` (a ScaledArray's ``data`` first, then its scale leaves).

    Inside ``shard_map`` (``check_vma=True``) a value's type records the mesh axes it varies over;
    tracing a ScaledArray as a bare shape would lose them, and JAX would then not insert the
    ``pvary`` casts that binary operations between varying and replicated operands need. Likewise,
    under ``Explicit`` mesh axes the type records the sharding: the logical array is sharded like
    its ``data`` (a packed axis is sharded on whole bytes, so the same ``PartitionSpec`` splits the
    logical axis evenly), so the constants and broadcasts JAX traces next to it get that sharding too.
    """
    axes, aval = frozenset(), None
    for leaf in leaves:
        mat = getattr(jax.typeof(leaf), "manual_axis_type", None)
        if mat is not None and mat.varying:
            axes |= frozenset(mat.varying)
            aval = aval or jax.typeof(leaf)
    data_sharding = explicit_sharding(leaves[0]) if leaves else None
    if not axes and data_sharding is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    if data_sharding is not None:
        spec = data_sharding.spec
        sharding = jax.sharding.NamedSharding(data_sharding.mesh, spec.update(partitions=tuple(spec)[: len(shape)]))
    else:
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    mat = aval.manual_axis_type
    return jax.ShapeDtypeStruct(
        shape,
        dtype,
        sharding=sharding,
        manual_axis_type=type(mat)(varying=axes, unreduced=mat.unreduced, reduced=mat.reduced),
    )


# -- source info: name stacks (jax.named_scope) and the user's source line of an equation ---------
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
        out.extend(q for q in n.split("/") if q and q != _RECOMPUTED)
    return out


# The scope JAX's remat puts around the forward values a ``jax.checkpoint`` recomputes in the
# backward pass (jax/_src/ad_checkpoint.py): not a user's scope, so scope_names leaves it out.
_RECOMPUTED = "rematted_computation"


def in_recomputation(name_stack) -> bool:
    """Whether an equation's name stack says ``jax.checkpoint`` recomputes a forward value with it in
    the backward pass (it sits inside the transposition, but computes the forward's math)."""
    stack = getattr(name_stack, "stack", None)
    if stack is not None and _siu is not None:
        return any(isinstance(e, _siu.Scope) and e.name == _RECOMPUTED for e in stack)
    return _RECOMPUTED in str(name_stack).split("/")


def in_transpose(name_stack) -> bool:
    """Whether an equation's name stack says JAX's transposition emitted it: the backward pass of a
    gradient taken inside the traced function (``transpose(jvp(scope))/...``)."""
    stack = getattr(name_stack, "stack", None)
    if stack is not None and _siu is not None:
        return any(isinstance(e, _siu.Transform) and e.name == "transpose" for e in stack)
    return "transpose(" in str(name_stack)


def current_name_stack():
    """The name stack of the code being traced right now (``jax.named_scope`` blocks around us)."""
    if _siu is None:  # pragma: no cover
        return ""
    return _siu.current_name_stack()


def fresh_name_stack():
    """Trace a sub-jaxpr with an empty name stack, as ``jax.jit`` does for its body."""
    if _siu is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _siu.reset_name_stack()


def source_context(eqn, base_name_stack):
    """Re-emit an equation with its own traceback and name stack (``base_name_stack`` then the
    equation's scopes, so ``jax.named_scope`` survives the transformation)."""
    if _siu is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _siu.user_context(eqn.source_info.traceback, name_stack=base_name_stack + eqn.source_info.name_stack)


def source_line(eqn) -> str:
    """The user's source line that created ``eqn`` (``file:line (function)``), or ``"unknown"``."""
    if _siu is None:  # pragma: no cover
        return "unknown"
    try:
        return _siu.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - best effort: an error message must not fail
        return "unknown"


# jax.random's samplers (``_uniform``, ``_normal``, ``_gumbel``, ...) are jitted functions of the
# module that defines ``jax.random.uniform``; a jit equation records its function's source.
_RANDOM_SOURCE = inspect.getsourcefile(jax.random.uniform)


def calls_random_sampler(eqn) -> bool:
    """Whether ``eqn`` is a ``jit`` of one of ``jax.random``'s samplers (its function defined in
    the module of ``jax.random.uniform``, as its debug info says: ``"_uniform at FILE:LINE"``)."""
    if eqn.primitive is not jit_p or _RANDOM_SOURCE is None:
        return False
    info = getattr(eqn.params["jaxpr"].jaxpr, "debug_info", None)
    _, _, where = (getattr(info, "func_src_info", None) or "").partition(" at ")
    return where.rpartition(":")[0] == _RANDOM_SOURCE


def traced_with_hoisted_consts(fn, *args) -> tuple:
    """``(closed, consts)``: ``fn`` traced on ``args`` as a ClosedJaxpr with no consts whose leading
    invars take ``consts`` (the form ``custom_linear_solve`` keeps its sub-jaxprs in)."""
    from jax._src.interpreters import partial_eval as pe

    traced = jax.make_jaxpr(fn)(*args)
    return ClosedJaxpr(pe.convert_constvars_jaxpr(traced.jaxpr), ()), list(traced.consts)


def wrap_init(f, like):
    """``lu.wrap_init(f)`` with the debug info of the WrappedFun ``like``."""
    return _lu.wrap_init(f, debug_info=getattr(like, "debug_info", None))


def lower_hijax(closed):
    """``closed`` with JAX's hijax types (``jax.experimental.hijax``: flax's ``hijax=True``
    Variables) lowered to the plain arrays they hold, as ``jax.jit`` lowers them before compiling;
    ``closed`` itself when it has none. The inputs must be plain: only equations are lowered (a
    Variable created, read and written inside the program becomes the values it held)."""
    if not closed.jaxpr.is_high or any(v.aval.is_high for v in closed.jaxpr.constvars):
        # A captured hijax Variable (a constant) has no lowering outside jax.jit, which makes it an
        # input; its equations are bound as they are (they reach no rule unless a scaled value
        # flows through them, which the ScaledArray itself refuses).
        return closed
    from jax._src.interpreters import partial_eval as pe

    return pe.lower_jaxpr2(closed)
