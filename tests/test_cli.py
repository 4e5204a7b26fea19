"""``python -m qformats list|compare`` run as a subprocess on files written here.

Reference numbers are computed independently: quantization to an element grid is redone in numpy
and decoded with ml_dtypes, never by calling qformats.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import qformats as qf
from qformats._cli import main


def run_subprocess(*args, cwd=None):
    """``python -m qformats ARGS`` in a fresh interpreter: the entry point and its registry."""
    return subprocess.run(
        [sys.executable, "-m", "qformats", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def run(*args, cwd=None):
    """``qformats._cli.main(ARGS)`` in this process, with what a subprocess would report: the exit
    code (argparse's ``SystemExit`` included), stdout and stderr. A subprocess per call imports
    JAX and compiles again (seconds each); the entry point itself is run by
    ``test_module_entry_point_is_main``, and the tests that register a format (``--import``) or
    read a fresh registry run it too."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


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
    proc = run_subprocess("list")
    assert proc.returncode == 0, proc.stderr
    for name in names:
        assert name in proc.stdout
    rows = json.loads(run_subprocess("list", "--json").stdout)
    assert [r["name"] for r in rows] == names


def test_module_entry_point_is_main(tmp_path, arrays):
    """``python -m qformats`` reports what the in-process ``main`` the other tests call reports: the
    same JSON on a file, the same exit code and message on a bad argument."""
    np.save(tmp_path / "w.npy", arrays["w"])
    args = ("compare", "--json", "--repeats", "1", tmp_path / "w.npy", "--formats", "fp8_e4m3,mxfp4")
    sub, here = run_subprocess(*args), run(*args)
    assert sub.returncode == here.returncode == 0, sub.stderr
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rows]
    assert strip(json.loads(sub.stdout)) == strip(json.loads(here.stdout))
    sub, here = run_subprocess("compare", "--repeats", "x"), run("compare", "--repeats", "x")
    assert sub.returncode == here.returncode == 2 and sub.stderr == here.stderr


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


# -- hostile inputs (issue #14) -------------------------------------------------------------------


def test_same_base_name_in_two_folders_gets_distinct_names(tmp_path, arrays):
    """a/w.npy and b/w.npy used to be reported together under one name ("w.npy:w")."""
    for d, x in (("a", arrays["w"]), ("b", -2 * arrays["w"])):
        (tmp_path / d).mkdir()
        np.save(tmp_path / d / "w.npy", x)
        np.savez(tmp_path / d / "m.npz", k=x)
    proc, recs = compare_json("a/w.npy", "b/w.npy", "a/m.npz", "b/m.npz", "--formats", "fp8_e4m3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [r["tensor"] for r in recs] == ["a/w.npy", "b/w.npy", "a/m.npz:k", "b/m.npz:k"]
    assert [r["source"] for r in recs] == ["a/w.npy", "b/w.npy", "a/m.npz", "b/m.npz"]
    assert all(r["recommended"] for r in recs)
    proc, recs = compare_json("a/w.npy", "b/w.npy", "--tensor", "b/w.npy", "--formats", "fp8_e4m3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [r["tensor"] for r in recs] == ["b/w.npy"]
    text = run("compare", "a/w.npy", "b/w.npy", "--formats", "fp8_e4m3", "--repeats", "1", cwd=tmp_path).stdout
    assert "a/w.npy" in text and "b/w.npy" in text


def test_same_file_twice_is_analysed_once_and_flagged(tmp_path, arrays):
    (tmp_path / "a").mkdir()
    np.save(tmp_path / "a" / "w.npy", arrays["w"])
    proc, recs = compare_json("a/w.npy", "./a/w.npy", tmp_path / "a" / "w.npy", "--formats", "fp8_e4m3", cwd=tmp_path)
    assert proc.returncode == 2
    assert [r["tensor"] for r in recs] == ["w"]
    assert "given more than once" in proc.stderr and "analysed once" in proc.stderr
    assert "./a/w.npy" in proc.stderr


def _strict_loads(text):
    def refuse(name):
        raise AssertionError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


OVERFLOWING_FORMAT = """
import attrs, jax.numpy as jnp, numpy as np
import qformats as qf

INT8 = qf.IntElement("int8", bits=8, step=1.0, qmax=127)


@attrs.frozen
class Doubling(qf.ScaledFormat):
    \"\"\"A broken format: its scale_values are twice the scale, so y = 2 x (overflows near FLT_MAX).\"\"\"

    name: str = "test_doubling"

    @property
    def element(self):
        return INT8

    @property
    def layout(self):
        return qf.PerTensor()

    def quantize(self, x):
        x = jnp.asarray(x, jnp.float32)
        scale = jnp.max(jnp.abs(x)) / np.float32(127)
        return INT8.encode(x / scale), scale

    def decode(self, data):
        return INT8.decode(data)

    def scale_values(self, scale):
        return scale * np.float32(2)


qf.register_format(Doubling())
"""


def test_json_is_strict_when_the_round_trip_overflows(tmp_path):
    """A round trip that overflows to inf used to print "Infinity" (not JSON) in --json output; non-finite
    numbers are now strings, and such a format is not recommended."""
    (tmp_path / "overflowing_format.py").write_text(OVERFLOWING_FORMAT)
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    x[0, 0] = np.finfo(np.float32).max
    np.save(tmp_path / "big.npy", x)
    args = ("--repeats", "1", "big.npy", "--formats", "test_doubling,fp8_e4m3", "--import", "overflowing_format")
    # a subprocess: --import registers the format in the process that runs the command
    proc = run_subprocess("compare", "--json", *args, cwd=tmp_path)
    recs = _strict_loads(proc.stdout)
    json.dumps(recs, allow_nan=False)
    by = {r["format"]: r for r in recs}
    bad = by["test_doubling"]
    assert bad["max_rel_error"] == "inf" and bad["sqnr_db"] == "-inf" and not bad["exact"]
    assert float(bad["max_rel_error"]) == math.inf
    assert bad["overflow_fraction"] == pytest.approx(1 / x.size)
    assert not bad["recommended"] and "overflow" in bad["rejected_because"]
    assert by["fp8_e4m3"]["overflow_fraction"] == 0.0
    text = run_subprocess("compare", *args, cwd=tmp_path).stdout
    assert "test_doubling: not recommended: its round trip overflows" in text


def test_exact_sqnr_stays_null_and_inf_strings_parse(tmp_path):
    np.save(tmp_path / "e.npy", np.array([[1.0, -2.0, 0.5, 0.0] * 8], np.float32))
    proc = run("compare", "--json", "--repeats", "1", tmp_path / "e.npy", "--formats", "bf16")
    rec = _strict_loads(proc.stdout)[0]
    assert rec["exact"] and rec["sqnr_db"] is None and rec["rejected_because"] is None


def gradient_like(shape=(64, 256), seed=0):
    """Magnitudes log-uniform over 1e-12..1e-2 (ten decades), random signs."""
    rng = np.random.default_rng(seed)
    mag = np.exp(rng.uniform(np.log(1e-12), np.log(1e-2), size=shape))
    return (mag * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)


def test_format_that_flushes_most_values_is_not_recommended(tmp_path):
    """NVFP4 reaches 20 dB on a gradient-like tensor (the largest values dominate the SQNR) while
    flushing ~80% of the values to zero; it used to be recommended."""
    g = gradient_like()
    np.save(tmp_path / "g.npy", g)
    args = (tmp_path / "g.npy", "--formats", "nvfp4,fp8_e4m3,bf16", "--min-sqnr", "20")
    proc, recs = compare_json(*args)
    assert proc.returncode == 0, proc.stderr
    by = {r["format"]: r for r in recs}
    assert by["nvfp4"]["sqnr_db"] >= 20 and by["nvfp4"]["flushed_fraction"] > 0.5
    assert not by["nvfp4"]["recommended"] and not by["fp8_e4m3"]["recommended"]
    assert "flushes" in by["nvfp4"]["rejected_because"] and "--max-flushed" in by["nvfp4"]["rejected_because"]
    assert by["bf16"]["recommended"] and by["bf16"]["recommended_overall"]
    assert by["bf16"]["flushed_fraction"] == 0.0
    # the reported fraction is the independent count of nonzero inputs that come back as zero
    y = g.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert by["bf16"]["flushed_fraction"] == np.mean((g != 0) & (y == 0))
    text = run("compare", "--repeats", "1", *args).stdout
    assert "nvfp4: not recommended" in text and "flushes" in text
    # the threshold is a flag: allowing 100% restores the SQNR-only choice
    proc, recs = compare_json(*args, "--max-flushed", "100")
    assert [r["format"] for r in recs if r["recommended"]] == ["nvfp4"]


def test_saturation_threshold(tmp_path):
    x = np.full((4, 32), 1.0, np.float32)
    x[:, 0] = 500.0  # mxfp8 (floor scale 1) clips each 500 to 448: 1/32 of the elements saturate
    np.save(tmp_path / "s.npy", x)
    proc, recs = compare_json(tmp_path / "s.npy", "--formats", "mxfp8", "--min-sqnr", "10", "--max-saturated", "1")
    assert proc.returncode == 0, proc.stderr
    assert recs[0]["saturated_fraction"] == pytest.approx(1 / 32)
    assert not recs[0]["recommended"] and "saturates" in recs[0]["rejected_because"]
    _, recs = compare_json(tmp_path / "s.npy", "--formats", "mxfp8", "--min-sqnr", "10", "--max-saturated", "5")
    assert recs[0]["recommended"]


def test_cli_defaults_match_the_api():
    from qformats import _cli
    from qformats._cli import _engine

    assert _cli.DEFAULT_MAX_FLUSHED_PCT / 100 == _engine.DEFAULT_MAX_FLUSHED
    assert _cli.DEFAULT_MAX_SATURATED_PCT / 100 == _engine.DEFAULT_MAX_SATURATED
    args = _cli.build_parser().parse_args(["compare"])
    assert args.max_flushed / 100 == _engine.DEFAULT_MAX_FLUSHED
    for bad in ("150", "-1", "nan", "x"):
        with pytest.raises(SystemExit):
            _cli.build_parser().parse_args(["compare", "--max-flushed", bad])


def _npy_bytes(x, shape):
    """A .npy file of ``x``'s bytes whose header declares ``shape``."""
    import io

    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(x.dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + x.tobytes()


def test_npy_header_is_checked_before_numpy_allocates(tmp_path):
    """np.load allocates the array its header declares before reading: a corrupted .npz member declaring
    4e9 elements made it allocate 16 GB. Declared sizes are now checked against the file first."""
    import tracemalloc
    import zipfile

    from qformats._cli import _engine

    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:
        z.writestr("w.npy", _npy_bytes(x, (4000000000,)))
        z.writestr("ok.npy", _npy_bytes(x, (4, 4)))
    (tmp_path / "short.npy").write_bytes(_npy_bytes(x, (4, 9)))
    (tmp_path / "long.npy").write_bytes(_npy_bytes(x, (2, 4)))
    tracemalloc.start()
    try:
        paths = [tmp_path / "huge.npz", tmp_path / "short.npy", tmp_path / "long.npy"]
        tensors, problems = _engine.load_tensors(paths)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**26
    assert [t.name for t in tensors] == ["ok"]
    assert len(problems) == 3, problems
    assert "huge.npz:w: cannot read it" in problems[0] and "(4000000000,)" in problems[0]
    assert "short.npy: cannot read it" in problems[1] and "64 bytes after it" in problems[1]
    assert "long.npy" in problems[2]
    # a member that declares an impossible expansion
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("w.npy", _npy_bytes(x, (4, 4)))
    raw = bytearray((tmp_path / "bomb.npz").read_bytes())
    info = zipfile.ZipFile(tmp_path / "bomb.npz").infolist()[0]
    for pos in (raw.index(b"PK\x03\x04") + 22, raw.index(b"PK\x01\x02") + 24):  # uncompressed size fields
        raw[pos : pos + 4] = (info.compress_size * 5000).to_bytes(4, "little")
    (tmp_path / "bomb.npz").write_bytes(bytes(raw))
    tensors, problems = _engine.load_tensors([tmp_path / "bomb.npz"])
    assert tensors == [] and "cannot do" in problems[0]


def test_cli_parsing_imports_no_jax():
    # qformats/__init__ imports jax for the formats; the CLI module itself must not, so that it can
    # parse (and answer --help) before the engine loads. The package's __init__ is bypassed with a
    # bare package module, so only what qformats._cli imports is loaded.
    code = (
        "import importlib.util, sys, types\n"
        "spec = importlib.util.find_spec('qformats')\n"
        "pkg = types.ModuleType('qformats'); pkg.__path__ = list(spec.submodule_search_locations)\n"
        "sys.modules['qformats'] = pkg\n"
        "from qformats._cli import build_parser\n"
        "for argv in (['--help'], ['compare', '--help']):\n"
        "    try:\n"
        "        build_parser().parse_args(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'qformats._cli._engine'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
