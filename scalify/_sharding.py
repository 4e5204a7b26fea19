"""Shardings for pytrees holding ScaledArrays: the scale is laid out like the blocks it scales.

``scaled_sharding(x, data_sharding)`` maps the sharding of each *logical* array to a sharding of its
``data`` and of its ``scale``:

* per-tensor scale (0-d, also NVFP4's tensor scale): replicated;
* an axis whose block spans the whole axis (per-channel on another axis): scale replicated on it;
* an axis with block 1 (the channel axis of per-channel scaling): scale sharded like the data;
* a blocked axis (MX: 32, NVFP4: 16): scale sharded like the data when every shard holds whole
  blocks, else a ``ValueError`` naming the axis, the shard length and the block size.

Packed formats (fp4, fp6) shrink the blocked axis of ``data``; a shard must hold whole packed bytes.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from scalify._scaled_array import ScaledArray, is_scaled_leaf


def _is_spec_leaf(s) -> bool:
    return s is None or isinstance(s, (Sharding, PartitionSpec))


def _entry_size(entry, mesh_shape) -> int | None:
    """Number of shards along one array axis for a PartitionSpec entry (None if unknown)."""
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    if mesh_shape is None:
        return None
    return math.prod(int(mesh_shape[n]) for n in names)


def _spec_entries(spec, ndim):
    entries = tuple(spec)
    if len(entries) > ndim:
        raise ValueError(f"PartitionSpec {spec} has {len(entries)} entries, but the array has rank {ndim}.")
    return entries + (None,) * (ndim - len(entries))


def _scale_spec(entries, value_shape, block, mesh_shape, what):
    out = []
    for ax, (entry, n, b) in enumerate(zip(entries, value_shape, block, strict=True)):
        if entry is None or b == n:  # not sharded, or one block spans the axis: replicate
            out.append(None)
            continue
        k = _entry_size(entry, mesh_shape)
        if k is not None:
            if n % k:
                raise ValueError(f"{what}: axis {ax} of length {n} does not split evenly into {k} shards ({entry!r}).")
            shard = n // k
            if shard % b:
                raise ValueError(
                    f"{what}: sharding axis {ax} over {entry!r} gives shards of length {shard}, which would "
                    f"split a scale block of {b} elements (axis {ax} is blocked by {b}). Shard it over at most "
                    f"{n // b} devices so each shard holds whole blocks, or shard another axis."
                )
        out.append(entry)
    return PartitionSpec(*out)


def _check_packed(entries, value_shape, data_shape, mesh_shape, what):
    for ax, (entry, n, d) in enumerate(zip(entries, value_shape, data_shape, strict=True)):
        if entry is None or n == d:
            continue
        k = _entry_size(entry, mesh_shape)
        if k is None:
            continue
        per = n // math.gcd(n, d)  # elements per indivisible group of packed bytes
        if d % k or (n // k) % per:
            raise ValueError(
                f"{what}: data is packed along axis {ax} ({n} elements in {d} bytes); sharding it over "
                f"{entry!r} ({k} shards) would split packed bytes. Each shard must hold a multiple of "
                f"{per} elements on that axis."
            )


def _leaf_specs(x: ScaledArray, spec: PartitionSpec, mesh_shape):
    """``(data_spec, scale_spec_tree)`` for one ScaledArray.

    The scale is any pytree: each leaf is a scalar (replicated) or a block grid of the value (the
    data's rank, ``value_shape // leaf.shape`` elements per block), sharded so blocks stay whole.
    """
    data_shape = tuple(x.data.shape)  # works for arrays and ShapeDtypeStructs (jax.eval_shape)
    value_shape = tuple(x.fmt.value_shape(data_shape)) if x.fmt is not None else data_shape
    entries = _spec_entries(spec, len(value_shape))
    what = f"ScaledArray{list(value_shape)} ({x.fmt.name if x.fmt is not None else 'carrier'})"
    data_spec = PartitionSpec(*entries) if value_shape else PartitionSpec()
    if x.fmt is not None:
        _check_packed(entries, value_shape, data_shape, mesh_shape, what)

    def leaf_spec(leaf):
        grid = tuple(leaf.shape)
        if math.prod(grid) == 1:
            return PartitionSpec()
        if len(grid) != len(value_shape) or any(n % g for n, g in zip(value_shape, grid, strict=True)):
            raise ValueError(
                f"{what}: a scale leaf of shape {grid} is not a block grid of the value shape {value_shape} "
                f"(same rank, each extent dividing the value's); give the format's scale leaves that shape "
                f"or a single element."
            )
        block = tuple(n // g for n, g in zip(value_shape, grid, strict=True))
        return _scale_spec(entries, value_shape, block, mesh_shape, what)

    return data_spec, jax.tree.map(leaf_spec, x.scale)


def _dtype(leaf):
    return leaf.dtype if leaf.fmt is not None else None


def _for_leaf(leaf, sharding, mesh):
    if sharding is None or not isinstance(leaf, ScaledArray):
        return sharding
    if isinstance(sharding, NamedSharding):
        d, s = _leaf_specs(leaf, sharding.spec, dict(sharding.mesh.shape))
        wrap = lambda sp: NamedSharding(sharding.mesh, sp, memory_kind=sharding.memory_kind)
        scale = jax.tree.map(wrap, s, is_leaf=lambda v: isinstance(v, PartitionSpec))
        return ScaledArray(wrap(d), scale, fmt=leaf.fmt, dtype=_dtype(leaf))
    if isinstance(sharding, PartitionSpec):
        mesh_shape = None if mesh is None else dict(mesh.shape)
        d, s = _leaf_specs(leaf, sharding, mesh_shape)
        return ScaledArray(d, s, fmt=leaf.fmt, dtype=_dtype(leaf))
    if getattr(sharding, "is_fully_replicated", False):
        return ScaledArray(sharding, jax.tree.map(lambda _: sharding, leaf.scale), fmt=leaf.fmt, dtype=_dtype(leaf))
    raise TypeError(
        f"scaled_sharding needs a NamedSharding or a PartitionSpec for a ScaledArray (to lay the scale "
        f"out like its blocks), got {type(sharding).__name__}."
    )


def scaled_sharding(x, data_sharding, *, mesh=None):
    """Shardings for ``x`` (a pytree that may hold ScaledArrays), usable as ``in_shardings`` / ``out_shardings``.

    Args:
        x: the pytree (arrays, ScaledArrays or ``jax.ShapeDtypeStruct``-like leaves).
        data_sharding: the sharding of the *logical* arrays: one ``NamedSharding`` (or
            ``PartitionSpec``) for every leaf, or a pytree prefix of ``x`` of them (``None`` leaves
            pass through, as in ``jit``).
        mesh: with ``PartitionSpec``s, the mesh used to check that shards hold whole blocks
            (default: the ambient ``jax.sharding.use_mesh`` mesh, if any).

    Returns:
        The pytree of shardings (or of ``PartitionSpec``s, e.g. for ``shard_map``'s ``in_specs``):
        each ScaledArray is replaced by a ScaledArray of shardings for its ``data`` and ``scale``.
    """
    if mesh is None:
        try:
            am = jax.sharding.get_abstract_mesh()
            mesh = am if am is not None and not am.empty else None
        except Exception:
            mesh = None

    def sub(sh, subtree):
        return jax.tree.map(lambda leaf: _for_leaf(leaf, sh, mesh), subtree, is_leaf=is_scaled_leaf)

    if _is_spec_leaf(data_sharding):
        return sub(data_sharding, x)
    return jax.tree.map(sub, data_sharding, x, is_leaf=_is_spec_leaf)


def _concrete_mesh(mesh):
    """``mesh`` if it is a device mesh, else the ambient one of ``jax.set_mesh`` (``None`` if none)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    try:
        ambient = get_mesh() if get_mesh is not None else None
    except Exception:  # pragma: no cover - outside any mesh context on some JAX versions
        ambient = None
    return ambient if isinstance(ambient, jax.sharding.Mesh) and not ambient.empty else None


def device_put(x, data_sharding, *, mesh=None):
    """``jax.device_put`` of a pytree that may hold ScaledArrays, data and scales laid out consistently.

    ``data_sharding`` is as for :func:`scaled_sharding`. ``PartitionSpec``s are placed on ``mesh``
    (default: the mesh of ``jax.set_mesh``), e.g. to lay out ``shard_map`` inputs as its
    ``in_specs`` say, which ``Explicit`` mesh axes (``jax.make_mesh``'s default) require.
    """
    shardings = scaled_sharding(x, data_sharding, mesh=mesh)
    specs = [v for v in jax.tree.leaves(shardings, is_leaf=_is_spec_leaf) if isinstance(v, PartitionSpec)]
    if specs:
        target = _concrete_mesh(mesh)
        if target is None:
            raise ValueError(
                f"scalify.device_put got PartitionSpecs ({specs[0]}, ...) but no mesh to place them on: pass "
                f"mesh=jax.make_mesh(...), run under `with jax.set_mesh(mesh):`, or pass NamedShardings."
            )
        shardings = jax.tree.map(
            lambda v: NamedSharding(target, v) if isinstance(v, PartitionSpec) else v, shardings, is_leaf=_is_spec_leaf
        )
    return jax.device_put(x, shardings)
