"""How a scaled contraction (``dot_general``, ``conv_general_dilated``) is executed.

Each operand is split by its format into ``values * factor`` (:meth:`qformats.ScaledFormat.factored`):
``values`` exact in their dtype (per-tensor FP8 data as stored; MX and NVFP4 elements times their
block scales in bfloat16), ``factor`` a float32 scalar or scale grid. A factor that varies along a
contracted axis is multiplied into the values (float32); the others factor out of the sum and
scale the output. What is then fed to the GEMM is the strategy:

* ``"dequantize"``: values cast to the narrowest of bfloat16 and float32 that holds both operands
  exactly (float32 on CPU, see :func:`compute_dtype`), one ``dot_general`` / convolution
  accumulating in float32;
* ``"native"``: values fed as stored, float32 accumulation. Per-tensor float8 operands go in as
  ``convert(data) * scale``, the pattern XLA on NVIDIA GPUs turns into an FP8 GEMM (cuBLASLt) with
  the scales folded in; Hopper's FP8 tensor cores accumulate with fewer bits than float32 (with
  ``Precision.HIGHEST``, set unless ``ScalifyConfig.fast_accumulation``, they promote partial sums
  to float32). Operands of different stored types meet in the ``"dequantize"`` compute type;
* ``"scaled_dot"``: ``jax.nn.scaled_matmul`` on the elements and block scales (cuDNN's block-scaled
  GEMM on Blackwell; on platforms it has no lowering for, such as CPU, its documented math composed
  in float32), for operands that both block the one
  contracted axis in a form it takes (MXFP8, MXFP4, NVFP4); a convolution has no block-scaled form
  and runs ``"dequantize"``.

Products of the values are exact in float32 (at most 2 x 8 significant bits), so every strategy
equals the float32 contraction of the dequantized operands up to the order of the float32 sums
(where the GEMM accumulates in float32: not Hopper's FP8 GEMM under ``"native"``, see above).
``"auto"`` picks once per platform: ``"scaled_dot"`` on a GPU with block-scaled GEMMs (compute
capability 10 and up) for operands it takes, else ``"native"`` on GPUs and ``"dequantize"``
elsewhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scalify._config import get_config
from scalify._jax_compat import bind_eqn_with
from scalify._rules_common import F32, promote, recentre, settle, wide
from scalify._scaled_array import ScaledArray, cast, expand_scale, normalize_scale

_F32_DTYPE = np.dtype(np.float32)


def formatted(x) -> bool:
    return isinstance(x, ScaledArray) and x.fmt is not None


def strategy(a, b, *, conv: bool = False) -> str:
    """The configured strategy for operands ``a``, ``b``, with ``"auto"`` resolved."""
    chosen = get_config().contraction
    if chosen == "scaled_dot" and conv:
        return "dequantize"
    if chosen != "auto":
        return chosen
    if jax.default_backend() != "gpu":
        return "dequantize"
    if not conv and _has_block_scaled_gemm() and _block_scaled(a) is not None and _block_scaled(b) is not None:
        return "scaled_dot"
    return "native"


def _has_block_scaled_gemm() -> bool:
    """Whether the default GPU has block-scaled GEMMs (NVIDIA compute capability 10.0 and up)."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    return capability is not None and float(capability) >= 10.0


def _factored(x):
    """``(values, factor)`` of an operand, the factor a scalar or a grid rank-matched to values
    (a factor the format gives as a NumPy constant stays one: see :func:`_times`)."""
    if formatted(x):
        values, factor = x.fmt.factored(x.data, x.scale)
        factor = factor.astype(np.float32) if isinstance(factor, np.ndarray) else cast(factor, F32)
        return values, normalize_scale(factor, values.shape)
    x = promote(x, zero_adopts=False)
    return x.data, normalize_scale(cast(x.scale, F32), x.data.shape)


_ONE = np.ones((), np.float32)


def _fold(values, factor):
    """``(values * factor, 1)`` in float32: the factor multiplied into the values."""
    return lax.mul(cast(values, F32), expand_scale(factor, values.shape)), _ONE


def _times(fa, fb):
    """The product of two scalar factors, a NumPy constant when both are (factor 1, the common
    case): the output scale is then known at trace time, so neither :func:`_finish` nor the
    user's ``to_array`` adds a pass over the output (a traced scale of 1 is sealed from XLA's
    constant folding by :func:`~scalify._rules_common.isolate_scale`)."""
    if isinstance(fa, np.ndarray) and isinstance(fb, np.ndarray):
        return np.asarray(np.multiply(fa, fb, dtype=np.float32))
    return lax.mul(fa, fb)


def _fold_contracted(values, factor, contracted):
    """Multiply a factor that varies along a contracted axis into the values (float32)."""
    if factor.ndim and any(factor.shape[i] != 1 for i in contracted):
        return _fold(values, factor)
    return values, factor


def compute_dtype(*dtypes):
    """bfloat16 when it holds every operand's values exactly (8 significant bits or fewer, an
    exponent range within float32's) and the backend has bfloat16 GEMMs with float32 results
    everywhere, else float32. XLA's CPU runtime has them only inside its oneDNN / YNNPACK fusions:
    a dot it leaves unfused (a transposed weight-gradient GEMM of a training step) fails with
    ``Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32``, so CPU gets float32."""

    def fits(d):
        d = np.dtype(d)
        if jnp.issubdtype(d, jnp.integer):
            return d.itemsize == 1
        fi = jnp.finfo(d)
        return fi.nmant <= 7 and fi.maxexp <= 128 and fi.minexp >= -126

    if jax.default_backend() == "cpu":
        return jnp.float32
    return jnp.bfloat16 if all(fits(d) for d in dtypes) else jnp.float32


def _feed(values_a, values_b, how: str):
    """The two GEMM operands for strategy ``how`` (``"native"`` or ``"dequantize"``)."""
    da, db = np.dtype(values_a.dtype), np.dtype(values_b.dtype)
    if how == "native" and (da == db or (_is_float8(da) and _is_float8(db))):
        return values_a, values_b
    cd = compute_dtype(da, db)
    return cast(values_a, cd), cast(values_b, cd)


def _gemm_params(values):
    """float32 accumulation (FP8 GEMM parameters for float8 operands)."""
    return _fp8_gemm_params() if _is_float8(values.dtype) else {"preferred_element_type": _F32_DTYPE}


def _fp8_gemm_params():
    """float32 accumulation and, unless ``ScalifyConfig.fast_accumulation``, ``Precision.HIGHEST``:
    it keeps XLA on Hopper from using the FP8 tensor cores' fast accumulation (measured on an
    H100 at K = 8192: relative error 1.5e-4 without it, 8e-3 with it)."""
    params = {"preferred_element_type": _F32_DTYPE}
    if not get_config().fast_accumulation:
        params["precision"] = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    return params


def _is_float8(d) -> bool:
    return jnp.issubdtype(d, jnp.floating) and np.dtype(d).itemsize == 1


def _finish(acc, scale, out_dtype) -> ScaledArray:
    """The float32 accumulator ``acc`` times ``scale`` as a carrier of the logical ``out_dtype``:
    for float32 and bfloat16 (their range is float32's) with the scale re-centred
    (:func:`~scalify._rules_common.recentre`), settled on its amax for a narrower carrier; re-quantized under
    ``ScalifyConfig.dot_output_format``."""
    if wide(out_dtype):
        acc, scale = recentre(acc, scale)
        out = ScaledArray(cast(acc, out_dtype), scale)
    else:
        out = settle(acc, scale, out_dtype)
    return output_format(out, out_dtype)


def output_format(out: ScaledArray, dtype) -> ScaledArray:
    """A contraction's output re-quantized into ``ScalifyConfig.dot_output_format`` (if set)."""
    fmt = get_config().dot_output_format
    if fmt is not None:
        data, scale = fmt.quantize(out.to_array(F32))
        return ScaledArray(data, scale, fmt=fmt, dtype=dtype)
    return out


def dot(eqn, a, b, how: str) -> ScaledArray:
    """``dot_general`` of scaled or plain operands under strategy ``how`` (resolved)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out_dtype = eqn.outvars[0].aval.dtype
    if how == "scaled_dot":
        return _finish(*_scaled_dot(eqn, a, b), out_dtype)
    va, fa = _fold_contracted(*_factored(a), lc)
    vb, fb = _fold_contracted(*_factored(b), rc)
    va, fa, vb, fb = _broadcast_batch(fa, fb, lb, rb, va, vb)
    if how == "native" and _is_float8(va.dtype) and _is_float8(vb.dtype) and fa.ndim == 0 and fb.ndim == 0:
        # The dequantization pattern XLA's GPU GEMM rewriter folds into cuBLASLt's FP8 GEMM with
        # its operand scales (measured on an H100: no separate scaling pass, no float32 GEMM);
        # elsewhere it is the float32 contraction of the dequantized operands.
        (va, fa), (vb, fb) = _fold(va, fa), _fold(vb, fb)
        params = _fp8_gemm_params()
    else:
        va, vb = _feed(va, vb, how)
        params = _gemm_params(va)
    (acc,) = bind_eqn_with(eqn, [va, vb], **params)
    return _finish(acc, _output_scale(eqn, fa, fb), out_dtype)


def _broadcast_batch(fa, fb, lb, rb, va, vb):
    """``(va, fa, vb, fb)`` with the factor grids' batch axes broadcast to each other; grids whose
    batch axes disagree (neither is 1) are multiplied into the values instead."""
    if fa.ndim == 0 and fb.ndim == 0:
        return va, fa, vb, fb
    ga = fa.reshape((1,) * va.ndim) if fa.ndim == 0 else fa
    gb = fb.reshape((1,) * vb.ndim) if fb.ndim == 0 else fb
    sa, sb = list(ga.shape), list(gb.shape)
    for i, j in zip(lb, rb, strict=True):
        m, n = ga.shape[i], gb.shape[j]
        if m != n and 1 not in (m, n):
            return (*_fold(va, fa), *_fold(vb, fb))
        sa[i] = sb[j] = max(m, n)
    return va, jnp.broadcast_to(ga, sa), vb, jnp.broadcast_to(gb, sb)


def _output_scale(eqn, fa, fb):
    """The output's scale: the factors' product laid out as the output (a scalar, or the grid
    ``dot_general`` of the factor grids, which have size 1 on every contracted axis)."""
    if fa.ndim == 0 and fb.ndim == 0:
        return _times(fa, fb)
    return lax.dot_general_p.bind(fa, fb, **dict(eqn.params, preferred_element_type=_F32_DTYPE))


def _block_scaled(x):
    """``fmt.block_scaled`` of a formatted operand: (elements, scales, factor), or None."""
    return x.fmt.block_scaled(x.data, x.scale) if formatted(x) else None


def _blocked_axes(elements, scales):
    return [i for i, (n, g) in enumerate(zip(elements.shape, scales.shape, strict=True)) if n != g]


def _scaled_dot(eqn, a, b):
    """``(accumulator, scale)`` of ``jax.nn.scaled_matmul`` on the operands' elements and block
    scales, laid out as ``(batch, free, contracted)`` (its ``BMK, BNK -> BMN``)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    pa, pb = _block_scaled(a), _block_scaled(b)
    problem = _scaled_dot_problem(pa, pb, lc, rc)
    if problem:
        raise ValueError(
            f"ScalifyConfig(contraction='scaled_dot') cannot run this dot_general: {problem}. "
            "Use contraction='auto' (or 'dequantize'), which runs every format."
        )
    (ea, sa, fa), (eb, sb, fb) = pa, pb
    m_axes = [i for i in range(ea.ndim) if i not in lc and i not in lb]
    n_axes = [i for i in range(eb.ndim) if i not in rc and i not in rb]

    def bmk(x, batch, free, contracted):
        x = jnp.transpose(x, (*batch, *free, *contracted))
        nb = math.prod(x.shape[: len(batch)])
        nf = math.prod(x.shape[len(batch) : len(batch) + len(free)])
        return x.reshape(nb, nf, -1)

    out = lax.platform_dependent(
        bmk(ea, lb, m_axes, lc),
        bmk(eb, rb, n_axes, rc),
        bmk(sa, lb, m_axes, lc),
        bmk(sb, rb, n_axes, rc),
        cuda=jax.nn.scaled_matmul,
        rocm=jax.nn.scaled_matmul,
        default=_composed_scaled_matmul,
    )
    shape = eqn.outvars[0].aval.shape
    return out.reshape(shape), _times(fa, fb)


def _composed_scaled_matmul(a, b, a_scales, b_scales):
    """``jax.nn.scaled_matmul``'s documented math, for platforms it has no lowering for (CPU):
    ``einsum('BMK,BNK->BMN', a * repeat(a_scales), b * repeat(b_scales))`` in float32 (exact
    products: elements and scales widen exactly)."""

    def expand(x, s):
        return x.astype(jnp.float32) * jnp.repeat(s.astype(jnp.float32), x.shape[-1] // s.shape[-1], axis=-1)

    return jnp.einsum("BMK,BNK->BMN", expand(a, a_scales), expand(b, b_scales), preferred_element_type=jnp.float32)


def _scaled_dot_problem(pa, pb, lc, rc) -> str | None:
    """Why ``scaled_matmul`` cannot take these operands, or None."""
    if pa is None or pb is None:
        return "both operands must be in a format with a block-scaled form (MXFP8, MXFP4, NVFP4 with 1-D blocks)"
    if len(lc) != 1:
        return f"it contracts {len(lc)} axes; scaled_matmul contracts one"
    (ea, sa, _), (eb, sb, _) = pa, pb
    blocked_a, blocked_b = _blocked_axes(ea, sa), _blocked_axes(eb, sb)
    if blocked_a != [lc[0]] or blocked_b != [rc[0]]:
        return (
            f"the operands are blocked along axes {blocked_a} and {blocked_b}, not along the contracted "
            f"axes {lc[0]} and {rc[0]} (quantize them with fmt.aim(contracted_axis))"
        )
    if ea.shape[lc[0]] // sa.shape[lc[0]] != eb.shape[rc[0]] // sb.shape[rc[0]]:
        return "the two operands have different block sizes"
    if sa.dtype != sb.dtype:
        return f"the block scales have different types ({sa.dtype} and {sb.dtype})"
    return None


def conv(eqn, lhs, rhs, how: str) -> ScaledArray:
    """``conv_general_dilated`` of scaled or plain operands under strategy ``how`` (resolved;
    ``"scaled_dot"`` runs as ``"dequantize"``): every factor but a scalar is multiplied into the
    values (a convolution contracts the input-feature and spatial axes of both operands), the
    scalar factors scale the output."""
    va, fa = _factored(lhs)
    vb, fb = _factored(rhs)
    if fa.ndim:
        va, fa = _fold(va, fa)
    if fb.ndim:
        vb, fb = _fold(vb, fb)
    va, vb = _feed(va, vb, "native" if how == "native" else "dequantize")
    (acc,) = bind_eqn_with(eqn, [va, vb], **_gemm_params(va))
    return _finish(acc, _times(fa, fb), eqn.outvars[0].aval.dtype)
