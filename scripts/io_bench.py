"""Time ``scalify.io.save`` / ``load`` of a ~256 MB MXFP8 pytree against plain file I/O of the same bytes.

    python scripts/io_bench.py                  # 16 weights of 4096 x 4096 (256 MiB data + 8 MiB scales)
    python scripts/io_bench.py --layers 2       # smaller

(With ``PYTHONPATH=$PWD`` where another checkout is installed in editable mode: a script's folder,
not the current one, starts ``sys.path``.)

The tree is built from random bytes (data as float8_e4m3fn, E8M0 scales), so no quantization time is
included. Baselines, in the same process with the page cache warm (every figure is the best of
``--repeats``): ``np.fromfile`` of the whole file (the floor of ``load``) and ``ndarray.tofile`` of
a buffer of the file's size (the floor of ``save``). Peak memory of ``load`` is measured in a fresh
subprocess as the growth of the peak resident set size (Linux), in multiples of the file size and as
the file (the result) plus a multiple of the largest tensor (#19 asks for at most 1.3).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import qformats as qf
import scalify


def make_tree(layers: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tree = {}
    for i in range(layers):
        data = rng.integers(0, 0x7E, size=(n, n), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        scale = rng.integers(120, 135, size=(n, n // 32), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
        tree[f"layer{i}"] = {
            "w": scalify.ScaledArray(jnp.asarray(data), jnp.asarray(scale), fmt=qf.MXFP8, dtype=jnp.float32),
            "b": jnp.zeros((n,), jnp.float32),
        }
    return tree


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out) if out is not None else None
        times.append(time.perf_counter() - t)
        del out
    return min(times)


def peak_rss_growth(path, warm) -> float:
    """Peak RSS growth (bytes) while a fresh process (scalify imported) loads ``path``.

    Linux only. The process first loads the small file ``warm`` of the same kind, so that JAX's CPU
    client, lazy imports and traces are not counted; then it resets the peak
    (``/proc/self/clear_refs``) and reads ``VmHWM`` after the load.
    """
    code = (
        "import re, scalify, jax\n"
        "def status(key):\n"
        "    return int(re.search(key + r':\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) * 1024\n"
        f"jax.block_until_ready(scalify.io.load({str(warm)!r}))\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = status('VmRSS')\n"
        f"t = scalify.io.load({str(path)!r}); jax.block_until_ready(t)\n"
        "print(status('VmHWM') - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="folder for the file (default: a temporary folder)")
    args = ap.parse_args(argv)

    tree = make_tree(args.layers, args.n)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "tree.safetensors")
        save_t = best(lambda: scalify.io.save(path, tree), args.repeats)
        size = os.path.getsize(path)
        buf = np.ones(size, np.uint8)
        raw = os.path.join(d, "raw.bin")
        tofile_t = best(lambda: buf.tofile(raw), args.repeats)
        fromfile_t = best(lambda: np.fromfile(path, np.uint8), args.repeats)
        load_t = best(lambda: scalify.io.load(path), args.repeats)
        back = scalify.io.load(path)
        assert all(
            np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True)
        )
        warm = os.path.join(d, "warm.safetensors")
        scalify.io.save(warm, make_tree(1, 256))
        peak = peak_rss_growth(path, warm)
        largest = max(leaf.nbytes for leaf in jax.tree.leaves(tree))
    mb = size / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"file: {mb:.1f} MiB ({args.layers} x MXFP8 {args.n}x{args.n} + float32 biases)")
    print(f"save: {save_t:.3f} s ({mb / save_t:.0f} MiB/s); ndarray.tofile: {tofile_t:.3f} s")
    print(f"  save / tofile = {save_t / tofile_t:.2f}")
    print(f"load: {load_t:.3f} s ({mb / load_t:.0f} MiB/s); np.fromfile: {fromfile_t:.3f} s")
    print(f"  load / fromfile = {load_t / fromfile_t:.2f}")
    print(
        f"load peak RSS growth: {peak / 2**20:.0f} MiB = {peak / size:.3f} x the file "
        f"= file + {(peak - size) / largest:.2f} x the largest tensor ({largest / 2**20:.0f} MiB)"
    )
    print(f"cpu: {os.cpu_count()} cores; max RSS of this process {rss} MiB")


if __name__ == "__main__":
    main()
