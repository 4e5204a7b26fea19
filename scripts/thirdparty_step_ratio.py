"""Step-time ratio of third-party models: jit(scalify(step)) / jit(step) in float32, per model and format.

A step is ``value_and_grad(loss)`` plus one Adam update, the program the third-party test suite
(tests/thirdparty) checks for correctness; this script times it at a realistic width. For each
(model, format): the scalified step runs on the model's parameters quantized into the format (rank >= 2
leaves the layout accepts), the float32 step on the same parameters dequantized. Both are compiled
first (compile time is reported separately), then timed in interleaved runs in one process (the
order of the two alternating from one repeat to the next). Three ratios: median(scalified) /
median(float32); the median over repeats of the ratio of a repeat's two runs (paired: a slow spell
of the machine hits both runs of a repeat, so it cancels); and the ratio of the fastest runs. With
``--steady`` the optimizer state is the one after a first scalified step (non-zero, settled
moments, as from the second step of training on; the float32 step gets its values) instead
of ``opt.init``'s zeros. Prints a markdown table.

    python scripts/thirdparty_step_ratio.py --models gemma keras_gpt2 --formats mxfp8 fp8_e4m3 --d-model 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "thirdparty"))

import jax  # noqa: E402

import qformats as qf  # noqa: E402
import scalify  # noqa: E402

# module of tests/thirdparty -> the models it builds
MODULES = ("test_gemma", "test_flax", "test_equinox", "test_keras", "test_haiku")


def available_models():
    import importlib

    models = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except BaseException as exc:  # pytest.importorskip raises a BaseException when a library is missing
            print(f"# {name}: not available ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        models.update(module.CASES)
    return models


def _block(tree):
    return jax.block_until_ready(jax.tree.leaves(tree, is_leaf=scalify.is_scaled_leaf))


def _values(tree):
    """The tree's values: each ScaledArray as the array it stands for."""
    as_value = lambda x: x.to_array() if isinstance(x, scalify.ScaledArray) else x
    return jax.tree.map(as_value, tree, is_leaf=scalify.is_scaled_leaf)


def time_model(build, fmt_names, d_model, batch, seq, repeats, steady=False):
    from thirdparty_harness import Case  # noqa: F401  (the harness the tests use)

    case = build(d_model=d_model, batch=batch, seq=seq)
    opt, step = case.step_fn()
    rows = []
    f32_step = None
    for fmt_name in fmt_names:
        fmt, qparams, dparams = case.quantized_or_none(fmt_name)
        if fmt is None:
            rows.append((case.name, fmt_name, None, None, None, None, None, None, "no parameter fits the layout"))
            continue
        state = opt.init(dparams)
        if steady:
            state = jax.jit(scalify.scalify(step))(qparams, state, case.batch)[3]
        fstate = _values(state)
        if f32_step is None:  # the state has the same float32 leaves for every format
            t0 = time.perf_counter()
            f32_step = jax.jit(step).lower(dparams, fstate, case.batch).compile()
            f32_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        s_step = jax.jit(scalify.scalify(step)).lower(qparams, state, case.batch).compile()
        s_compile = time.perf_counter() - t0
        _block(f32_step(dparams, fstate, case.batch))
        _block(s_step(qparams, state, case.batch))
        runs = {"f32": (f32_step, (dparams, fstate, case.batch)), "scalified": (s_step, (qparams, state, case.batch))}
        times = {name: [] for name in runs}
        for i in range(repeats):  # interleaved, in alternating order, so load changes hit both alike
            for name in list(runs)[:: 1 if i % 2 == 0 else -1]:
                fn, args = runs[name]
                t0 = time.perf_counter()
                _block(fn(*args))
                times[name].append(time.perf_counter() - t0)
        t_f32, t_s = times["f32"], times["scalified"]
        m_f32, m_s = statistics.median(t_f32), statistics.median(t_s)
        paired = statistics.median(s / f for s, f in zip(t_s, t_f32, strict=True))
        fastest = min(t_s) / min(t_f32)
        rows.append((case.name, fmt_name, m_f32, m_s, paired, fastest, f32_compile, s_compile, ""))
        print(f"# {case.name} {fmt_name}: f32 {m_f32 * 1e3:.2f} ms, scalified {m_s * 1e3:.2f} ms", file=sys.stderr)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="default: every model of tests/thirdparty")
    parser.add_argument("--formats", nargs="*", help="default: every registered format")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steady", action="store_true", help="optimizer state after one step, not zeros")
    args = parser.parse_args(argv)

    import thirdparty_harness as harness

    def quantized_or_none(self, fmt_name):
        fmt = qf.get_format(fmt_name)
        qparams = harness.quantize_tree(self.params, fmt)
        if harness.n_scaled(qparams) == 0:
            return None, None, None
        return fmt, qparams, harness.dequantize_tree(qparams)

    harness.Case.quantized_or_none = quantized_or_none

    models = available_models()
    names = args.models or list(models)
    fmt_names = args.formats or list(qf.list_formats())
    rows = []
    with jax.numpy_dtype_promotion("standard"):
        for name in names:
            rows += time_model(models[name], fmt_names, args.d_model, args.batch, args.seq, args.repeats, args.steady)

    print(
        f"d_model={args.d_model}, batch={args.batch}, seq={args.seq}, median of {args.repeats} interleaved runs, "
        f"optimizer state {'after one step' if args.steady else 'zeros'}, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}\n"
    )
    print(
        "| model | format | float32 step (ms) | scalified step (ms) | ratio of medians | paired ratio |"
        " ratio of fastest runs | compile f32 / scalified (s) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model, fmt_name, m_f32, m_s, paired, fastest, c_f32, c_s, note in rows:
        if m_f32 is None:
            print(f"| {model} | {fmt_name} | | | | | | {note} |")
        else:
            print(
                f"| {model} | {fmt_name} | {m_f32 * 1e3:.1f} | {m_s * 1e3:.1f} | {m_s / m_f32:.2f}x | {paired:.2f}x | "
                f"{fastest:.2f}x | {c_f32:.1f} / {c_s:.1f} |"
            )


if __name__ == "__main__":
    main()
