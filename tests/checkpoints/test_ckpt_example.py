"""examples/serve_nvfp4_llama.py: NVFP4 weights as ScaledArrays under jit(scalify(forward))."""

import importlib.util
import os

import numpy as np

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "serve_nvfp4_llama.py")


def test_serve_nvfp4_llama(ckpt_root):
    spec = importlib.util.spec_from_file_location("serve_nvfp4_llama", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    logits, ref = mod.main([os.path.join(ckpt_root, "modelopt_nvfp4_hf_export_tinyllama")])
    assert np.isfinite(logits).all()
    # bfloat16 activations: the two paths round differently, within a few bfloat16 steps of the logits
    assert np.abs(logits - ref).max() <= 2**-5 * np.abs(ref).max()
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


def test_compare_cli_reads_checkpoint_folder(ckpt_root, capsys):
    from qformats._cli import main

    folder = os.path.join(ckpt_root, "w4a16_asym_bfloat16")
    code = main(["compare", folder, "--formats", "mxfp8", "--repeats", "1", "--json"])
    out = capsys.readouterr().out
    assert code in (0, None), out
    assert '"proj.weight"' in out and "mxfp8" in out
