"""ScaledArray through JAX's serialization paths: formats as JSON, ``jax.export`` and flax hooks.

A format is static pytree metadata, so every serializer that stores a tree *structure* (``jax.export``,
``scalify.io.save``) must write it down. It is written as a **format spec**: the name under which
the format (or the registered format it was derived from) is registered, plus the attrs fields that
differ from that registered value, e.g. ``{"name": "mxfp8", "fields": {"axis": 0}}``. Reading goes
through :func:`qformats.get_format` and ``fmt.replace(**fields)``, so any registered user format
round-trips, and nothing executable is stored.

Registration of the hooks:

* ``jax.export``: done when :mod:`scalify` is imported (ScaledArray and ``NVFP4Scale``); a user scale
  type that is neither a dict, list nor tuple needs :func:`register_scale_type` once.
* flax (not a dependency): the state-dict handlers are registered when ``flax.serialization`` is
  imported, before or after scalify (a one-shot import hook, no import cost for non-flax users);
  :func:`register_flax` does it explicitly and is idempotent.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import json
import sys
import threading

import attrs
import jax
import jax.numpy as jnp
import numpy as np

import qformats as qf
from scalify._scaled_array import ScaledArray

SERIALIZED_NAME = "scalify.ScaledArray"
_JSON_SCALARS = (bool, int, float, str, type(None))


class FormatSerializationError(ValueError):
    """A format cannot be written as, or rebuilt from, a format spec (the message says why and what to do)."""


# -- formats as JSON ------------------------------------------------------------------------------


def _registered_base(fmt: qf.ScaledFormat) -> str:
    """Registry name to describe ``fmt`` from: an exact registered match, else a registered format of
    the same class (its own name first)."""
    names = qf.list_formats()
    for n in names:
        if qf.get_format(n) == fmt:
            return n
    own = fmt.name.lower() if isinstance(getattr(fmt, "name", None), str) else None
    candidates = ([own] if own in names else []) + names
    for n in candidates:
        if type(qf.get_format(n)) is type(fmt):
            return n
    raise FormatSerializationError(
        f"format {fmt!r} ({type(fmt).__name__}) is not registered, so it cannot be stored by name. "
        f"Register it first: qformats.register_format(fmt) (or with an explicit name)."
    )


def _to_json_value(v):
    if isinstance(v, tuple | list):
        return [_to_json_value(x) for x in v]
    if isinstance(v, _JSON_SCALARS):
        return v
    raise TypeError(type(v).__name__)


def format_to_spec(fmt: qf.ScaledFormat | None) -> dict | None:
    """The JSON-able spec ``{"name", "fields"}`` of ``fmt`` (``None`` for the carrier form)."""
    if fmt is None:
        return None
    base_name = _registered_base(fmt)
    base = qf.get_format(base_name)
    fields = {}
    if base != fmt:
        if not attrs.has(type(fmt)):
            raise FormatSerializationError(
                f"format {fmt!r} is not registered and is not an attrs class, so its fields cannot be "
                f"stored. Register it: qformats.register_format(fmt, 'my_name')."
            )
        for a in attrs.fields(type(fmt)):
            v, bv = getattr(fmt, a.name), getattr(base, a.name)
            if v == bv:
                continue
            try:
                fields[a.name] = _to_json_value(v)
            except TypeError:
                raise FormatSerializationError(
                    f"format {fmt!r} differs from the registered {base_name!r} in field {a.name!r}, whose "
                    f"value {v!r} is not JSON data. Register this variant under its own name: "
                    f"qformats.register_format(fmt, 'my_name')."
                ) from None
    return {"name": base_name, "fields": fields}


def format_from_spec(spec, *, where: str = "") -> qf.ScaledFormat | None:
    """Rebuild a format from :func:`format_to_spec`'s output (``where`` prefixes error messages)."""
    if spec is None:
        return None
    prefix = f"{where}: " if where else ""
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("fields", {}), dict)):
        raise FormatSerializationError(
            f"{prefix}malformed format spec {spec!r}; expected {{'name': str, 'fields': {{}}}}"
        )
    try:
        base = qf.get_format(spec["name"])
    except qf.UnknownFormatError as e:
        raise qf.UnknownFormatError(
            f"{prefix}the stored format {spec['name']!r} is not registered in this process. Import or register "
            f"the module that defines it (qformats.register_format) before loading. ({e})"
        ) from None
    fields = spec.get("fields", {})
    if not fields:
        return base
    changes = {}
    for k, v in fields.items():
        old = getattr(base, k, None)
        changes[k] = tuple(v) if isinstance(old, tuple) and isinstance(v, list) else v
    try:
        return base.replace(**changes)
    except (TypeError, ValueError) as e:
        raise FormatSerializationError(f"{prefix}cannot rebuild format {spec['name']!r} with {fields}: {e}") from None


def _dtype_to_str(dtype) -> str | None:
    return None if dtype is None else np.dtype(dtype).name


def _dtype_from_str(name):
    return None if name is None else jnp.dtype(name)


# -- jax.export -----------------------------------------------------------------------------------


def _serialize_aux(aux) -> bytes:
    fmt, dtype = aux
    return json.dumps({"fmt": format_to_spec(fmt), "dtype": _dtype_to_str(dtype)}, sort_keys=True).encode()


def _deserialize_aux(raw: bytes):
    d = json.loads(raw)
    return format_from_spec(d["fmt"], where="jax.export ScaledArray"), _dtype_from_str(d["dtype"])


_EXPORT_REGISTERED: set = set()


def _register_export(cls, name: str) -> None:
    if cls in _EXPORT_REGISTERED:
        return
    jax.export.register_pytree_node_serialization(
        cls, serialized_name=name, serialize_auxdata=_serialize_aux, deserialize_auxdata=_deserialize_aux
    )
    _EXPORT_REGISTERED.add(cls)


def _is_namedtuple_type(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


# Scale pytree types other than dict/list/tuple/None: serialized name <-> class.
_SCALE_TYPES: dict[str, type] = {}
_SCALE_NAMES: dict[type, str] = {}


def register_scale_type(cls, serialized_name: str | None = None) -> None:
    """Make a user scale pytree type serializable by ``jax.export``, flax and :func:`scalify.io.save`.

    Call once per type. Needed only for scale types other than dict, list, tuple and ``None``. The
    type must be a ``NamedTuple``, or an ``attrs`` class / dataclass registered as a JAX pytree whose
    children are all its fields (e.g. ``jax.tree_util.register_dataclass(cls, data_fields=[...],
    meta_fields=[])``) and whose constructor takes them by name. ``serialized_name`` (default
    ``module.QualName``) is what files and exported artifacts store.
    """
    name = serialized_name or f"{cls.__module__}.{cls.__qualname__}"
    if _SCALE_TYPES.get(name, cls) is not cls:
        raise ValueError(f"scale type name {name!r} is already registered for {_SCALE_TYPES[name]!r}")
    if _SCALE_NAMES.get(cls, name) != name:
        raise ValueError(
            f"{cls.__name__} is already registered as {_SCALE_NAMES[cls]!r}; files and exported artifacts store "
            f"that name, so it cannot change. Keep {_SCALE_NAMES[cls]!r}."
        )
    if _is_namedtuple_type(cls):
        if cls not in _EXPORT_REGISTERED:
            jax.export.register_namedtuple_serialization(cls, serialized_name=name)
    elif attrs.has(cls) or dataclasses.is_dataclass(cls):
        if cls not in _EXPORT_REGISTERED:

            def ser(aux):
                if aux not in (None, ()):
                    raise ValueError(
                        f"{cls.__name__} has pytree auxiliary data {aux!r}; register_scale_type supports "
                        "types whose fields are all pytree children. Use jax.export.register_pytree_node_serialization."
                    )
                return b""

            jax.export.register_pytree_node_serialization(
                cls, serialized_name=name, serialize_auxdata=ser, deserialize_auxdata=lambda b: ()
            )
        _FLAX_TYPES.add(cls)
    else:
        raise TypeError(
            f"register_scale_type expects a NamedTuple, attrs class or dataclass; got {cls!r}. Use dicts or "
            "tuples of arrays as scales, or one of those class kinds."
        )
    _EXPORT_REGISTERED.add(cls)
    _SCALE_TYPES[name] = cls
    _SCALE_NAMES[cls] = name
    if _FLAX_REGISTERED:
        _register_flax_types()


def scale_type_name(cls) -> str | None:
    """Serialized name of a registered scale type (``None`` if not registered)."""
    return _SCALE_NAMES.get(cls)


def scale_type_fields(node) -> dict:
    """Field name -> child of a registered scale type's value."""
    if isinstance(node, tuple):
        return node._asdict()
    if attrs.has(type(node)):
        return {a.name: getattr(node, a.name) for a in attrs.fields(type(node))}
    return {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}


def scale_type_by_name(name: str, *, where: str = ""):
    """The class registered as ``name`` (error naming the fix otherwise)."""
    try:
        return _SCALE_TYPES[name]
    except KeyError:
        raise FormatSerializationError(
            f"{where + ': ' if where else ''}scale type {name!r} is not registered in this process; import the "
            f"module that defines it and call scalify.io.register_scale_type(cls, {name!r}) before loading."
        ) from None


# -- flax -----------------------------------------------------------------------------------------

_FLAX_REGISTERED = False
_FLAX_TYPES: set = set()
_FLAX_LOCK = threading.Lock()


def _sa_to_state(sa: ScaledArray):
    from flax import serialization

    return {"data": serialization.to_state_dict(sa.data), "scale": serialization.to_state_dict(sa.scale)}


def _sa_from_state(target: ScaledArray, state):
    from flax import serialization

    missing = {"data", "scale"} - set(state)
    if missing:
        raise ValueError(
            f"a ScaledArray state dict needs keys 'data' and 'scale'; missing {sorted(missing)} (got {sorted(state)})"
        )
    data = serialization.from_state_dict(target.data, state["data"], name="data")
    scale = serialization.from_state_dict(target.scale, state["scale"], name="scale")
    return ScaledArray(data, scale, fmt=target.fmt, dtype=target._dtype)


def _node_to_state(x):
    from flax import serialization

    return {k: serialization.to_state_dict(v) for k, v in scale_type_fields(x).items()}


def _node_from_state(target, state):
    from flax import serialization

    fields = scale_type_fields(target)
    missing = set(fields) - set(state)
    if missing:
        raise ValueError(
            f"a {type(target).__name__} state dict is missing fields {sorted(missing)} (got {sorted(state)})"
        )
    return type(target)(**{k: serialization.from_state_dict(v, state[k], name=k) for k, v in fields.items()})


def _register_flax_types() -> None:
    from flax import serialization

    for cls in list(_FLAX_TYPES):
        if cls not in serialization._STATE_DICT_REGISTRY:
            serialization.register_serialization_state(cls, _node_to_state, _node_from_state, override=True)


def register_flax() -> None:
    """Register ScaledArray (and scale types from :func:`register_scale_type`) with
    ``flax.serialization``. Idempotent; runs by itself when flax.serialization is imported.

    The state dict of a ScaledArray is ``{"data": ..., "scale": ...}`` (the scale as its own state
    dict, e.g. ``{"block": ..., "tensor": ...}`` for NVFP4). The format and logical dtype are
    static: ``from_state_dict`` / ``from_bytes`` take them from the target tree, as flax does for
    every static field.
    """
    global _FLAX_REGISTERED
    with _FLAX_LOCK:
        from flax import serialization

        if not _FLAX_REGISTERED:
            serialization.register_serialization_state(ScaledArray, _sa_to_state, _sa_from_state, override=True)
            _FLAX_REGISTERED = True
        _register_flax_types()


class _FlaxHook(importlib.abc.MetaPathFinder):
    """Runs :func:`register_flax` right after ``flax.serialization`` is first imported."""

    target = "flax.serialization"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                register_flax()

        spec.loader = _Loader()
        return spec


_HOOK = _FlaxHook()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_HOOK)
    except ValueError:
        pass


def install() -> None:
    """Register the built-in hooks (called once when scalify is imported)."""
    _register_export(ScaledArray, SERIALIZED_NAME)
    register_scale_type(qf.NVFP4Scale, "qformats.NVFP4Scale")
    if "flax.serialization" in sys.modules:
        register_flax()
    elif importlib.util.find_spec("flax") is not None and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
