"""The project's one reader and writer of ``.safetensors`` files (no extra package needed).

The layout (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian unsigned
header length ``N``, ``N`` bytes of JSON, then one byte buffer. The JSON object maps each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the buffer) and
may hold ``"__metadata__"``, a string-to-string map. The buffer is fully indexed: tensors are
contiguous, without holes or overlaps, and the file ends with the last tensor.

Hostile or corrupted files are refused by :func:`read_header` before any tensor byte is read, with
a :class:`SafetensorsError` (a ``ValueError``) naming the file, the tensor and the problem. Files
written with ``write(..., digest=True)`` (``scalify.io.save`` does) also carry a hash of their
header, so an edit that leaves the header well formed is refused too.

Why our own: ``safetensors.numpy`` cannot produce bfloat16 or float8 arrays, and the package is an
optional dependency. Dtypes map to NumPy through ml_dtypes (``BF16``, ``F8_E4M3``, ``F8_E5M2``,
``F8_E8M0``). Tensors are read one at a time (seek and read, or ``np.memmap``), never the whole file.

Public (within the project): :func:`read_header`, :func:`read_metadata`, :func:`iter_tensors`,
:func:`read_tensor`, :func:`write`, :func:`empty_aligned`, :data:`DTYPES`, :data:`ALIGNMENT`,
:data:`DIGEST_KEY`, :class:`SafetensorsError`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

#: safetensors dtype names and their NumPy (ml_dtypes) types.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}

# The safetensors package refuses headers above 100 MB; so do we (a corrupted length field would
# otherwise make us allocate gigabytes).
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
#: Metadata key of the header digest that ``write(..., digest=True)`` adds (a SHA-256 of the header
#: without it, see :func:`_digest`); every reader here refuses a file whose header does not match it.
DIGEST_KEY = "qformats.header_sha256"


class SafetensorsError(ValueError):
    """A file is not a valid ``.safetensors`` file (the message names the file and the problem)."""


def dtype_name(dtype) -> str:
    """The safetensors name of a NumPy dtype (``TypeError`` naming the supported ones otherwise)."""
    dt = np.dtype(dtype).newbyteorder("=")
    if dt not in _NAMES:
        raise TypeError(
            f"dtype {dt} has no safetensors name; supported: "
            f"{', '.join(f'{n} ({d})' for n, d in DTYPES.items())}. "
            "Store sub-byte or fp6 codes as uint8 (packed, as qformats does)."
        )
    return _NAMES[dt]


def _fail(path, msg) -> SafetensorsError:
    return SafetensorsError(f"{path}: not a valid .safetensors file: {msg}")


_CORRUPT = "The file is corrupted or was not written completely: write it again (or download it again)."


class _DuplicateKey(ValueError):
    def __init__(self, key):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _no_constants(name):
    raise ValueError(f"{name} is not a JSON number")


def _digest(header: dict) -> str:
    """SHA-256 of the header without its digest entry, in a canonical JSON form (whitespace, key
    order and padding do not matter)."""
    h = dict(header)
    meta = dict(h.pop(METADATA_KEY, None) or {})
    meta.pop(DIGEST_KEY, None)
    if meta:
        h[METADATA_KEY] = meta
    canonical = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_header(path) -> tuple[dict, int]:
    """Parse and validate the header of ``path``.

    Returns ``(header, data_offset)``: the JSON object as a dict (tensor entries and, if present,
    ``"__metadata__"``) and the absolute file offset of the byte buffer. Everything is checked before
    any tensor byte is read: the header length against the file size; the header is UTF-8 JSON, an
    object without repeated keys or non-standard constants; every entry has a known dtype, a shape of
    non-negative integers and integer ``data_offsets`` ``[begin, end]`` with ``begin <= end`` whose
    span is exactly ``prod(shape) * itemsize``; the tensors cover the byte buffer without holes or
    overlaps, and the buffer is exactly what follows the header (no byte missing, none extra); and, when
    the metadata holds a :data:`DIGEST_KEY` (written by ``write(..., digest=True)``), the header
    matches it. So later reads can neither go out of bounds nor take bytes of another tensor.

    Raises ``FileNotFoundError`` for a missing path, ``IsADirectoryError`` for a directory and
    :class:`SafetensorsError` (a ``ValueError``) naming the file, the tensor and the problem for
    anything malformed. The returned dict is the caller's to change. Parsed headers are cached per
    (file, size, mtime), so reading a file tensor by tensor parses its header once.
    """
    header, base = _header(path)
    return {k: dict(v) for k, v in header.items()}, base


def _header(path) -> tuple[dict, int]:
    """The cached, shared (do not modify) parsed header of ``path``."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a .safetensors file")
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return _cached_header(str(path.resolve()), key, str(path))


@functools.lru_cache(maxsize=64)
def _cached_header(resolved: str, stat_key: tuple, shown: str) -> tuple[dict, int]:
    return _parse_header(Path(shown))


def _parse_header(path: Path) -> tuple[dict, int]:
    """Uncached :func:`read_header` (the path exists and is not a directory)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise _fail(path, f"it holds {len(head)} bytes, fewer than the 8-byte header length field. {_CORRUPT}")
        n = int.from_bytes(head, "little")
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            why = (
                f"more than the {MAX_HEADER_BYTES} bytes a header may have"
                if n > MAX_HEADER_BYTES
                else "too short for a JSON object"
                if n < 2
                else f"but the file holds {size - 8} after it (truncated?)"
            )
            raise _fail(path, f"the header length field says {n} bytes, {why}. {_CORRUPT}")
        raw = f.read(n)
    if len(raw) != n:
        raise _fail(path, f"read {len(raw)} of the {n} header bytes (the file changed while being read)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"the header is not valid UTF-8 ({e}). {_CORRUPT}") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except _DuplicateKey as e:
        raise _fail(path, f"the header names {e.key!r} twice. {_CORRUPT}") from None
    except RecursionError:
        raise _fail(path, f"the header JSON is nested too deeply. {_CORRUPT}") from None
    except ValueError as e:  # JSONDecodeError, a NaN/Infinity constant, an integer of > 4300 digits
        raise _fail(path, f"the header is not valid JSON ({e}). {_CORRUPT}") from None
    if not isinstance(header, dict):
        raise _fail(path, f"the header is not a JSON object but {type(header).__name__}. {_CORRUPT}")
    meta = header.get(METADATA_KEY)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise _fail(path, f"{METADATA_KEY!r} must map strings to strings. {_CORRUPT}")
    base = 8 + n
    spans = []
    for name, info in header.items():
        if name == METADATA_KEY:
            continue
        _, _, (start, end) = _entry(path, name, info)
        spans.append((start, end, name))
    spans.sort()
    pos = 0
    for start, end, name in spans:
        if start != pos:
            what = (
                f"overlaps the tensor before it (which ends at {pos})"
                if start < pos
                else f"leaves a hole at bytes {pos}..{start} (tensors must cover the data without gaps)"
            )
            raise _fail(path, f"tensor {name!r} starts at {start} and {what}. {_CORRUPT}")
        pos = end
    avail = size - base
    if pos > avail:
        start, end, name = next(s for s in spans if s[1] > avail)
        raise _fail(
            path,
            f"tensor {name!r} needs bytes {start}..{end} of the tensor data but the file holds only {avail} "
            f"bytes after the header, and the tensors need {pos}: it is truncated. {_CORRUPT}",
        )
    if pos < avail:
        raise _fail(
            path,
            f"the file holds {avail} bytes of tensor data after the header, but its tensors need {pos}: the "
            f"header length field is wrong or bytes were appended. {_CORRUPT}",
        )
    if meta and DIGEST_KEY in meta and meta[DIGEST_KEY] != _digest(header):
        raise _fail(
            path,
            f"the header does not match its {DIGEST_KEY} digest: it was modified after it was written. {_CORRUPT}",
        )
    return header, base


_FIELDS = ("dtype", "shape", "data_offsets")


def _is_count(v) -> bool:
    return type(v) is int and v >= 0  # not bool, float or str


def _entry(path, name, info):
    """Validated ``(dtype, shape, (start, end))`` of one header entry."""
    if not isinstance(info, dict):
        raise _fail(
            path, f"malformed entry for tensor {name!r}: {info!r:.80} is not an object {{dtype, shape, data_offsets}}"
        )
    missing = [k for k in _FIELDS if k not in info]
    if missing:
        lacks = ", ".join(map(repr, missing))
        raise _fail(path, f"malformed entry for tensor {name!r}: it lacks {lacks}: {info!r:.200}")
    dt, shape, offsets = (info[k] for k in _FIELDS)
    if not isinstance(dt, str) or dt not in DTYPES:
        raise _fail(path, f"tensor {name!r} has dtype {dt!r:.80}; supported: {', '.join(DTYPES)}")
    if not isinstance(shape, list):
        raise _fail(path, f"tensor {name!r}: shape {shape!r:.80} is not a list of non-negative integers")
    if not all(_is_count(d) for d in shape):
        raise _fail(path, f"tensor {name!r} has shape {shape!r:.80}; dimensions must be non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise _fail(
            path, f"tensor {name!r}: data_offsets {offsets!r:.80} must be two non-negative integers [begin, end]"
        )
    start, end = offsets
    if start > end:
        raise _fail(path, f"tensor {name!r}: data_offsets [{start}, {end}]: begin {start} > end {end}")
    nbytes = math.prod(shape) * DTYPES[dt].itemsize
    if end - start != nbytes:
        raise _fail(
            path,
            f"tensor {name!r}: data_offsets [{start}, {end}] do not hold shape {shape} of {dt}: they span "
            f"{end - start} bytes, it needs {nbytes}",
        )
    return DTYPES[dt], tuple(shape), (start, end)


def read_metadata(path) -> dict[str, str]:
    """The ``"__metadata__"`` map of ``path`` (empty if the file has none)."""
    header, _ = read_header(path)
    return dict(header.get(METADATA_KEY) or {})


#: Byte alignment of the arrays that :func:`read_tensor` and :func:`iter_tensors` return. XLA's CPU
#: client adopts a host buffer aligned to 64 bytes without copying it (``jax.device_put`` aliases
#: it), whereas ``np.empty`` aligns large arrays to 16 bytes only; a copy doubles the transient
#: memory of a load, and its freed NumPy buffers stay in the C heap.
ALIGNMENT = 64


def empty_aligned(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts at a multiple of ``alignment`` bytes.

    It is a view into a buffer ``alignment`` bytes larger (the view keeps the buffer alive).
    """
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dt).reshape(shape)


def _read(f, path, base, name, info, mmap):
    dt, shape, (start, end) = _entry(path, name, info)
    if mmap:
        if end == start:
            return np.zeros(shape, dt)
        return np.memmap(path, dtype=dt.newbyteorder("<"), mode="r", offset=base + start, shape=shape)
    out = empty_aligned(shape, dt)
    f.seek(base + start)
    got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != end - start:
        raise _fail(path, f"tensor {name!r}: read {got} of {end - start} bytes (file truncated?)")
    if sys.byteorder == "big" and dt.itemsize > 1:
        out = out.byteswap()
    return out


def read_tensor(path, name: str, *, mmap: bool = False) -> np.ndarray:
    """The tensor ``name`` of ``path`` as a NumPy array of its (ml_dtypes) dtype.

    Reads only that tensor's bytes, straight into an array aligned to :data:`ALIGNMENT` bytes (which
    ``jax.device_put`` on CPU adopts without a copy). ``mmap=True`` returns a read-only ``np.memmap`` instead (no copy;
    pages load on access). ``KeyError`` names the tensors the file holds if ``name`` is absent.
    """
    header, base = _header(path)
    if name == METADATA_KEY or name not in header:
        names = [k for k in header if k != METADATA_KEY]
        raise KeyError(f"{path}: no tensor named {name!r}; the file holds: {', '.join(names) or 'none'}")
    with open(path, "rb") as f:
        return _read(f, path, base, name, header[name], mmap)


def iter_tensors(path, *, mmap: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` for every tensor of ``path``, one at a time, in file order.

    Only the tensor being yielded is in memory (the header is validated first); arrays are aligned as
    :func:`read_tensor`'s.
    """
    header, base = _header(path)
    entries = sorted(
        ((k, v) for k, v in header.items() if k != METADATA_KEY), key=lambda kv: int(kv[1]["data_offsets"][0])
    )
    with open(path, "rb") as f:
        for name, info in entries:
            yield name, _read(f, path, base, name, info, mmap)


def write(
    path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None, *, digest: bool = False
) -> None:
    """Write ``tensors`` (name -> array) and string ``metadata`` to ``path`` as ``.safetensors``.

    Tensors are laid out by decreasing item size (then name), and the header is padded with spaces
    to a multiple of 8 bytes, so every tensor starts at an offset aligned to its item size (the
    format forbids holes between tensors, so ordering is the only way to align). The file is
    written to a temporary name and renamed, so a failed write never leaves a half file at ``path``.

    ``digest=True`` adds :data:`DIGEST_KEY` to the metadata: a SHA-256 of the rest of the header, so
    that an edit of the header which leaves it valid (a dtype of the same item size, a renamed
    tensor, changed metadata) is refused by :func:`read_header` instead of read silently. Other
    readers see one more metadata string.
    """
    meta = dict(metadata or {})
    meta.pop(DIGEST_KEY, None)  # a stale digest (from a header read back) would not match
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"safetensors metadata maps strings to strings; got {k!r}: {type(v).__name__}")
    arrays = {}
    for name, arr in tensors.items():
        if not isinstance(name, str) or name == METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}: names are strings other than {METADATA_KEY!r}")
        arr = np.asarray(arr)
        dtype_name(arr.dtype)  # raises for unsupported dtypes
        arrays[name] = arr
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict = {METADATA_KEY: meta} if meta else {}
    pos = 0
    for name in order:
        arr = arrays[name]
        header[name] = {
            "dtype": dtype_name(arr.dtype),
            "shape": list(arr.shape),
            "data_offsets": [pos, pos + arr.nbytes],
        }
        pos += arr.nbytes
    if digest:
        tensor_entries = {k: v for k, v in header.items() if k != METADATA_KEY}
        header = {METADATA_KEY: {**meta, DIGEST_KEY: _digest(header)}, **tensor_entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in order:
                arr = np.ascontiguousarray(arrays[name])
                if arr.dtype.itemsize > 1 and (
                    arr.dtype.byteorder == ">" or (arr.dtype.byteorder in "=|" and sys.byteorder == "big")
                ):
                    arr = arr.byteswap()
                f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
