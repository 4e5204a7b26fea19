"""Hostile and corrupted files (issue #14): every reader refuses malformed input with a ValueError that
names the file, the tensor and the problem, before reading tensor data; never a silent wrong read.

Targeted regression tests first, then a seeded hypothesis fuzz over files our writers produce
(``qformats._safetensors.write``, ``scalify.io.save``, and a minimal GGUF built here byte by byte):
truncated, with flipped header bytes, or with offsets / shapes / dtypes / tree entries rewritten.
Reading must raise ``ValueError`` or return exactly the original tensors.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from io_helpers import assert_same_tree, bits, sample

import qformats as qf
import scalify
from qformats import _ckpt_gguf
from qformats import _safetensors as sf

_COUNTER = itertools.count()


def _fresh(tmp_path_factory, suffix):
    """A new path for every example (the header cache is keyed by file identity)."""
    return tmp_path_factory.getbasetemp() / f"fuzz{next(_COUNTER)}{suffix}"


def _st_bytes(header: dict, data: bytes, pad=True) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


def _st(tmp_path, header, data=b"", name="bad.safetensors"):
    p = tmp_path / name
    p.write_bytes(_st_bytes(header, data))
    return p


def _refused(p, match, *, tensor=None, reader=None):
    """Reading ``p`` raises a ValueError naming the file (and the tensor) and matching ``match``."""
    reader = reader or (lambda p: [a for _, a in sf.iter_tensors(p)])
    with pytest.raises(ValueError, match=match) as e:
        reader(p)
    assert str(p) in str(e.value)
    if tensor is not None:
        assert repr(tensor) in str(e.value)
    return str(e.value)


# -- safetensors: targeted ------------------------------------------------------------------------


def test_header_length_cut_into_padding_is_refused(tmp_path):
    """The reported bug: a header length a few bytes short (still valid JSON, the padding cut off)
    made the reader take the tensor from the header's last bytes."""
    p = tmp_path / "a.safetensors"
    sf.write(p, {"xyz": np.arange(16, dtype=np.uint8)})
    raw = bytearray(p.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    assert raw[8 + n - 1 : 8 + n] == b" "  # the writer padded this header
    raw[:8] = (n - 1).to_bytes(8, "little")
    p.write_bytes(bytes(raw))
    _refused(p, "holds 17 bytes of tensor data.*need 16")


def test_trailing_bytes_are_refused(tmp_path):
    p = tmp_path / "a.safetensors"
    sf.write(p, {"x": np.arange(4, dtype=np.float32)})
    p.write_bytes(p.read_bytes() + b"junk")
    _refused(p, "holds 20 bytes of tensor data.*need 16")


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "non-negative integers"),
        ({"dtype": "U8", "shape": [0], "data_offsets": [-8, -8]}, "non-negative integers"),
        ({"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}, r"begin 8 > end 0"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}, "two non-negative integers"),
        ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "non-negative integers"),
        ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "non-negative integers"),
        ({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}, "a list"),
        ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, r"dtype \['F32'\]"),
        ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}, "span 8 bytes"),
        ({"dtype": "F32", "shape": [2]}, "data_offsets"),
        ("F32", "not an object"),
    ],
)
def test_malformed_entries_are_value_errors(tmp_path, entry, match):
    p = _st(tmp_path, {"w": entry}, b"\0" * 8)
    _refused(p, match, tensor="w")


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,Infinity]}}', "Infinity"),
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,NaN]}}', "NaN"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (
            b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            "'w' twice",
        ),
        (b'{"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', "'dtype' twice"),
        (b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,' + b"9" * 5000 + b"]}}", "not valid JSON"),
        (b'\xff{"w":1}', "UTF-8"),
    ],
)
def test_malformed_json_is_a_value_error(tmp_path, raw, match):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 8)
    _refused(p, match)


def test_overlapping_and_holes(tmp_path):
    e = {"dtype": "F32", "shape": [2]}
    p = _st(tmp_path, {"a": {**e, "data_offsets": [0, 8]}, "b": {**e, "data_offsets": [4, 12]}}, b"\0" * 12)
    _refused(p, "overlaps", tensor="b")
    p = _st(tmp_path, {"a": {**e, "data_offsets": [0, 8]}, "b": {**e, "data_offsets": [0, 8]}}, b"\0" * 8)
    _refused(p, "overlaps")
    p = _st(tmp_path, {"a": {**e, "data_offsets": [8, 16]}}, b"\0" * 16)
    _refused(p, "hole", tensor="a")


def test_file_shorter_than_the_data_is_refused_before_reading(tmp_path):
    p = _st(tmp_path, {"w": {"dtype": "F32", "shape": [2**20], "data_offsets": [0, 4 * 2**20]}}, b"\0" * 64)
    msg = _refused(p, "truncated", tensor="w")
    assert "4194304" in msg


def test_header_digest_detects_edits(tmp_path):
    """Files written with digest=True carry a hash of their header; an edit that keeps the header
    valid (here: a dtype of the same item size, which no structural check can see) is refused."""
    p = tmp_path / "a.safetensors"
    sf.write(p, {"x": np.arange(4, dtype=np.int8)}, {"k": "v"}, digest=True)
    assert sf.read_metadata(p) == {"k": "v", sf.DIGEST_KEY: sf.read_metadata(p)[sf.DIGEST_KEY]}
    np.testing.assert_array_equal(sf.read_tensor(p, "x"), np.arange(4, dtype=np.int8))
    p.write_bytes(p.read_bytes().replace(b'"I8"', b'"U8"'))
    _refused(p, "digest")


# -- scalify.io: targeted -------------------------------------------------------------------------


def _io_tree():
    return {
        "w": scalify.as_scaled_array(sample((4, 64)), fmt=qf.MXFP8),
        "n": scalify.as_scaled_array(sample((2, 32), seed=3), fmt=qf.NVFP4),
        "b": jnp.arange(3, dtype=jnp.float32),
    }


def _rewrite(p, edit_tree=None, edit_tensors=None):
    """Rewrite a scalify.io file as a hostile writer could: edited tree and tensors, and a digest that
    matches the edit (or none)."""
    header, _ = sf.read_header(p)
    tensors = dict(sf.iter_tensors(p))
    meta = dict(header["__metadata__"])
    meta.pop(sf.DIGEST_KEY, None)
    if edit_tree is not None:
        meta["scalify.io.tree"] = json.dumps(edit_tree(json.loads(meta["scalify.io.tree"])))
    if edit_tensors is not None:
        tensors = edit_tensors(tensors)
    sf.write(p, tensors, meta, digest=True)


def test_io_digest_catches_a_renamed_key(tmp_path):
    """A one-byte edit of the tree (key "w" -> "v") still parses; the digest refuses it."""
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, _io_tree())
    p.write_bytes(p.read_bytes().replace(b'{\\"w\\":', b'{\\"v\\":'))
    _refused(p, "digest", reader=scalify.io.load)


def test_io_inconsistent_scaled_array_is_refused(tmp_path):
    """A tree whose format does not fit the stored data/scale (axis edited) is refused, naming the leaf."""
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, _io_tree())

    def edit(d):
        d["dict"]["w"]["scaled"]["fmt"]["fields"] = {"axis": 0}
        return d

    _rewrite(p, edit)
    msg = _refused(p, "does not fit", reader=scalify.io.load)
    assert "'w'" in msg and "mxfp8" in msg


def test_io_scale_shape_swapped_is_refused(tmp_path):
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, _io_tree())
    _rewrite(p, edit_tensors=lambda t: {**t, "w.scale": t["w.scale"][:, :1]})
    _refused(p, r"scale.*\(4, 1\).*\(4, 2\)", reader=scalify.io.load)


def test_io_unreferenced_and_doubly_used_tensors_are_refused(tmp_path):
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, _io_tree())
    _rewrite(p, edit_tensors=lambda t: {**t, "extra": np.zeros(2, np.float32)})
    _refused(p, "'extra'.*not named by", reader=scalify.io.load)

    scalify.io.save(p, _io_tree())

    def twice(d):
        d["dict"]["b2"] = {"array": "b"}
        return d

    _rewrite(p, twice)
    _refused(p, "'b'.*twice", reader=scalify.io.load)


def _w(**changes):
    """An edit keeping only leaf ``w``, with fields of its ``scaled`` node replaced."""
    return lambda d: {"dict": {"w": {"scaled": {**d["dict"]["w"]["scaled"], **changes}}}}


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: {"dict": {"b": {"array": 5}}}, "malformed"),
        (_w(dtype="int8"), "floating"),
        (_w(dtype="float33"), "malformed"),
        (_w(fmt={"name": "mxfp8", "fields": {"axis": "x"}}), "does not fit"),
        (_w(scale={"node": "nope", "fields": {}}), "nope"),
        (lambda d: {"dict": {"x": {"tuple": 3}}}, "malformed"),
        (lambda d: {"list": [[[]]]}, "malformed"),
        (lambda d: {"dict": {"w": {"scaled": {"data": "w.data"}}}}, "malformed"),
    ],
)
def test_io_malformed_tree_is_a_value_error(tmp_path, edit, match):
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, _io_tree())
    _rewrite(p, edit)
    _refused(p, match, reader=scalify.io.load)


def test_io_deeply_nested_tree_is_a_value_error(tmp_path):
    p = tmp_path / "m.safetensors"
    scalify.io.save(p, {"b": jnp.zeros(2)})
    header, _ = sf.read_header(p)
    meta = {k: v for k, v in header["__metadata__"].items() if k != sf.DIGEST_KEY}
    meta["scalify.io.tree"] = '{"list":[' * 5000 + '{"array":"b"}' + "]}" * 5000
    sf.write(p, dict(sf.iter_tensors(p)), meta)
    _refused(p, "nested too deeply", reader=scalify.io.load)


# -- GGUF: a minimal writer (no gguf package needed) ----------------------------------------------

F32, F16, Q4_0, Q8_0, BF16 = 0, 1, 2, 8, 30


def build_gguf(tensors, *, alignment=32, kv=(("general.architecture", "llama"),)):
    """GGUF v3 bytes for ``tensors`` = [(name, ggml type, NumPy shape, raw bytes)], laid out as llama.cpp
    writes it. Also returns ``{label: (position, struct format)}`` of every integer field."""
    out = bytearray()
    fields = {}

    def put(fmt, v, label=None):
        if label:
            fields[label] = (len(out), fmt)
        out.extend(struct.pack(fmt, v))

    def string(s, label):
        b = s.encode()
        put("<Q", len(b), label)
        out.extend(b)

    out.extend(b"GGUF")
    put("<I", 3, "version")
    put("<Q", len(tensors), "n_tensors")
    put("<Q", len(kv) + 1, "n_kv")
    string("general.alignment", "kv.alignment.key")
    put("<I", 4, "kv.alignment.type")
    put("<I", alignment, "kv.alignment.value")
    for i, (k, v) in enumerate(kv):
        string(k, f"kv{i}.key")
        put("<I", 8, f"kv{i}.type")
        string(v, f"kv{i}.value")
    offset, placed = 0, []
    for i, (name, kind, shape, raw) in enumerate(tensors):
        string(name, f"t{i}.name")
        put("<I", len(shape), f"t{i}.n_dims")
        for j, d in enumerate(reversed(shape)):
            put("<Q", d, f"t{i}.dim{j}")
        put("<I", kind, f"t{i}.type")
        put("<Q", offset, f"t{i}.offset")
        placed.append((offset, raw))
        offset += len(raw) + (-len(raw) % alignment)
    out.extend(b"\0" * (-len(out) % alignment))
    start = len(out)
    for off, raw in placed:
        out.extend(b"\0" * (start + off - len(out)))
        out.extend(raw)
        out.extend(b"\0" * (-len(out) % alignment))
    return bytes(out), fields


def _gguf_tensors():
    """Shapes with every dimension >= 16, so that changing one dimension changes a tensor's size by
    at least one alignment unit (GGUF has no checksum: a change within the padding is invisible)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    q8 = qf.get_format("gguf_q8_0")
    codes, d = (np.asarray(a) for a in q8.quantize(x))
    blocks = np.concatenate([d[..., None].view(np.uint8), codes.view(np.uint8).reshape(16, 2, 32)], axis=-1)
    h = rng.standard_normal((16, 32)).astype(np.float16)
    bf = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    return [
        ("blk.0.w", Q8_0, (16, 64), blocks.tobytes()),
        ("norm", F32, (16, 64), x.tobytes()),
        ("h", F16, (16, 32), h.tobytes()),
        ("e", BF16, (16, 16), bf.tobytes()),
    ]


def _gguf_read_all(p):
    """Every tensor of a GGUF file as a list of byte strings (data, then scale), in file order."""
    out = []
    for v in _ckpt_gguf.read(p).values():
        leaves = [v.data, v.scale] if isinstance(v, qf.QuantizedTensor) else [v]
        out.append(b"".join(bits(a).tobytes() for a in leaves))
    return out


def test_gguf_minimal_file_reads_back(tmp_path):
    p = tmp_path / "m.gguf"
    tensors = _gguf_tensors()
    p.write_bytes(build_gguf(tensors)[0])
    out = _ckpt_gguf.read(p)
    assert list(out) == [t[0] for t in tensors]
    np.testing.assert_array_equal(out["norm"], np.frombuffer(tensors[1][3], np.float32).reshape(16, 64))
    assert out["e"].dtype == ml_dtypes.bfloat16 and out["h"].dtype == np.float16
    assert out["blk.0.w"].fmt.name == "gguf_q8_0" and out["blk.0.w"].data.shape == (16, 64)


def _gguf_edit(tmp_path, label, value, tensors=None):
    raw, fields = build_gguf(tensors or _gguf_tensors())
    pos, fmt = fields[label]
    b = bytearray(raw)
    struct.pack_into(fmt, b, pos, value)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(b))
    return p


@pytest.mark.parametrize(
    "label, value, match, tensor",
    [
        ("t2.offset", 0, "overlaps", "h"),  # used to be read silently from another tensor's bytes
        ("t1.offset", 2**40, "starts at", "norm"),
        ("t1.offset", 352, "starts at", "norm"),
        ("t0.dim1", 2**40, "truncated|needs", "blk.0.w"),
        ("t0.dim1", 2**63, "dimension", "blk.0.w"),
        ("t0.dim0", 48, "multiple of 32", "blk.0.w"),
        ("t0.n_dims", 50, "dimensions", "blk.0.w"),
        ("t1.type", 77, "unknown GGUF type", "norm"),
        ("n_tensors", 2**40, "tensor count", None),
        ("n_kv", 2**40, "key-value count", None),
        ("kv0.value", 2**50, "truncated", None),
        ("kv.alignment.value", 24, "alignment", None),
        ("kv.alignment.type", 12, "general.alignment", None),
        ("kv.alignment.type", 99, "value type 99", None),
        ("version", 1, "version 1", None),
        ("version", 3 << 24, "big-endian", None),
    ],
)
def test_gguf_malformed_headers(tmp_path, label, value, match, tensor):
    p = _gguf_edit(tmp_path, label, value)
    _refused(p, match, tensor=tensor, reader=_ckpt_gguf.read)


def test_gguf_truncated_and_trailing(tmp_path):
    raw, _ = build_gguf(_gguf_tensors())
    p = tmp_path / "t.gguf"
    p.write_bytes(raw[:-100])
    _refused(p, "truncated", tensor="e", reader=_ckpt_gguf.read)
    p.write_bytes(raw[:20])
    _refused(p, "truncated", reader=_ckpt_gguf.read)
    p.write_bytes(raw + b"\0" * 64)
    _refused(p, "after the last tensor", reader=_ckpt_gguf.read)
    p.write_bytes(b"")
    _refused(p, "empty", reader=_ckpt_gguf.read)
    p.write_bytes(b"GGML" + raw[4:])
    _refused(p, "magic", reader=_ckpt_gguf.read)


def test_gguf_duplicate_names(tmp_path):
    t = _gguf_tensors()
    t[1] = ("h", *t[1][1:])
    p = tmp_path / "d.gguf"
    p.write_bytes(build_gguf(t)[0])
    _refused(p, "'h' twice", reader=_ckpt_gguf.read)


def test_gguf_unsupported_type_named(tmp_path):
    t = _gguf_tensors()
    t[1] = ("q5", 6, (16, 64), b"\0" * (16 * 2 * 22))  # Q5_0: 22-byte blocks of 32
    p = tmp_path / "u.gguf"
    p.write_bytes(build_gguf(t)[0])
    with pytest.raises(qf.CheckpointError, match=r"'q5' has GGUF type Q5_0.*Q8_0, Q4_0") as e:
        _ckpt_gguf.read(p)
    assert str(p) in str(e.value)


# -- fuzz ----------------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BAD_JSON = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-5, 2**20), max_size=4),
    st.sampled_from([*sf.DTYPES, "F4", "Q4_0", "f32", ""]),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _corruptions(header_end_of):
    """A strategy of functions ``bytes -> bytes``: truncation, header byte flips, or (drawn by the
    caller) structured rewrites."""
    truncate = st.builds(lambda f: lambda raw: raw[: int(f * len(raw))], st.floats(0, 0.999))

    def flip(raw, picks):
        b = bytearray(raw)
        end = header_end_of(raw)
        for pos_f, val in picks:
            b[min(int(pos_f * end), len(b) - 1)] ^= val
        return bytes(b)

    flips = st.lists(st.tuples(st.floats(0, 0.999), st.integers(1, 255)), min_size=1, max_size=3).map(
        lambda picks: lambda raw: flip(raw, picks)
    )
    return st.one_of(truncate, flips)


def _st_header_end(raw):
    return min(8 + int.from_bytes(raw[:8], "little"), len(raw))


@pytest.fixture(scope="module")
def st_original(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((4, 8)).astype(np.float32),
        "h": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "q": rng.integers(0, 255, (7,), dtype=np.uint8),
        "f8": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
        "i": np.arange(3, dtype=np.int64),
        "empty": np.zeros((0, 4), np.float32),
        "s": np.float32(2.5),
    }
    p = tmp_path_factory.mktemp("orig") / "o.safetensors"
    sf.write(p, tensors, {"k": "v"})
    raw = p.read_bytes()
    return raw, {k: a.tobytes() for k, a in sf.iter_tensors(p)}  # in file order


def _outcome(read):
    """``read()``; a ValueError is a refusal (recorded as a hypothesis event), anything else fails."""
    try:
        out = read()
    except ValueError:
        event("refused")
        return None
    event("read")
    return out


def _check_st(p, want):
    """ValueError, or exactly the original bytes for every tensor: by name (an empty tensor may sit at
    any offset), or, if a corruption renamed tensors, the non-empty ones in file order."""
    got = _outcome(lambda: [(k, np.ascontiguousarray(a).tobytes()) for k, a in sf.iter_tensors(p)])
    if got is None:
        return
    if {k for k, _ in got} == set(want):
        assert dict(got) == want
    else:
        assert [b for _, b in got if b] == [b for b in want.values() if b]


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_bytes(tmp_path_factory, st_original, data):
    raw, want = st_original
    corrupt = data.draw(_corruptions(_st_header_end))
    p = _fresh(tmp_path_factory, ".safetensors")
    p.write_bytes(corrupt(raw))
    _check_st(p, want)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_fields(tmp_path_factory, st_original, data):
    raw, want = st_original
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names))
    key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    entry = header[name]
    if key == "data_offsets" and data.draw(st.booleans()):
        value = [o + data.draw(st.integers(-9, 9)) for o in entry[key]]
    elif key == "shape" and entry[key] and data.draw(st.booleans()):
        value = [d + data.draw(st.integers(-2, 2)) for d in entry[key]]
    else:
        value = data.draw(BAD_JSON)
    entry[key] = value
    p = _fresh(tmp_path_factory, ".safetensors")
    p.write_bytes(_st_bytes(header, raw[8 + n :], pad=data.draw(st.booleans())))
    _check_st(p, want)


@pytest.fixture(scope="module")
def io_original(tmp_path_factory):
    tree = _io_tree()
    p = tmp_path_factory.mktemp("orig") / "m.safetensors"
    scalify.io.save(p, tree)
    return p.read_bytes(), tree


def _check_io(p, tree):
    back = _outcome(lambda: scalify.io.load(p))
    if back is not None:
        assert_same_tree(back, tree)


IO_FUZZ = settings(FUZZ, max_examples=150)


@IO_FUZZ
@given(data=st.data())
def test_fuzz_scalify_io_bytes(tmp_path_factory, io_original, data):
    raw, tree = io_original
    p = _fresh(tmp_path_factory, ".safetensors")
    p.write_bytes(data.draw(_corruptions(_st_header_end))(raw))
    _check_io(p, tree)


def _json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _json_paths(v, (*prefix, i))


def _set(node, path, value):
    if not path:
        return value
    node[path[0]] = _set(node[path[0]], path[1:], value)
    return node


def _consistent(tree):
    """Each ScaledArray's data and scale have the shapes and dtypes its format produces."""
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, scalify.ScaledArray)):
        if isinstance(leaf, scalify.ScaledArray) and leaf.fmt is not None:
            spec = jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
            want = jax.eval_shape(leaf.fmt.quantize, spec)
            got = (leaf.data, leaf.scale)
            assert jax.tree.structure(want) == jax.tree.structure(got)
            for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
                assert (w.shape, w.dtype) == (np.shape(g), np.asarray(g).dtype)
            assert leaf._dtype is None or jnp.issubdtype(leaf._dtype, jnp.floating)


@IO_FUZZ
@given(data=st.data())
def test_fuzz_scalify_io_hostile_tree(tmp_path_factory, io_original, data):
    """A hostile writer edits the tree and signs the edit: the reader refuses with a ValueError or
    returns a tree whose every ScaledArray is consistent with its format (never a crash)."""
    raw, _ = io_original
    p = _fresh(tmp_path_factory, ".safetensors")
    p.write_bytes(raw)
    paths = []

    def edit(d):
        paths.extend(_json_paths(d))
        path = data.draw(st.sampled_from(paths))
        value = data.draw(
            st.one_of(
                BAD_JSON,
                st.sampled_from(["w.data", "w.scale", "n.data", "b", "mxfp8", "nvfp4", "float16", "int8"]),
                st.sampled_from([{"array": "b"}, {"list": []}, {"tuple": [None]}, {"name": "mxfp4", "fields": {}}]),
            )
        )
        return _set(d, path, value)

    _rewrite(p, edit)
    back = _outcome(lambda: scalify.io.load(p))
    if back is not None:
        _consistent(back)


@pytest.fixture(scope="module")
def gguf_original(tmp_path_factory):
    raw, fields = build_gguf(_gguf_tensors())
    p = tmp_path_factory.mktemp("orig") / "m.gguf"
    p.write_bytes(raw)
    return raw, fields, _gguf_read_all(p)


def _check_gguf(p, want):
    got = _outcome(lambda: _gguf_read_all(p))
    assert got is None or got == want


def _gguf_header_end(fields):
    pos, fmt = fields["t3.offset"]
    return lambda raw: pos + struct.calcsize(fmt)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_bytes(tmp_path_factory, gguf_original, data):
    raw, fields, want = gguf_original
    p = _fresh(tmp_path_factory, ".gguf")
    p.write_bytes(data.draw(_corruptions(_gguf_header_end(fields)))(raw))
    _check_gguf(p, want)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_fields(tmp_path_factory, gguf_original, data):
    raw, fields, want = gguf_original
    label = data.draw(st.sampled_from(sorted(fields)))
    pos, fmt = fields[label]
    width = struct.calcsize(fmt) * 8
    (old,) = struct.unpack_from(fmt, raw, pos)
    value = data.draw(
        st.one_of(
            st.integers(0, 2**width - 1),
            st.integers(-64, 64).map(lambda d: (old + d) % 2**width),
            st.sampled_from([0, 1, 2**width - 1, 2 ** (width - 1), F32, F16, Q4_0, Q8_0, BF16]),
        )
    )
    b = bytearray(raw)
    struct.pack_into(fmt, b, pos, value)
    p = _fresh(tmp_path_factory, ".gguf")
    p.write_bytes(bytes(b))
    _check_gguf(p, want)


def test_fuzz_inputs_are_valid_files(st_original, io_original, gguf_original, tmp_path):
    """The originals the fuzz corrupts read back (so a ValueError above is due to the corruption)."""
    p = tmp_path / "o.safetensors"
    p.write_bytes(st_original[0])
    assert {k: a.tobytes() for k, a in sf.iter_tensors(p)} == st_original[1]
    p.write_bytes(io_original[0])
    assert_same_tree(scalify.io.load(p), io_original[1])
    assert hashlib.sha256(gguf_original[0]).hexdigest()  # built; read back in test_gguf_minimal_file_reads_back


def test_gguf_metadata_of_every_type_is_skipped(tmp_path):
    """A file from the gguf package's own writer, with metadata of every value type (arrays of strings and
    numbers as a tokenizer has), reads like gguf.GGUFReader reads it."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "", "ü" * 7])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.0, 3.0])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3, 4])
    w.add_bool("b", True)
    w.add_float64("f64", 1.5)
    w.add_int8("i8", -3)
    w.add_uint16("u16", 7)
    w.add_uint64("u64", 2**40)
    w.add_string("s", "text")
    x = np.arange(96, dtype=np.float32).reshape(3, 32)
    w.add_tensor("x", x)
    w.add_tensor("h", x.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, infos = _ckpt_gguf.read_header(tmp_path / "m.gguf")
    assert meta["s"] == "text" and meta["general.architecture"] == "llama"
    ref = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert [(t.name, t.shape) for t in infos] == [(t.name, tuple(reversed(t.shape.tolist()))) for t in ref.tensors]
    assert [t.offset for t in infos] == [t.data_offset for t in ref.tensors]
    out = _ckpt_gguf.read(tmp_path / "m.gguf")
    np.testing.assert_array_equal(out["x"], x)
    np.testing.assert_array_equal(out["h"], x.astype(np.float16))
