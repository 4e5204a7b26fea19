"""Peak memory of loading (#19 item 6): tensor by tensor, at most the result plus 1.3x the largest tensor.

Each load runs in a fresh subprocess, which first loads a small file of the same kind (so JAX's CPU
client, lazy imports and traces are not counted), then resets its peak resident set
(``/proc/self/clear_refs``, Linux) and reports the growth of ``VmHWM`` over the load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import qformats as qf
import scalify

MIB = 2**20
N_TENSORS, TENSOR_BYTES = 8, 8 * MIB
# Beyond the result and the largest tensor: the header and the tree description, the Python and JAX
# objects of the leaves, GGUF's 1 MiB read chunk, and the C heap growing in steps. Measured at 0.35
# (safetensors) to 1.0 MiB (GGUF) over the result with these files; the code before streaming went
# 24 MiB (safetensors), 16 MiB (GGUF, read_checkpoint) and 119 MiB (GGUF, scalify.io.load) over it,
# against 10.4 MiB for 1.3x the largest tensor.
ALLOWANCE = 4 * MIB
ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, re, sys
sys.path.insert(0, {root!r})
import jax, qformats, scalify

def status(key):
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\\s+(\\d+) kB", f.read()).group(1)) * 1024

def load(path):
    if {how!r} == "read_checkpoint":
        return qformats.read_checkpoint(path)
    return jax.block_until_ready(scalify.io.load(path))

load({warm!r})
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
out = load({path!r})
print(json.dumps(status("VmHWM") - before))
"""


def _peak_growth(path, warm, how: str) -> int:
    """Bytes by which the peak resident set of a fresh process grows while it loads ``path``."""
    code = textwrap.dedent(_CHILD).format(root=str(ROOT), path=str(path), warm=str(warm), how=how)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _save_safetensors(path, n: int, nbytes: int) -> None:
    """``n`` MXFP8 weights of ``nbytes`` of fp8 data each (and their E8M0 scales), via scalify.io.save."""
    rng = np.random.default_rng(0)
    cols = 1024
    tree = {}
    for i in range(n):
        data = rng.integers(0, 0x7E, (nbytes // cols, cols), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        scale = np.full((nbytes // cols, cols // 32), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)
        tree[f"w{i}"] = scalify.ScaledArray(data, scale, fmt=qf.MXFP8, dtype=np.float32)
    scalify.io.save(path, tree)


def _save_gguf(path, n: int, nbytes: int) -> None:
    """``n`` Q8_0 weights of ``nbytes`` of int8 codes each."""
    rng = np.random.default_rng(0)
    cols = 1024
    fmt = qf.get_format("gguf_q8_0")
    tensors = {
        f"blk.{i}.w.weight": qf.QuantizedTensor(
            fmt,
            rng.integers(-127, 128, (nbytes // cols, cols), dtype=np.int8),
            np.full((nbytes // cols, cols // 32), 0.01, np.float16),
        )
        for i in range(n)
    }
    qf.write_gguf(path, tensors)


def _largest_tensor(path) -> int:
    """Bytes of the largest tensor as loaded (data and scales are separate arrays)."""
    out = qf.read_checkpoint(path) if str(path).endswith(".gguf") else None
    if out is None:
        from qformats import _safetensors

        return max(a.nbytes for _, a in _safetensors.iter_tensors(path))
    return max(max(q.data.nbytes, q.scale.nbytes) for q in out.values())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
@pytest.mark.parametrize(
    "kind, how",
    [("safetensors", "scalify.io.load"), ("gguf", "read_checkpoint"), ("gguf", "scalify.io.load")],
)
def test_load_peak_memory_is_result_plus_largest_tensor(tmp_path, kind, how):
    """The peak grows by at most the result + 1.3x the largest tensor + ALLOWANCE."""
    suffix = ".safetensors" if kind == "safetensors" else ".gguf"
    if kind == "gguf":
        pytest.importorskip("gguf")  # to write the file
    save = _save_safetensors if kind == "safetensors" else _save_gguf
    path, warm = tmp_path / f"big{suffix}", tmp_path / f"small{suffix}"
    save(path, N_TENSORS, TENSOR_BYTES)
    save(warm, 1, 32 * 1024)
    result = path.stat().st_size  # the file holds the result's bytes (and a small header)
    bound = result + 1.3 * _largest_tensor(path) + ALLOWANCE
    growth = _peak_growth(path, warm, how)
    assert growth <= bound, (
        f"{how} of a {result / MIB:.1f} MiB {kind} file: peak grew by {growth / MIB:.1f} MiB, more than the "
        f"bound {bound / MIB:.1f} MiB (result + 1.3x the largest tensor + {ALLOWANCE / MIB:.0f} MiB)"
    )


def test_read_arrays_are_aligned_for_jax_to_adopt(tmp_path):
    """Tensors are read into 64-byte-aligned arrays, which jax.device_put on CPU adopts without a copy
    (the reason scalify.io.load holds no second copy of a tensor)."""
    import jax

    from qformats import _safetensors

    path = tmp_path / "a.safetensors"
    _safetensors.write(path, {"a": np.arange(1000, dtype=np.float32), "b": np.arange(7, dtype=np.uint8)})
    for name, arr in _safetensors.iter_tensors(path):
        assert arr.ctypes.data % _safetensors.ALIGNMENT == 0, name
        assert np.array_equal(arr, _safetensors.read_tensor(path, name))
        if jax.default_backend() == "cpu":
            assert jax.device_put(arr).unsafe_buffer_pointer() == arr.ctypes.data, name
