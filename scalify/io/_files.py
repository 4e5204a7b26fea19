"""``save`` / ``load``: pytrees of ScaledArrays in ``.safetensors`` files that any safetensors reader opens.

Layout of a file written by :func:`save`:

* one named tensor per array leaf, named by its path in the tree with ``.`` between parts
  (``w.data``, ``w.scale``, ``layers.0.w.scale.block`` for NVFP4's two-level scale, ``b`` for a
  plain array); ScaledArray data and scale are stored exactly as held (fp8 / bf16 / E8M0 as the
  safetensors types ``F8_E4M3``, ``BF16``, ``F8_E8M0``, packed fp4 and fp6 codes as ``U8``);
* ``__metadata__`` (string to string): ``scalify.io.version`` and ``scalify.io.tree``, a JSON
  description of the containers (dict, list, tuple, None), each ScaledArray's format spec (registry
  name plus changed fields, see :mod:`scalify._serialization`) and logical dtype, and the scale's
  own structure; and ``qformats.header_sha256``, a digest of the rest of the header
  (:data:`qformats._safetensors.DIGEST_KEY`).

Nothing executable is stored; formats are rebuilt through :func:`qformats.get_format`. :func:`load`
trusts nothing in the file: the header is validated (and checked against its digest) before any
tensor is read, each tensor must be named by the tree exactly once, and each ScaledArray's data and
scale must be what its format's ``quantize`` makes for that shape; anything else is a ``ValueError``
naming the file and the leaf.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import qformats as qf
from qformats import _safetensors
from scalify import _serialization
from scalify._scaled_array import ScaledArray

VERSION = 1
VERSION_KEY = "scalify.io.version"
TREE_KEY = "scalify.io.tree"
_ROOT = "tensor"


class ScalifyIOError(ValueError):
    """A tree that :func:`save` cannot store, or a file whose scalify metadata is inconsistent."""


def _join(prefix: str, part) -> str:
    part = str(part)  # keys may contain '.'; a resulting name collision is an error in _add
    return f"{prefix}.{part}" if prefix else part


def _encode_scale(node, prefix, out, where):
    """JSON description of a scale pytree; its array leaves are added to ``out``."""
    if node is None:
        return None
    if isinstance(node, dict):
        keys = list(node)
        if not all(isinstance(k, str) for k in keys):
            raise ScalifyIOError(f"{where}: scale dict keys must be strings, got {keys!r}")
        return {"dict": {k: _encode_scale(node[k], _join(prefix, k), out, where) for k in keys}}
    cls = type(node)
    reg = _serialization.scale_type_name(cls)
    if reg is not None:
        fields = _serialization.scale_type_fields(node)
        return {"node": reg, "fields": {k: _encode_scale(v, _join(prefix, k), out, where) for k, v in fields.items()}}
    if isinstance(node, list | tuple):
        kind = "list" if isinstance(node, list) else "tuple"
        if kind == "tuple" and type(node) is not tuple:
            raise ScalifyIOError(
                f"{where}: scale type {cls.__name__} is not known to scalify.io; register it once with "
                f"scalify.io.register_scale_type({cls.__name__})."
            )
        return {kind: [_encode_scale(v, _join(prefix, i), out, where) for i, v in enumerate(node)]}
    if _is_array(node):
        _add(out, prefix or _ROOT, node, where)
        return {"array": prefix or _ROOT}
    raise ScalifyIOError(
        f"{where}: scale pytree node {cls.__name__} is not known to scalify.io; register it once with "
        f"scalify.io.register_scale_type({cls.__name__})."
    )


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray | np.generic | jax.Array | int | float | bool)


def _add(out, name, x, where):
    if name in out:
        raise ScalifyIOError(
            f"{where}: two leaves map to the tensor name {name!r} (a key containing '.' collides with a "
            f"nested path). Rename one of the keys."
        )
    if isinstance(x, jax.core.Tracer):
        raise ScalifyIOError(f"{where}: is a traced value; call scalify.io.save outside jit/grad/vmap.")
    out[name] = np.asarray(x)


def _encode(node, prefix, out):
    where = f"tree leaf {prefix or '(root)'!r}"
    if node is None:
        return None
    if isinstance(node, ScaledArray):
        data_name = _join(prefix, "data")
        _add(out, data_name, node.data, where)
        return {
            "scaled": {
                "data": data_name,
                "scale": _encode_scale(node.scale, _join(prefix, "scale"), out, where),
                "fmt": _serialization.format_to_spec(node.fmt),
                "dtype": None if node._dtype is None else node._dtype.name,
            }
        }
    if isinstance(node, dict):
        keys = list(node)
        if not all(isinstance(k, str) for k in keys):
            raise ScalifyIOError(
                f"{where}: dict keys must be strings to become tensor names; got {[type(k).__name__ for k in keys]}"
            )
        return {"dict": {k: _encode(node[k], _join(prefix, k), out) for k in keys}}
    if type(node) in (list, tuple):
        kind = "list" if type(node) is list else "tuple"
        return {kind: [_encode(v, _join(prefix, i), out) for i, v in enumerate(node)]}
    if _is_array(node):
        name = prefix or _ROOT
        _add(out, name, node, where)
        return {"array": name}
    raise ScalifyIOError(
        f"{where}: scalify.io.save stores dicts (string keys), lists, tuples, None, arrays and ScaledArrays; "
        f"got {type(node).__name__}. Convert it to a dict (e.g. flax.serialization.to_state_dict) or use "
        f"orbax / flax.serialization.to_bytes for arbitrary pytrees."
    )


def save(path, tree) -> None:
    """Write ``tree`` (dicts, lists, tuples of ScaledArrays and arrays) to the ``.safetensors`` file ``path``.

    Data and scales are stored bit for bit in their own dtypes; see the module docstring for the tensor
    names and metadata. The file is written atomically (temporary file, then rename).
    """
    tensors: dict[str, np.ndarray] = {}
    desc = _encode(tree, "", tensors)
    meta = {VERSION_KEY: str(VERSION), TREE_KEY: json.dumps(desc, separators=(",", ":"))}
    _safetensors.write(path, tensors, meta, digest=True)


def _to_jax(x: np.ndarray):
    """A NumPy leaf as a jax.Array, unless that would change its bits (64-bit types without x64)."""
    if x.dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        return x
    # On CPU, XLA adopts a host buffer aligned to 64 bytes (as _safetensors reads them) instead of
    # copying it: no second copy, and no freed NumPy buffers left behind in the C heap.
    return jax.device_put(x)


_MALFORMED = (KeyError, TypeError, AttributeError, IndexError, OverflowError)


class _Ctx:
    """State of one :func:`load`: the file's tensors and which tree leaf took each."""

    def __init__(self, path, tensors):
        self.path = path
        self.tensors = tensors
        self.used: dict[str, str] = {}

    def where(self, prefix: str) -> str:
        return f"{self.path}: tree leaf {prefix or '(root)'!r}"

    def take(self, name, prefix):
        where = self.where(prefix)
        if not isinstance(name, str):
            raise ScalifyIOError(f"{where}: malformed tensor reference {name!r:.80} (a tensor name is a string)")
        if name not in self.tensors:
            raise ScalifyIOError(f"{where}: the metadata names tensor {name!r}, which the file does not hold")
        if name in self.used:
            raise ScalifyIOError(
                f"{where}: the metadata names tensor {name!r} twice (also for leaf {self.used[name]!r}); save "
                f"writes each leaf once, so the file was edited or corrupted"
            )
        self.used[name] = prefix
        return self.tensors[name]


def _node(d, where):
    """The single ``(kind, value)`` of a tree description node."""
    if not isinstance(d, dict) or not d:
        raise ScalifyIOError(f"{where}: malformed scalify tree description {d!r:.200}")
    if "node" in d:
        return "node", d
    if len(d) != 1:
        raise ScalifyIOError(f"{where}: malformed scalify tree description {d!r:.200} (one kind per node)")
    return next(iter(d.items()))


def _describe(data, scale) -> str:
    parts = [f"data {tuple(data.shape)} {np.dtype(data.dtype)}"]
    for kp, leaf in jax.tree_util.tree_flatten_with_path(scale)[0]:
        parts.append(f"scale{jax.tree_util.keystr(kp)} {tuple(leaf.shape)} {np.dtype(leaf.dtype)}")
    return ", ".join(parts)


@functools.lru_cache(maxsize=256)
def _expected(fmt, data_shape):
    """``(value shape, abstract (data, scale))`` that ``fmt.quantize`` makes for stored data of
    ``data_shape``, or the exception saying why it cannot (cached: a model repeats its shapes)."""
    try:
        shape = tuple(fmt.value_shape(data_shape))
        return shape, jax.eval_shape(fmt.quantize, jax.ShapeDtypeStruct(shape, jnp.float32))
    except Exception as e:  # the format cannot hold data of this shape (or its fields are not valid)
        return None, e


def _check_scaled(fmt, data, scale, where):
    """The stored data and scale are what ``fmt.quantize`` makes for a value of their logical shape."""
    if fmt is None:
        return
    try:
        shape, want = _expected(fmt, tuple(np.shape(data)))
    except TypeError:  # a format with an unhashable field: not cached
        shape, want = _expected.__wrapped__(fmt, tuple(np.shape(data)))
    if isinstance(want, Exception):
        raise ScalifyIOError(
            f"{where}: format {fmt.name} ({fmt!r:.200}) does not fit the stored data {tuple(np.shape(data))}: "
            f"{type(want).__name__}: {want}"
        )
    got = (data, scale)
    ok = jax.tree.structure(want) == jax.tree.structure(got) and all(
        (tuple(w.shape), np.dtype(w.dtype)) == (tuple(g.shape), np.dtype(g.dtype))
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
    )
    if not ok:
        raise ScalifyIOError(
            f"{where}: the stored {_describe(data, scale)} does not fit format {fmt.name} for a {shape} value, "
            f"which has {_describe(*want)}; the file was edited or corrupted"
        )


def _decode(d, ctx: _Ctx, prefix: str, *, in_scale: bool = False):
    """The tree described by ``d``; with ``in_scale``, a ScaledArray's scale pytree.

    Both share the containers (dict, list, tuple) and array leaves; only a tree holds ScaledArrays
    (``scaled``) and only a scale holds registered scale classes (``node``).
    """
    if d is None:
        return None
    where = ctx.where(prefix)
    kind, v = _node(d, where)
    if kind == "array":
        return ctx.take(v, prefix)
    if kind == "dict":
        return {k: _decode(c, ctx, _join(prefix, k), in_scale=in_scale) for k, c in v.items()}
    if kind in ("list", "tuple"):
        items = [_decode(c, ctx, _join(prefix, i), in_scale=in_scale) for i, c in enumerate(v)]
        return items if kind == "list" else tuple(items)
    if in_scale and kind == "node":  # a registered scale class (NamedTuple, attrs, dataclass)
        cls = _serialization.scale_type_by_name(d["node"], where=where)
        return cls(**{k: _decode(c, ctx, _join(prefix, k), in_scale=True) for k, c in d["fields"].items()})
    if not in_scale and kind == "scaled":
        return _decode_scaled(v, ctx, prefix)
    what = "scale node" if in_scale else "node"
    raise ScalifyIOError(f"{where}: unknown {what} kind {kind!r:.80} in the scalify metadata")


def _decode_scaled(v, ctx: _Ctx, prefix: str) -> ScaledArray:
    """A ScaledArray from its ``scaled`` description, checked against its format."""
    where = ctx.where(prefix)
    fmt = _serialization.format_from_spec(v["fmt"], where=where)
    data = ctx.take(v["data"], _join(prefix, "data"))
    scale = _decode(v["scale"], ctx, _join(prefix, "scale"), in_scale=True)
    dtype = None if v["dtype"] is None else jnp.dtype(v["dtype"])
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise ScalifyIOError(f"{where}: logical dtype {dtype} is not floating; a ScaledArray holds floating values")
    _check_scaled(fmt, data, scale, where)
    return ScaledArray(data, scale, fmt=fmt, dtype=dtype)


def _from_checkpoint(path: Path, why: str):
    reader = getattr(qf, "read_checkpoint", None)
    if reader is None:
        raise ScalifyIOError(
            f"{path}: {why}, and this qformats has no read_checkpoint to read published checkpoints. "
            f"scalify.io.load reads .safetensors files written by scalify.io.save."
        )
    tensors = reader(path)
    out = {}
    while tensors:  # popped as converted, so each host array can be freed once JAX holds the tensor
        name, t = tensors.popitem()
        if isinstance(t, np.ndarray | np.generic | jax.Array):
            out[name] = _to_jax(np.asarray(t))
        else:
            fmt, data, scale = t
            dtype = getattr(t, "dtype", None) or jnp.float32
            scale = jax.tree.map(lambda s: _to_jax(np.asarray(s)), scale)
            out[name] = ScaledArray(_to_jax(np.asarray(data)), scale, fmt=fmt, dtype=dtype)
    return dict(reversed(out.items()))  # the reader's order


def load(path):
    """Read a file written by :func:`save` and return the same tree (ScaledArrays and jax arrays), bit-exact.

    Any other path (a folder, a ``.gguf`` file, a ``.safetensors`` file without scalify metadata) is
    read with :func:`qformats.read_checkpoint` (published quantized checkpoints) and returned as
    ``{logical name: ScaledArray | jax.Array}``, each quantized tensor wrapped as a ScaledArray of its
    checkpoint format (logical dtype: the producer's output dtype). 64-bit leaves stay NumPy arrays
    when JAX's x64 mode is off, so their bits are kept.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        return _from_checkpoint(path, "is a folder")
    if path.suffix.lower() != ".safetensors":
        return _from_checkpoint(path, f"is not a .safetensors file (suffix {path.suffix or '(none)'!r})")
    header, _ = _safetensors.read_header(path)
    meta = header.get(_safetensors.METADATA_KEY) or {}
    if TREE_KEY not in meta:
        return _from_checkpoint(path, f"has no {TREE_KEY!r} metadata (not written by scalify.io.save)")
    try:
        version = int(meta.get(VERSION_KEY, "0"))
    except ValueError:
        version = -1
    if version != VERSION:
        raise ScalifyIOError(
            f"{path}: written with scalify.io format version {meta.get(VERSION_KEY)!r}; this scalify reads "
            f"version {VERSION}. Use the scalify version that wrote it."
        )
    try:
        desc = json.loads(meta[TREE_KEY])
    except RecursionError:
        raise ScalifyIOError(f"{path}: the {TREE_KEY!r} metadata is nested too deeply; the file is corrupted") from None
    except ValueError as e:
        raise ScalifyIOError(
            f"{path}: the {TREE_KEY!r} metadata is not valid JSON ({e}); the file is corrupted"
        ) from None
    # Converted one at a time, so at most one tensor's host buffer is alive besides the result (on
    # CPU none: the result adopts it). read_header has validated every offset and size already.
    tensors = {name: _to_jax(arr) for name, arr in _safetensors.iter_tensors(path)}
    ctx = _Ctx(path, tensors)
    try:
        tree = _decode(desc, ctx, "")
    except (qf.UnknownFormatError, _serialization.FormatSerializationError, ScalifyIOError):
        raise
    except RecursionError:
        raise ScalifyIOError(f"{path}: the {TREE_KEY!r} metadata is nested too deeply; the file is corrupted") from None
    except _MALFORMED as e:
        raise ScalifyIOError(
            f"{path}: the {TREE_KEY!r} metadata is malformed ({type(e).__name__}: {e}); the file is corrupted"
        ) from None
    unused = [n for n in tensors if n not in ctx.used]
    if unused:
        raise ScalifyIOError(
            f"{path}: the file holds tensor(s) {', '.join(map(repr, unused))} not named by its {TREE_KEY!r} "
            f"metadata; save writes exactly the tree's leaves, so the file was edited or corrupted"
        )
    return tree
