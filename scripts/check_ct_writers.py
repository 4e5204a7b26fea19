"""Read our compressed-tensors writer's files back with compressed-tensors itself (issue #19, item 4).

Two phases, because compressed-tensors needs torch, which is not a dependency of this project:

    python scripts/check_ct_writers.py write OUT          # this project's env: write with qformats
    CT_PY scripts/check_ct_writers.py check OUT           # a venv with torch (CPU) and compressed-tensors

``write`` quantizes one weight per compressed-tensors format of the registry (``ct_*``), writes each as its own
checkpoint folder with ``qformats.write_compressed_tensors`` and stores our dequantized values (float32
and their bf16 bits) in ``OUT/<format>/ours.npz``. ``check`` loads each folder's ``config.json``, builds
the config group's ``QuantizationScheme``, decompresses the ``model.safetensors`` tensors with
compressed-tensors' own compressor for that format (``BaseCompressor.get_value_from_registry(...)
.decompress``) and compares with our values bit for bit (+0.0 and -0.0 equal). It prints one line per
format and exits 1 on any difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def write(out: Path) -> None:
    import jax.numpy as jnp
    import ml_dtypes

    import qformats as qf

    # every compressed-tensors layout format the registry holds (registered unlisted, as ct_*)
    for i, name in enumerate(n for n in qf.list_formats(unlisted=True) if n.startswith("ct_")):
        fmt = qf.get_format(name)
        shape = (300, 576) if name == "ct_fp8_block128" else (128, 512)
        rng = np.random.default_rng(100 + i)
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        w[0, :64] = 0  # a zero group
        w[2, 5] = 3.0  # an outlier
        w = w.astype(ml_dtypes.bfloat16)
        t = qf.QuantizedTensor(fmt, *fmt.quantize(jnp.asarray(w)))
        folder = out / name
        qf.write_compressed_tensors(folder, {"proj.weight": t}, config={"architectures": ["OneLinear"]})
        ours = np.asarray(t.dequantize(), np.float32)
        np.savez(folder / "ours.npz", values=ours, bf16_bits=ours.astype(ml_dtypes.bfloat16).view(np.uint16))
        print(f"wrote {folder}")


def check(out: Path) -> int:
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    failures = 0
    for folder in sorted(p for p in out.iterdir() if (p / "ours.npz").exists()):
        name = folder.name
        cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        (group,) = cfg["config_groups"].values()
        scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"}, format=group["format"])
        tensors = {k.split("proj.", 1)[1]: v for k, v in load_file(str(folder / "model.safetensors")).items()}
        compressor = BaseCompressor.get_value_from_registry(group["format"])
        theirs = compressor.decompress(dict(tensors), scheme)["weight"].to(torch.float32).numpy()
        ours = np.load(folder / "ours.npz")["values"]
        same = theirs.shape == ours.shape and bool(np.all((theirs == ours) | ((theirs == 0) & (ours == 0))))
        diff = float(np.max(np.abs(theirs - ours))) if theirs.shape == ours.shape else float("nan")
        print(f"{name:20s} {group['format']:24s} {'bit-exact' if same else 'DIFFERS'}  max|diff| {diff:.3g}")
        failures += not same
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        raise SystemExit(__doc__)
    target = Path(sys.argv[2])
    if sys.argv[1] == "write":
        write(target)
    else:
        raise SystemExit(check(target))
