"""Reader for llama.cpp GGUF files (no extra package needed; writing uses the ``gguf`` package).

GGUF lists shapes in ggml order (fastest axis first); tensors here are in NumPy orientation
(``reversed``), as ``gguf.GGUFReader.tensors[i].data`` is. Quantized types are split from the file's
interleaved blocks (float16 ``d`` then codes) into ``data`` and ``scale``:

* Q8_0 (34-byte blocks): ``data`` int8 ``[..., K]``, ``scale`` float16 ``[..., K/32]`` -> ``gguf_q8_0``;
* Q4_0 (18-byte blocks): ``data`` uint8 ``[..., K/2]`` (ggml nibble order), ``scale`` float16 (signed)
  -> ``gguf_q4_0``.

F32, F16 and BF16 tensors come back as arrays; other types raise an error naming them.

The layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), little-endian: ``b"GGUF"``,
``u32`` version (2 or 3), ``u64`` tensor count, ``u64`` key-value count, the key-value pairs (``u64``
length + UTF-8 key, ``u32`` value type, value), the tensor infos (name, ``u32`` rank, ``u64``
dimensions, ``u32`` type, ``u64`` offset into the data section), padding to ``general.alignment``
(default 32), then the data section. :func:`read_header` checks all of it, as llama.cpp does, before a
tensor byte is read: every count and length against the bytes left in the file, known value and tensor
types, at most 4 dimensions below ``2**63`` each, a row length that is a multiple of the block size,
unique names, and offsets that follow each other in the tensor order (each tensor padded to the
alignment, so no overlap and no gap) with the last tensor ending at the end of the file (give or take
its padding). A malformed file raises :class:`GGUFError` (a ``ValueError`` and a
:class:`~qformats.CheckpointError`) naming the file, the tensor and the problem.

GGUF has no checksum: a corruption that leaves the header valid (a dimension changed within a
tensor's padding, a flipped data byte) cannot be detected.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from typing import NamedTuple

import ml_dtypes
import numpy as np

from qformats import _safetensors
from qformats._checkpoint import CheckpointError, QuantizedTensor, unsupported
from qformats._fmt_checkpoints import GGUF_Q4_0, GGUF_Q8_0

#: ggml type ids and names (ggml.h), for messages.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
#: The types read here: id -> (elements per block, bytes per block).
_READ = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18)}
_SUPPORTED = "Q8_0, Q4_0, F32, F16, BF16"
# GGUF metadata value types: fixed sizes (u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64); 8 string, 9 array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _U32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8
_CORRUPT = "The file is corrupted or was not written completely: write it again (or download it again)."


class GGUFError(CheckpointError):
    """A file that is not a valid GGUF file (the message names the file, the tensor and the problem)."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("writing .gguf files needs the gguf package: pip install 'qformats[gguf]'") from None
    return gguf


class TensorInfo(NamedTuple):
    name: str
    kind: int  # ggml type id
    shape: tuple[int, ...]  # NumPy orientation
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads from the file's bytes."""

    def __init__(self, buf, path):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, msg):
        return GGUFError(f"{self.path}: not a valid GGUF file: {msg}")

    def need(self, n, what):
        left = len(self.buf) - self.pos
        if n > left:
            raise self.fail(
                f"{what} needs {n} bytes at offset {self.pos} but the file has {left} left (truncated?). {_CORRUPT}"
            )

    def unpack(self, fmt, what):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what):
        return self.unpack("<I", what)

    def u64(self, what):
        return self.unpack("<Q", what)

    def skip(self, n, what):
        self.need(n, what)
        self.pos += n

    def string(self, what):
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e}). {_CORRUPT}") from None

    def count(self, what, min_item_bytes):
        """A ``u64`` count of items that each take at least ``min_item_bytes``: it must fit in the rest of the file."""
        n = self.u64(what)
        left = len(self.buf) - self.pos
        if n * min_item_bytes > left:
            raise self.fail(
                f"the {what} is {n}, but {n} items need at least {n * min_item_bytes} bytes and the file has {left} "
                f"left. {_CORRUPT}"
            )
        return n

    def value(self, vtype, what, depth=0):
        """Read (fixed-size and string) or skip (array) one metadata value; returns it, or None for arrays."""
        if vtype in _FIXED:
            size = _FIXED[vtype]
            self.need(size, what)
            v = int.from_bytes(self.buf[self.pos : self.pos + size], "little") if vtype == _U32 else None
            self.pos += size
            return v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= _MAX_NESTING:
                raise self.fail(f"{what}: arrays nested more than {_MAX_NESTING} deep. {_CORRUPT}")
            etype = self.u32(f"the element type of {what}")
            if etype in _FIXED:
                n = self.count(f"element count of {what}", _FIXED[etype])
                self.skip(n * _FIXED[etype], what)
            elif etype in (_STRING, _ARRAY):
                n = self.count(f"element count of {what}", 8 if etype == _STRING else 12)
                for i in range(n):
                    self.value(etype, f"{what}[{i}]", depth + 1)
            else:
                raise self.fail(f"{what} has element value type {etype}, which GGUF does not define. {_CORRUPT}")
            return None
        raise self.fail(f"{what} has value type {vtype}, which GGUF does not define. {_CORRUPT}")


def read_header(path) -> tuple[dict, list[TensorInfo]]:
    """Parse and validate the header of the GGUF file ``path``: ``(metadata, tensors)``.

    ``metadata`` holds the string and uint32 values by key (arrays and other values are checked and
    skipped); ``tensors`` the :class:`TensorInfo` of each tensor in file order. Raises
    :class:`GGUFError` for anything malformed (see the module docstring) and :class:`CheckpointError`
    naming the type for a tensor of a type this reader does not read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise GGUFError(f"{path}: not a valid GGUF file: it is empty. {_CORRUPT}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size)


def _parse(buf, path, size):
    cur = _Cursor(buf, path)
    cur.need(4, "the magic")
    if buf[:4] != b"GGUF":
        raise cur.fail(f"it starts with {bytes(buf[:4])!r}, not the GGUF magic b'GGUF'")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (2, 3):
            raise cur.fail(f"it is a big-endian GGUF file (version {swapped}); only little-endian files are read")
        if version == 1:
            raise cur.fail("GGUF version 1 is not supported (llama.cpp dropped it); convert the model again")
        raise cur.fail(f"unknown GGUF version {version} (this reader knows 2 and 3). {_CORRUPT}")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.count("key-value count", 13)  # key length (8) + value type (4) + at least one byte
    if n_tensors * 24 > size - cur.pos:  # name length (8) + rank (4) + type (4) + offset (8)
        raise cur.fail(
            f"the tensor count is {n_tensors}, but {n_tensors} tensor infos need at least {n_tensors * 24} "
            f"bytes and the file has {size - cur.pos} left. {_CORRUPT}"
        )
    meta: dict = {}
    for i in range(n_kv):
        key = cur.string(f"the key of metadata entry {i}")
        if key in meta:
            raise cur.fail(f"metadata key {key!r} appears twice. {_CORRUPT}")
        vtype = cur.u32(f"the value type of {key!r}")
        if key == "general.alignment" and vtype != _U32:
            raise cur.fail(f"general.alignment has value type {vtype}; GGUF requires a uint32 ({_U32}). {_CORRUPT}")
        meta[key] = cur.value(vtype, f"metadata {key!r}")
    alignment = meta.get("general.alignment", 32)
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment}, not a power of two. {_CORRUPT}")

    raw_infos = []
    names: set = set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}")
        what = f"tensor {name!r}"
        if name in names:
            raise cur.fail(f"the file names tensor {name!r} twice. {_CORRUPT}")
        names.add(name)
        n_dims = cur.u32(f"the rank of {what}")
        if n_dims > _MAX_DIMS:
            raise cur.fail(f"{what} has {n_dims} dimensions; GGUF tensors have at most {_MAX_DIMS}. {_CORRUPT}")
        dims = [cur.u64(f"dimension {j} of {what}") for j in range(n_dims)]
        kind = cur.u32(f"the type of {what}")
        offset = cur.u64(f"the offset of {what}")
        raw_infos.append((name, dims, kind, offset))
    data_start = cur.pos + (-cur.pos % alignment)

    # types first: a valid file with a type this reader does not read is "unsupported", not "corrupted"
    for name, _, kind, _ in raw_infos:
        if kind not in GGML_TYPES:
            raise cur.fail(f"tensor {name!r} has unknown GGUF type {kind}. {_CORRUPT}")
        if kind not in _READ:
            raise unsupported(
                f"{path}: tensor {name!r} has GGUF type {GGML_TYPES[kind]}; supported GGUF types: {_SUPPORTED}."
            )

    infos = []
    expected = 0  # where the next tensor must start in the data section
    for name, dims, kind, offset in raw_infos:
        what = f"tensor {name!r}"
        for d in dims:
            if d >= 2**63:
                raise cur.fail(f"{what} has dimension {d}, beyond int64 (dimensions {dims}). {_CORRUPT}")
        block, block_bytes = _READ[kind]
        if block > 1 and not dims:
            raise cur.fail(f"{what} of type {GGML_TYPES[kind]} has no dimensions (a block type needs rows). {_CORRUPT}")
        if dims and dims[0] % block:
            raise cur.fail(
                f"{what} of type {GGML_TYPES[kind]} has rows of {dims[0]} elements, not a multiple of its block "
                f"size: rows must be a multiple of {block}. {_CORRUPT}"
            )
        n = math.prod(dims)
        nbytes = n // block * block_bytes
        if offset != expected:
            how = (
                f"overlaps the tensors before it (they end at {expected})"
                if offset < expected
                else f"leaves a gap after the tensors before it (they end at {expected})"
            )
            raise cur.fail(
                f"{what} starts at data offset {offset} and {how}; each tensor must follow the one before it, "
                f"padded to the alignment {alignment}. {_CORRUPT}"
            )
        end = data_start + offset + nbytes
        if end > size:
            raise cur.fail(
                f"{what} ({GGML_TYPES[kind]}, shape {tuple(reversed(dims))}) needs bytes {data_start + offset}.."
                f"{end} of the file but the file has {size} bytes: it is truncated. {_CORRUPT}"
            )
        infos.append(TensorInfo(name, kind, tuple(int(d) for d in reversed(dims)), data_start + offset, nbytes))
        expected = offset + nbytes + (-nbytes % alignment)
    if infos and size > data_start + expected:
        raise cur.fail(
            f"the file has {size - data_start - expected} bytes after the last tensor {infos[-1].name!r} and its "
            f"padding (it ends at {data_start + expected}). {_CORRUPT}"
        )
    return meta, infos


def read(path) -> dict:
    """``{name: QuantizedTensor | np.ndarray}`` of a GGUF file (see the module docstring).

    Tensors are read one at a time, each straight into its result arrays (aligned for
    ``jax.device_put`` to adopt them), so the peak memory is the result plus one read chunk.
    """
    _, infos = read_header(path)
    if not infos:
        raise CheckpointError(f"{path}: the GGUF file holds no tensors")
    out: dict = {}
    with open(path, "rb") as f:
        for t in infos:
            f.seek(t.offset)
            out[t.name] = _read_plain(f, t, path) if t.kind in _PLAIN else _read_blocks(f, t, path)
    return out


# Plain types: id -> the little-endian dtype stored and the dtype returned.
_PLAIN = {0: ("<f4", np.float32), 1: ("<f2", np.float16), 30: ("<u2", ml_dtypes.bfloat16)}
# Bytes of blocks read at a time: small enough to stay in the CPU cache while they are split into
# codes and scales, large enough that the number of read calls does not matter.
_CHUNK_BYTES = 1 << 20


def _readinto(f, buf: np.ndarray, t: TensorInfo, path) -> None:
    """Fill the contiguous ``buf`` with the next bytes of ``f`` (a short read means the file changed)."""
    got = f.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
    if got != buf.nbytes:
        raise GGUFError(f"{path}: tensor {t.name!r}: read fewer bytes than its {t.nbytes} (the file changed?)")


def _read_plain(f, t: TensorInfo, path) -> np.ndarray:
    """An F32, F16 or BF16 tensor, read straight into its array."""
    stored, dtype = _PLAIN[t.kind]
    arr = _safetensors.empty_aligned(t.shape, stored)
    _readinto(f, arr, t, path)
    if dtype is ml_dtypes.bfloat16:  # NumPy has no little-endian bfloat16: byte order via uint16
        return arr.astype(np.uint16, copy=False).view(dtype)
    return arr.astype(dtype, copy=False)  # a no-op on little-endian machines


def _read_blocks(f, t: TensorInfo, path):
    """A Q8_0 or Q4_0 tensor, its interleaved blocks (float16 ``d``, then the codes) split while read.

    The blocks are read a chunk at a time into one small buffer and copied out as strided views:
    each block's codes as one opaque item of 32 or 16 bytes (NumPy copies those with one loop over
    the blocks, 2 to 4x faster than as bytes or 8-byte words) and its scale as a 2-byte word.
    """
    block_bytes = _READ[t.kind][1]
    item = np.dtype(f"V{block_bytes - 2}")
    n_blocks = t.nbytes // block_bytes
    codes = _safetensors.empty_aligned((n_blocks,), item)
    d = _safetensors.empty_aligned((n_blocks,), "<f2")
    step = max(1, _CHUNK_BYTES // block_bytes)
    buf = np.empty(min(step, n_blocks) * block_bytes, np.uint8)
    for i in range(0, n_blocks, step):
        k = min(step, n_blocks - i)
        chunk = buf[: k * block_bytes]
        _readinto(f, chunk, t, path)
        codes[i : i + k] = np.ndarray((k,), item, chunk, 2, (block_bytes,))
        d.view(np.uint16)[i : i + k] = np.ndarray((k,), np.uint16, chunk, 0, (block_bytes,))
    rows = t.shape[:-1]
    scale = d.astype(np.float16, copy=False).reshape(*rows, t.shape[-1] // 32)
    if t.kind == 8:
        return QuantizedTensor(GGUF_Q8_0, codes.view(np.int8).reshape(t.shape), scale)
    return QuantizedTensor(GGUF_Q4_0, codes.view(np.uint8).reshape(*rows, t.shape[-1] // 2), scale)
