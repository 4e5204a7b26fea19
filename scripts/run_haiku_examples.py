"""Run Haiku's own example training steps, unchanged, under ``scalify`` with parameters in each format.

    python scripts/run_haiku_examples.py                      # pip download dm-haiku's sdist (installed version)
    python scripts/run_haiku_examples.py --source DIR         # an unpacked dm-haiku sdist or a git clone
    python scripts/run_haiku_examples.py --only rnn --formats all --markdown
    python scripts/run_haiku_examples.py --only imagenet --resnet-blocks 1,1,1,1  # a 4-block ResNet (default 3,4,6,3)

The programs are the ``update`` functions of Haiku's ``examples/`` (``transformer``: a decoder-only
Transformer LM with dropout, gradient clipping and Adam; ``rnn``: a character LM of two ``hk.LSTM``
layers unrolled with ``hk.dynamic_unroll``), read from dm-haiku's sdist of the installed version (or
``--source DIR``); nothing of them is copied into this repository. Each example's ``train.py`` is
imported as it is; its module decorates ``update`` with ``@jax.jit``, and the script calls
``jax.jit(scalify.scalify(update.__wrapped__))`` where the example calls ``update``.

What the script supplies, as ``run_flax_examples.py`` does (see its docstring for why): inert
stand-ins for ``tensorflow`` and ``tensorflow_datasets`` (the data pipelines; no update calls them),
small sizes through the examples' own module constants and absl flags (2 layers, width 64-128),
synthetic batches in the examples' batch types, and the examples' optimisers with Adam's ``eps``
raised to 1e-2 and its rate to 1e-2 (``optimiser`` / ``make_optimizer`` replaced on the module:
``update`` looks them up when traced).

The check is the flax script's: parameters whose shape the format accepts are quantized, the
reference is the same ``update`` in float32 on the dequantized parameters (the optimiser state
initialised on those), and every leaf of the returned state and metrics must agree within the
third-party harness's tolerance.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_scalify_source import fetch_sdist  # noqa: E402
from run_flax_examples import failure, install_stand_ins, parse_cli, pop_option, summary  # noqa: E402
from thirdparty_harness import assert_tree_close, dequantize_tree, n_scaled, quantize_tree  # noqa: E402

import scalify  # noqa: E402

STAND_INS = ("tensorflow", "tensorflow_datasets")


def _adam():
    """Adam as the third-party harness runs it (``eps=1e-2``: the first step is Lipschitz in the gradient)."""
    return optax.adam(1e-2, eps=1e-2)


def _load(root: Path, name: str):
    """Import ``examples.<name>.train`` from the sdist at ``root`` (the examples import each other
    as ``examples.<name>.<module>``)."""
    from absl import flags

    for module, defined in list(flags.FLAGS.flags_by_module_dict().items()):
        if module.startswith("examples."):  # absl flags are process-wide; examples reuse names
            for flag in list(defined):  # delattr removes it from ``defined``
                delattr(flags.FLAGS, flag.name)
    for m in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        sys.modules.pop(m)
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"examples.{name}.train")
    finally:
        sys.path.pop(0)


def _tokens(seed, shape, low, high):
    return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape), jnp.int32)


def _set_flags(flags, **values):
    """Set absl flags as the command line would. Flags are process-wide and the transformer example
    defines a required ``--dataset_path``, so they are marked parsed rather than parsed from argv."""
    if not flags.is_parsed():
        flags.mark_as_parsed()
    for name, value in values.items():
        setattr(flags, name, value)


def _jitted(batch):
    """How the examples' main calls ``update``: ``@jax.jit``, on the state and one batch."""
    return lambda step, state: jax.jit(step)(state, batch)


def transformer(root):
    """Decoder-only Transformer LM: dropout keyed by the state's rng, ``clip_by_global_norm`` + Adam."""
    train = _load(root, "transformer")
    train.NUM_LAYERS, train.NUM_HEADS, train.MODEL_SIZE = 2, 4, 128  # the example's module constants
    train.optimiser = lambda: optax.chain(optax.clip_by_global_norm(train.GRAD_CLIP_VALUE), _adam())
    tokens = np.array(_tokens(0, (4, 33), 1, train.dataset.VOCAB_SIZE))
    tokens[1, 20:] = train.dataset.PAD_TOKEN  # a padded sequence: the loss masks it
    batch = train.dataset.Batch(inputs=jnp.asarray(tokens[:, :-1]), targets=jnp.asarray(tokens[:, 1:]))
    state = train.init(jax.random.key(0), batch)
    return state, _jitted(batch), train.update.__wrapped__, lambda params: train.optimiser().init(params)


def rnn(root):
    """Two ``hk.LSTM`` layers and an MLP under ``hk.DeepRNN``, unrolled with ``hk.dynamic_unroll``."""
    train = _load(root, "rnn")
    _set_flags(train.flags.FLAGS, hidden_size=64)  # absl flags hold the sizes
    train.make_optimizer = _adam
    batch = {"input": _tokens(0, (16, 8), 0, train.dataset.NUM_CHARS), "target": _tokens(1, (16, 8), 0, 128)}
    init = train.hk.without_apply_rng(train.hk.transform(train.sequence_loss)).init
    params = init(jax.random.key(0), batch)
    state = train.TrainingState(params=params, opt_state=_adam().init(params))
    return state, _jitted(batch), train.update.__wrapped__, lambda params: _adam().init(params)


def _tree_stand_in():
    """dm-tree's ``flatten_with_path`` (imagenet's weight decay picks parameters by module name),
    written with ``jax.tree_util`` when dm-tree is not installed: paths of dict keys, leaves in order."""
    if importlib.util.find_spec("tree") is not None:
        return
    module = types.ModuleType("tree")
    module.flatten_with_path = lambda t: [
        (tuple(k.key for k in path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(t)[0]
    ]
    sys.modules["tree"] = module


def imagenet(root, policy="p=f32,c=f32,o=f32", blocks=(3, 4, 6, 3)):
    """ResNet-50 v2 with BatchNorm state, jmp's dynamic loss scale (skip non-finite steps), SGD with
    Nesterov momentum and a cosine schedule, under ``pmap`` with ``lax.pmean``; ``blocks``: bottleneck
    blocks per group (ResNet-50's by default)."""
    _tree_stand_in()
    train = _load(root, "imagenet")
    # ResNet-50's 25M parameters take minutes to compile here (2m41s scalified): the same
    # hk.nets.ResNet (v2, bottleneck blocks, projections, ResNet-50's 3-4-6-3 blocks), 4-32x narrower.
    hk = train.hk
    train.hk = types.SimpleNamespace(**vars(hk))
    train.hk.nets = types.SimpleNamespace(
        ResNet50=lambda num_classes, **kw: hk.nets.ResNet(
            num_classes=num_classes,
            blocks_per_group=tuple(blocks),
            channels_per_group=(64, 64, 64, 64),
            use_projection=(True,) * 4,
            bottleneck=True,
            **kw,
        )
    )
    _set_flags(
        train.FLAGS, mp_policy=policy, mp_scale_type="Dynamic", mp_skip_nonfinite=True, train_device_batch_size=2
    )
    rng = np.random.default_rng(0)
    batch = {
        "images": jnp.asarray(rng.standard_normal((2, 32, 32, 3)), jnp.float32),
        "labels": _tokens(1, (2,), 0, 1000),
    }
    state = train.initial_state(jax.random.key(0), batch)

    def run(step, state):  # as the example's main: pmap over devices (one here), axis "i"
        replicate = lambda tree: jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
        out = jax.pmap(step, axis_name="i")(replicate(state), replicate(batch))
        return jax.tree.map(lambda x: x[0], out)

    return state, run, train.train_step.__wrapped__, lambda params: train.make_optimizer().init(params)


EXAMPLES = {"transformer": transformer, "rnn": rnn, "imagenet": imagenet}


def check(state, run, update, init_opt, fmt) -> tuple[str, str]:
    """(outcome, detail) of the example's ``update`` on ``fmt`` parameters against float32."""
    qparams = quantize_tree(state.params, fmt)
    if n_scaled(qparams) == 0:
        return "n/a", f"no parameter has a shape that {fmt.name} accepts"
    dparams = dequantize_tree(qparams)
    opt_state = init_opt(dparams)  # on float32: docs/examples.md says why not on MX parameters
    try:
        expected = run(update, state._replace(params=dparams, opt_state=opt_state))
        got = run(scalify.scalify(update), state._replace(params=qparams, opt_state=opt_state))
        assert_tree_close(got, expected, fmt, "state and metrics")
    except Exception as exc:  # reported per example and format (traceback on stderr), not raised
        return failure(exc)
    return "ok", f"{n_scaled(qparams)} parameters scaled"


def _blocks_arg(argv):
    """``(ResNet blocks per group or None, the other arguments)``: ``--resnet-blocks a,b,c,d``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    what = "four positive counts, e.g. 1,1,1,1 (ResNet-50: 3,4,6,3)"
    value = pop_option(argv, "--resnet-blocks", what)
    if value is None:
        return None, argv
    try:
        blocks = tuple(int(b) for b in value.split(","))
    except ValueError:
        blocks = ()
    if len(blocks) != 4 or min(blocks) < 1:
        raise SystemExit(f"--resnet-blocks needs {what}")
    return blocks, argv


def main(argv=None) -> int:
    blocks, argv = _blocks_arg(argv)
    examples = EXAMPLES if blocks is None else {**EXAMPLES, "imagenet": functools.partial(imagenet, blocks=blocks)}
    args, names, formats = parse_cli(__doc__, examples, "dm-haiku", argv)
    stand_ins = install_stand_ins(STAND_INS)
    version = importlib.metadata.version("dm-haiku")
    with tempfile.TemporaryDirectory(prefix="haiku_examples_") as tmp:
        root = (
            args.source.resolve()
            if args.source
            else fetch_sdist(Path(tmp), version, "dm-haiku", "https://github.com/google-deepmind/dm-haiku")
        )
        if not (root / "examples").is_dir():
            raise SystemExit(f"{root} has no examples/ directory; pass the root of a dm-haiku sdist or checkout.")
        print(f"dm-haiku {version} examples from {root.name}; stand-ins for {stand_ins or 'none'}")
        rows = []
        for name in names:
            built = examples[name](root)
            for fmt in formats:
                outcome, detail = check(*built, fmt)
                rows.append((name, fmt.name, outcome, detail))
                print(f"{name:12s} {fmt.name:18s} {outcome:5s} {detail}", flush=True)
    return summary(rows, names, formats, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
