"""``python -m qformats list|compare`` run as a subprocess on files written here.

Reference numbers are computed independently: quantization to an element grid is redone in numpy
and decoded with ml_dtypes, never by calling qformats.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import qformats as qf


def run(*args, cwd=None):
    proc = subprocess.run(
        [sys.executable, "-m", "qformats", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )
    return proc


def compare_json(*args, cwd=None):
    proc = run("compare", "--json", "--repeats", "1", *args, cwd=cwd)
    return proc, (json.loads(proc.stdout) if proc.stdout.strip() else [])


def sqnr(x, y):
    x = np.asarray(x, np.float64)
    e = x - np.asarray(y, np.float64)
    return 10 * math.log10(np.sum(x * x) / np.sum(e * e))


def ref_per_tensor(x, mltype, max_value):
    """rceil per-tensor scaling: scale = 2**ceil(log2(amax / max)); round with ml_dtypes."""
    amax = float(np.max(np.abs(x)))
    scale = 2.0 ** math.ceil(math.log2(amax / max_value))
    return (x / scale).astype(np.float32).astype(mltype).astype(np.float64) * scale


def ref_mx(x, mltype, emax, block=32):
    """OCP MX (floor) along the last axis: scale = 2**(floor(log2 amax) - emax), elements saturate."""
    b = x.reshape(*x.shape[:-1], -1, block).astype(np.float64)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    scale = 2.0 ** (np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - emax)
    mx = float(ml_dtypes.finfo(mltype).max)
    v = np.clip(b / scale, -mx, mx).astype(np.float32).astype(mltype).astype(np.float64)
    return (v * scale).reshape(x.shape)


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(1)
    return {
        "w": (rng.standard_normal((64, 128)) * 0.05).astype(np.float32),
        "act": (rng.standard_t(3, size=(32, 64)) * 3).astype(np.float32),
    }


def test_list_contains_every_registered_format():
    # the registry of a fresh process (conftest may register extra formats in this one)
    code = "import json, qformats; print(json.dumps(qformats.list_formats()))"
    names = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert set(names) >= {"fp16", "bf16", "fp8_e4m3", "mxfp8", "mxfp4", "int8_per_channel", "nvfp4"}
    assert set(names) <= set(qf.list_formats())
    proc = run("list")
    assert proc.returncode == 0, proc.stderr
    for name in names:
        assert name in proc.stdout
    rows = json.loads(run("list", "--json").stdout)
    assert [r["name"] for r in rows] == names


def test_compare_npy_numbers_match_independent_reference(tmp_path, arrays):
    x = arrays["w"]
    np.save(tmp_path / "w.npy", x)
    proc, recs = compare_json(tmp_path / "w.npy", "--formats", "fp8_e4m3,fp8_e5m2,bf16,mxfp8,mxfp6_e2m3")
    assert proc.returncode == 0, proc.stderr
    by = {r["format"]: r for r in recs}
    for key in (
        "tensor",
        "format",
        "bits_per_element",
        "sqnr_db",
        "saturated_fraction",
        "flushed_fraction",
        "quantize_seconds",
    ):
        assert all(key in r for r in recs)
    assert {r["tensor"] for r in recs} == {"w"}
    refs = {
        "fp8_e4m3": ref_per_tensor(x, ml_dtypes.float8_e4m3fn, 448.0),
        "fp8_e5m2": ref_per_tensor(x, ml_dtypes.float8_e5m2, 57344.0),
        "bf16": x.astype(ml_dtypes.bfloat16).astype(np.float64),
        "mxfp8": ref_mx(x, ml_dtypes.float8_e4m3fn, 8),
        "mxfp6_e2m3": ref_mx(x, ml_dtypes.float6_e2m3fn, 2),
    }
    for name, y in refs.items():
        assert by[name]["sqnr_db"] == pytest.approx(sqnr(x, y), abs=1e-6), name
        nz = x != 0
        assert by[name]["max_rel_error"] == pytest.approx(np.max(np.abs(x - y)[nz] / np.abs(x)[nz]), rel=1e-6)
        assert by[name]["flushed_fraction"] == pytest.approx(np.mean(nz & (y == 0)))
        assert by[name]["quantize_seconds"] > 0
    assert by["fp8_e4m3"]["bits_per_element"] == 8 + 32 / x.size  # one float32 scale
    assert by["mxfp8"]["bits_per_element"] == 8.25
    assert by["mxfp6_e2m3"]["bits_per_element"] == 6.25
    # per-tensor rceil never saturates
    assert by["fp8_e4m3"]["saturated_fraction"] == 0.0


def test_saturated_fraction_mx_floor(tmp_path):
    # one block whose amax (500) is above 448 * 2**0 but below 2**9: floor scale 1, so 500 clips to 448
    x = np.full((1, 32), 1.0, np.float32)
    x[0, 0] = 500.0
    x[0, 1] = 460.0  # within half a step (16) of 448: ordinary rounding, not saturation
    np.save(tmp_path / "s.npy", x)
    proc, recs = compare_json(tmp_path / "s.npy", "--formats", "mxfp8")
    assert proc.returncode == 0, proc.stderr
    assert recs[0]["saturated_fraction"] == pytest.approx(1 / 32)


def test_recommendation_and_min_sqnr(tmp_path, arrays):
    np.savez(tmp_path / "a.npz", **arrays)
    proc, recs = compare_json(tmp_path / "a.npz", "--formats", "fp16,fp8_e4m3,mxfp4", "--min-sqnr", "25")
    assert proc.returncode == 0, proc.stderr
    for t in ("w", "act"):
        rs = [r for r in recs if r["tensor"] == t]
        ok = [r for r in rs if r["sqnr_db"] is not None and r["sqnr_db"] >= 25]
        best = min(ok, key=lambda r: r["bits_per_element"])
        assert [r["format"] for r in rs if r["recommended"]] == [best["format"]]
    proc, recs = compare_json(tmp_path / "a.npz", "--formats", "fp8_e4m3", "--min-sqnr", "200")
    assert not any(r["recommended"] or r["recommended_overall"] for r in recs)
    text = run("compare", tmp_path / "a.npz", "--formats", "fp16,mxfp4").stdout
    assert "overall: fp16" in text


def test_tensor_selection_and_text_output(tmp_path, arrays):
    np.savez(tmp_path / "a.npz", **arrays)
    proc, recs = compare_json(tmp_path / "a.npz", "--tensor", "act", "--formats", "mxfp8")
    assert proc.returncode == 0 and {r["tensor"] for r in recs} == {"act"}
    proc, recs = compare_json(tmp_path / "a.npz", "--tensor", "nope", "--formats", "mxfp8")
    assert proc.returncode == 2 and "nope" in proc.stderr and "Available: act, w" in proc.stderr


def test_missing_and_corrupt_files_other_tensors_still_analysed(tmp_path, arrays):
    np.save(tmp_path / "good.npy", arrays["w"])
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    (tmp_path / "bad.npz").write_bytes(b"PK not a zip")
    proc, recs = compare_json(
        tmp_path / "good.npy",
        tmp_path / "missing.npy",
        tmp_path / "bad.npy",
        tmp_path / "bad.npz",
        "--formats",
        "mxfp8",
    )
    assert proc.returncode == 2
    assert [r["tensor"] for r in recs] == ["good"]
    assert "missing.npy: no such file" in proc.stderr
    assert "bad.npy: cannot read it" in proc.stderr and "bad.npz: cannot read it" in proc.stderr


def test_pickled_object_array_is_refused(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    proc, recs = compare_json(tmp_path / "obj.npy")
    assert proc.returncode == 2 and recs == []
    assert "obj.npy" in proc.stderr and "pickle" in proc.stderr.lower()


def test_integer_only_file(tmp_path):
    np.savez(tmp_path / "ints.npz", ids=np.arange(64, dtype=np.int32))
    proc, recs = compare_json(tmp_path / "ints.npz")
    assert proc.returncode == 2 and recs == []
    assert "ints.npz: holds no floating-point tensor" in proc.stderr and "astype(np.float32)" in proc.stderr


def test_unknown_format_name_others_still_analysed(tmp_path, arrays):
    np.save(tmp_path / "w.npy", arrays["w"])
    proc, recs = compare_json(tmp_path / "w.npy", "--formats", "mxfp8,notaformat")
    assert proc.returncode == 2
    assert [r["format"] for r in recs] == ["mxfp8"]
    assert "notaformat" in proc.stderr and "Known formats" in proc.stderr


def test_axis_not_fitting_block_size(tmp_path):
    x = np.random.default_rng(0).standard_normal((48, 40)).astype(np.float32)
    np.save(tmp_path / "odd.npy", x)
    proc, recs = compare_json(tmp_path / "odd.npy", "--formats", "fp8_e4m3,mxfp8")
    assert proc.returncode == 2
    by = {r["format"]: r for r in recs}
    assert by["fp8_e4m3"]["applicable"] and by["fp8_e4m3"]["sqnr_db"] > 20
    assert not by["mxfp8"]["applicable"] and by["mxfp8"]["sqnr_db"] is None
    assert "odd" in proc.stderr and "multiple of 32" in proc.stderr and "axis" in proc.stderr
    # --axis 0 makes it fit (48 is not a multiple of 32 either, 64 is)
    np.save(tmp_path / "t.npy", np.random.default_rng(0).standard_normal((64, 40)).astype(np.float32))
    proc, recs = compare_json(tmp_path / "t.npy", "--formats", "mxfp8", "--axis", "0")
    assert proc.returncode == 0, proc.stderr
    assert recs[0]["axis"] == 0 and recs[0]["applicable"]


def test_exact_round_trip_is_reported(tmp_path):
    x = np.array([[1.0, -2.0, 0.5, 0.0] * 8], np.float32)
    np.save(tmp_path / "e.npy", x)
    proc, recs = compare_json(tmp_path / "e.npy", "--formats", "bf16")
    assert proc.returncode == 0
    assert recs[0]["exact"] and recs[0]["sqnr_db"] is None


def test_safetensors(tmp_path, arrays):
    st = pytest.importorskip(
        "safetensors.numpy", reason="the safetensors package is not installed (pip install safetensors)"
    )
    st.save_file({**arrays, "ids": np.arange(4, dtype=np.int64)}, str(tmp_path / "m.safetensors"))
    proc, recs = compare_json(tmp_path / "m.safetensors", "--formats", "fp8_e4m3")
    assert proc.returncode == 0, proc.stderr
    by = {r["tensor"]: r for r in recs}
    assert set(by) == {"w", "act"}
    x = arrays["act"]
    assert by["act"]["sqnr_db"] == pytest.approx(sqnr(x, ref_per_tensor(x, ml_dtypes.float8_e4m3fn, 448.0)), abs=1e-6)


def test_safetensors_bf16_written_by_hand(tmp_path):
    """The built-in reader needs no package and reads bfloat16."""
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32).astype(ml_dtypes.bfloat16)
    header = json.dumps({"x": {"dtype": "BF16", "shape": [2, 32], "data_offsets": [0, x.nbytes]}}).encode()
    (tmp_path / "h.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + x.tobytes())
    (tmp_path / "broken.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    proc, recs = compare_json(tmp_path / "h.safetensors", tmp_path / "broken.safetensors", "--formats", "fp16")
    assert proc.returncode == 2
    assert recs[0]["tensor"] == "x" and recs[0]["dtype"] == "bfloat16" and recs[0]["exact"]
    assert "broken.safetensors" in proc.stderr


def test_default_set_runs(tmp_path):
    proc = run("compare", "--repeats", "1", "--formats", "fp8_e4m3,mxfp8,nvfp4")
    assert proc.returncode == 0, proc.stderr
    for name in ("weights", "activations", "gradients", "embedding", "overall:"):
        assert name in proc.stdout


def test_plot(tmp_path, arrays):
    np.save(tmp_path / "w.npy", arrays["w"])
    proc = run("compare", tmp_path / "w.npy", "--formats", "fp8_e4m3,mxfp4", "--plot", tmp_path / "p.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode == 2 and "matplotlib" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
