"""qformats._safetensors: our reader against the safetensors package, and its errors."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qformats import _safetensors as sf

safetensors = pytest.importorskip("safetensors", reason="the safetensors package is not installed")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

# dtypes that safetensors.numpy also handles: the package is the independent reference for these.
NUMPY_DTYPES = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_]
ML_DTYPES = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu]


def _random(rng, dtype, shape):
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@settings(max_examples=25, deadline=None)
@given(
    st.dictionaries(
        st.text("abc._01", min_size=1, max_size=6).filter(lambda s: s != "__metadata__"),
        st.tuples(st.sampled_from(NUMPY_DTYPES), st.lists(st.integers(0, 5), max_size=3)),
        max_size=6,
    ),
    st.integers(0, 2**31),
)
def test_write_read_against_package(tmp_path_factory, spec, seed):
    """Property: for any set of names/dtypes/shapes, the package reads our file and we read the package's."""
    rng = np.random.default_rng(seed)
    tensors = {k: _random(rng, dt, tuple(shape)) for k, (dt, shape) in spec.items()}
    d = tmp_path_factory.mktemp("st")
    ours, theirs = d / "ours.safetensors", d / "theirs.safetensors"
    sf.write(ours, tensors, {"k": "v"})
    with safe_open(str(ours), framework="numpy") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"k": "v"}
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), v.reshape(-1).view(np.uint8))
    if tensors:
        save_file(tensors, str(theirs))
        got = dict(sf.iter_tensors(theirs))
        assert set(got) == set(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k].reshape(-1).view(np.uint8), v.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("dtype", ML_DTYPES, ids=lambda d: np.dtype(d).name)
def test_ml_dtypes_round_trip_and_header_names(tmp_path, dtype):
    """bf16 / fp8 / E8M0 keep their bits and get the safetensors dtype names of the spec."""
    x = _random(np.random.default_rng(0), dtype, (3, 5))
    p = tmp_path / "a.safetensors"
    sf.write(p, {"x": x, "y": np.float32(1.5)})
    header, offset = sf.read_header(p)
    expected = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0"}
    assert header["x"]["dtype"] == expected[np.dtype(dtype).name]
    assert offset % 8 == 0
    for mmap in (False, True):
        got = sf.read_tensor(p, "x", mmap=mmap)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), x.view(np.uint8))
    # The raw bytes in the file are the tensor's little-endian bytes at the header's offsets.
    raw = p.read_bytes()
    s, e = header["x"]["data_offsets"]
    assert raw[offset + s : offset + e] == x.astype(np.dtype(dtype).newbyteorder("<")).tobytes()


def test_alignment_by_item_size(tmp_path):
    p = tmp_path / "a.safetensors"
    sf.write(p, {"u8": np.ones(3, np.uint8), "f64": np.ones(3), "f32": np.ones(1, np.float32)})
    header, offset = sf.read_header(p)
    for k, v in header.items():
        if k != "__metadata__":
            assert (offset + v["data_offsets"][0]) % sf.DTYPES[v["dtype"]].itemsize == 0


def test_compare_reads_through_the_shared_reader(tmp_path):
    from qformats._cli import _engine

    x = np.linspace(-1, 1, 8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    sf.write(tmp_path / "w.safetensors", {"w": x})
    tensors, problems = _engine.load_tensors([tmp_path / "w.safetensors"])
    assert problems == []
    assert tensors[0].name == "w" and tensors[0].array.dtype == x.dtype


def _h(dtype="F32", shape=(2,), offsets=(0, 8)) -> bytes:
    return json.dumps({"x": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}).encode()


def _file(tmp_path, header: bytes, data: bytes = b"", n=None):
    p = tmp_path / "bad.safetensors"
    p.write_bytes((len(header) if n is None else n).to_bytes(8, "little") + header + data)
    return p


@pytest.mark.parametrize(
    "header, data, n, match",
    [
        (b"{oops", b"", None, "not valid JSON"),
        (b"[1, 2]", b"", None, "not a JSON object"),
        (b"{}", b"", 10**9, "header length field"),
        (
            json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(),
            b"1234",
            None,
            "truncated",
        ),
        (
            json.dumps({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}).encode(),
            b"1" * 8,
            None,
            "dtype 'Q4'",
        ),
        (
            json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode(),
            b"1" * 8,
            None,
            "do not hold",
        ),
        (json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode(), b"1" * 12, None, "hole"),
        (json.dumps({"x": {"dtype": "F32"}}).encode(), b"", None, "malformed entry"),
        (json.dumps({"__metadata__": {"a": 1}}).encode(), b"", None, "strings to strings"),
    ],
)
def test_corrupted_files_name_the_problem(tmp_path, header, data, n, match):
    p = _file(tmp_path, header, data, n)
    with pytest.raises(sf.SafetensorsError, match=match) as e:
        sf.read_header(p)
    assert str(p) in str(e.value)


def test_short_missing_directory_unknown_name(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(sf.SafetensorsError, match="fewer than the 8-byte"):
        sf.read_header(tmp_path / "short.safetensors")
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors"):
        sf.read_header(tmp_path / "nope.safetensors")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        sf.read_header(tmp_path)
    sf.write(tmp_path / "a.safetensors", {"x": np.zeros(2, np.float32)})
    with pytest.raises(KeyError, match="no tensor named 'y'; the file holds: x"):
        sf.read_tensor(tmp_path / "a.safetensors", "y")


def test_writer_rejects_what_it_cannot_store(tmp_path):
    with pytest.raises(TypeError, match="no safetensors name"):
        sf.write(tmp_path / "a.safetensors", {"x": np.zeros(2, ml_dtypes.float4_e2m1fn)})
    with pytest.raises(TypeError, match="strings to strings"):
        sf.write(tmp_path / "a.safetensors", {"x": np.zeros(2)}, {"k": 1})
    with pytest.raises(ValueError, match="invalid tensor name"):
        sf.write(tmp_path / "a.safetensors", {"__metadata__": np.zeros(2)})
    assert not list(tmp_path.iterdir())  # nothing half-written
