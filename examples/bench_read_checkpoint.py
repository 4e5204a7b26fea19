"""Load time and peak memory of ``qformats.read_checkpoint`` on synthetic ~1 GiB checkpoints.

For each layout a file of about ``--mib`` MiB of random codes and scales (valid layouts, meaningless
values) is written, then, each in a fresh process with the page cache warm (best of ``--repeats``):

* ``np.fromfile`` of the whole file (the baseline: one read of the same bytes);
* ``read_checkpoint(path)`` (every tensor copied into memory, still quantized);
* ``read_checkpoint(path, mmap=True)`` (safetensors tensors as memory maps; GGUF copies anyway).

Run it with the checkout first on the path (``PYTHONPATH=$PWD``) where another checkout of the
project is installed in editable mode: a script's own folder, not the current one, starts
``sys.path``, and the measuring subprocesses inherit the environment.

Peak memory is the growth of the process's peak resident set (``VmHWM`` after a reset, Linux) over
the reads, against the file size and the largest tensor; memory-mapped pages that were touched count
as resident. Usage: ``python examples/bench_read_checkpoint.py [--mib 1024]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np


def _rand(rng, shape, dtype=np.uint8):
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(0, 256, size=size, dtype=np.uint8).view(dtype).reshape(shape)


def make(layout: str, folder: str, mib: int) -> int:
    """Write the synthetic checkpoint; return its largest tensor's size in bytes."""
    import qformats as qf
    from qformats import _safetensors

    rng = np.random.default_rng(0)
    n, k = 8192, 16384  # one weight per module, W[N, K]
    per = {
        "ct_nvfp4": n * k // 2 + n * k // 16,
        "modelopt_nvfp4": n * k // 2 + n * k // 16,
        "ct_mxfp4": n * k // 2 + n * k // 32,
        "gptoss_mxfp4": n * k // 2 + n * k // 32,
        "ct_fp8_block128": n * k + 2 * (n // 128) * (k // 128),
        "ct_int4_g128_asym": n * k // 2 + 2 * n * k // 128 + 4 * (n // 8) * (k // 128),
        "gguf_q8_0": n * k + 2 * n * k // 32,
        "gguf_q4_0": n * k // 2 + 2 * n * k // 32,
    }[layout]
    count = max(1, mib * 2**20 // per)
    e4m3 = np.linspace(0.01, 400, 256, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    tensors: dict = {}
    largest = 0
    for i in range(count):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        if layout in ("ct_nvfp4", "modelopt_nvfp4"):
            block = e4m3[_rand(rng, (n, k // 16))]
            if layout == "ct_nvfp4":
                tensors[name] = qf.QuantizedTensor(
                    qf.get_format(layout), _rand(rng, (n, k // 2)), qf.NVFP4Scale(block, np.float32(900.0))
                )
            else:
                tensors[name] = _rand(rng, (n, k // 2))
                tensors[name + "_scale"] = block
                tensors[name + "_scale_2"] = np.array(1e-3, np.float32)
            largest = max(largest, n * k // 2)
        elif layout in ("ct_mxfp4", "gptoss_mxfp4"):
            scale = (rng.integers(100, 140, (n, k // 32))).astype(np.uint8)
            if layout == "ct_mxfp4":
                tensors[name] = qf.QuantizedTensor(qf.get_format(layout), _rand(rng, (n, k // 2)), scale)
            else:
                base = f"model.layers.{i}.mlp.experts.down_proj"
                tensors[base + "_blocks"] = _rand(rng, (1, n, k // 32, 16))
                tensors[base + "_scales"] = scale[None]
            largest = max(largest, n * k // 2)
        elif layout == "ct_fp8_block128":
            data = _rand(rng, (n, k)) & 0x7E  # no NaN codes
            scale = np.full((n // 128, k // 128), 0.01, ml_dtypes.bfloat16)
            tensors[name] = qf.QuantizedTensor(qf.get_format(layout), data.view(ml_dtypes.float8_e4m3fn), scale)
            largest = max(largest, n * k)
        elif layout == "ct_int4_g128_asym":
            words = _rand(rng, (n, k // 8), np.int32)
            scale = np.full((n, k // 128), 0.01, ml_dtypes.bfloat16)
            zp = _rand(rng, (n // 8, k // 128), np.int32)
            from qformats._fmt_int4 import Int4Scale

            tensors[name] = qf.QuantizedTensor(qf.get_format(layout), words, Int4Scale(scale, zp))
            largest = max(largest, n * k // 2)
        else:  # gguf_q8_0, gguf_q4_0: int8 codes, or two 4-bit codes a byte
            codes = _rand(rng, (n, k), np.int8) if layout == "gguf_q8_0" else _rand(rng, (n, k // 2))
            d = np.full((n, k // 32), 0.01, np.float16)
            tensors[f"blk.{i}.ffn_down.weight"] = qf.QuantizedTensor(qf.get_format(layout), codes, d)
            largest = max(largest, codes.nbytes)
    if layout.startswith("gguf"):
        qf.write_gguf(os.path.join(folder, "model.gguf"), tensors)
    elif layout == "modelopt_nvfp4":
        _safetensors.write(os.path.join(folder, "model.safetensors"), tensors)
        with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
            json.dump({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}, f)
    elif layout == "gptoss_mxfp4":
        _safetensors.write(os.path.join(folder, "model.safetensors"), tensors)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"quantization_config": {"quant_method": "mxfp4"}}, f)
    else:
        qf.write_compressed_tensors(folder, tensors)
    return largest


def _status(field):
    """A ``/proc/self/status`` memory figure in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak():
    """Reset the peak resident set (``VmHWM``) to the current one (Linux >= 4.0); else keep it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _touch(out) -> None:
    """Touch every page of the tensors' data once, so that memory-mapped bytes are really read.

    A function of its own: its loop variables would otherwise keep the last tensor of one repeat
    alive through the next one (and count in its peak).
    """
    import qformats as qf

    for v in out.values():
        a = np.asarray(v.data if isinstance(v, qf.QuantizedTensor) else v)
        a.reshape(-1)[:: 4096 // max(1, a.itemsize)].sum()


def measure(kind: str, path: str, repeats: int) -> dict:
    """Run in a fresh process: best time of ``repeats`` and the peak-RSS growth of one read."""
    import qformats as qf

    file = path if path.endswith(".gguf") else os.path.join(path, "model.safetensors")
    # the file was just written (or read by the fromfile run): the page cache is warm
    _reset_peak()
    base = _status("VmRSS")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if kind == "fromfile":
            out = np.fromfile(file, np.uint8)
        else:
            out = qf.read_checkpoint(path, mmap=kind == "mmap")
            if kind == "mmap":
                _touch(out)
        times.append(time.perf_counter() - t0)
        del out
    return {"time": min(times), "peak_growth": max(0, _status("VmHWM") - base), "file": os.path.getsize(file)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--layouts",
        default="ct_nvfp4,modelopt_nvfp4,ct_mxfp4,gptoss_mxfp4,ct_fp8_block128,ct_int4_g128_asym,gguf_q8_0,gguf_q4_0",
    )
    ap.add_argument("--measure", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure, args.repeats)))
        return
    rows = []
    for layout in args.layouts.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            largest = make(layout, tmp, args.mib)
            path = os.path.join(tmp, "model.gguf") if layout.startswith("gguf") else tmp
            res = {}
            for kind in ("fromfile", "copy", "mmap"):
                cmd = [sys.executable, __file__, "--measure", kind, path, "--repeats", str(args.repeats)]
                res[kind] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            size = res["fromfile"]["file"]
            rows.append((layout, size, largest, res))
            base = res["fromfile"]["time"]
            print(
                f"{layout:18s} {size / 2**20:7.0f} MiB  fromfile {base:.3f} s  "
                f"read {res['copy']['time']:.3f} s (x{res['copy']['time'] / base:.2f})  "
                f"mmap {res['mmap']['time']:.3f} s (x{res['mmap']['time'] / base:.2f})  "
                f"peak +{res['copy']['peak_growth'] / size:.2f} file "
                f"(= file + {(res['copy']['peak_growth'] - size) / largest:.2f} largest tensor) "
                f"(fromfile +{res['fromfile']['peak_growth'] / size:.2f}, "
                f"mmap +{res['mmap']['peak_growth'] / size:.2f}), "
                f"largest tensor {largest / 2**20:.0f} MiB",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
