"""PureJaxRL's PPO, trained end to end by its own ``make_train``, under ``scalify.amp`` and the recipes.

    git clone https://github.com/luchris429/purejaxrl /tmp/purejaxrl
    pip install gymnax==0.0.9 distrax
    python scripts/run_purejaxrl.py --source /tmp/purejaxrl                 # every column, 3 seeds
    python scripts/run_purejaxrl.py --source /tmp/purejaxrl --columns amp mxfp8 --markdown

PureJaxRL (Lu et al. 2022) writes a whole reinforcement-learning run as one function:
``make_train(config)`` returns ``train(rng)``, whose ``lax.scan`` over updates holds the rollout
(``jax.vmap`` over gymnax environments, a flax ``ActorCritic`` sampling its action from a
``distrax.Categorical``), generalised advantage estimation (a reverse ``lax.scan``) and PPO's
epochs of minibatch updates (``jax.value_and_grad``, optax's clipped Adam in a ``TrainState``); the
network is initialised inside it with flax's ``orthogonal`` initializer. The module
``purejaxrl/ppo.py`` (an MLP actor-critic) of a checkout is imported from ``--source``; nothing is
copied here. Its ``wrappers.py`` imports brax and navix for wrappers PPO on gymnax does not use:
empty stand-in modules are installed for those two names when the real ones are missing. (The
repository's ``ppo_rnn.py`` calls flax's pre-0.7 ``GRUCell.initialize_carry`` and ``dqn.py`` calls
``jax.tree_map``, both gone from the current releases: they fail as written, without scalify.)

Each column runs ``jax.jit(T(make_train(config)))(key)`` as ``ppo.py``'s ``__main__`` does, for
each key of ``jax.random.split(PRNGKey(30), seeds)``, on CartPole-v1 with that ``__main__``
configuration, ``TOTAL_TIMESTEPS`` cut to :data:`TIMESTEPS`. (``--vmap`` trains the seeds at once
as the README does, ``jax.jit(jax.vmap(T(train)))(keys)``: the ``float32`` and bfloat16 amp
columns and the five recipes tried (mxfp8, mxfp4, nvfp4, float8_tensorwise, float8_rowwise) run
so, but the ``amp`` column's executable, float16 contractions under ``vmap``, never finishes on a
2-core CPU at 2048 timesteps and up: 0% CPU, a deadlock in XLA's multi-threaded CPU runtime,
which the program with flax's ``nn.Dense(dtype=float16)`` and no scalify meets too; pinned to
one core, ``taskset -c 0``, it finishes.)

* ``float32``: the program as written;
* ``amp``: ``scalify.amp.amp`` (jaxamp's default policy: additions, subtractions and contractions
  in float16), the environment's physics and the optimizer included;
* ``amp_bfloat16``: the same in bfloat16;
* ``amp_matmul_bfloat16``: ``matmul_amp_policy`` (contractions only) in bfloat16;
* a recipe name: ``scalify.recipes.apply`` with the recipe's GEMMs, the layers whose dimensions no
  block divides (the 4 observations in, the 2 actions and the value out) in high precision
  (:data:`HIGH_PRECISION`), as Transformer Engine keeps a first and last layer.

The outcome is the mean episodic return over the last 10% of the updates (CartPole caps it at
500; a uniformly random policy scores about 22): ``ok`` when every seed's reaches
:data:`LEARNED`; ``n/a`` when a recipe refuses the network's widths (its blocks of 128 do not
divide PPO's 64) with the error that names the layer and the fix. Before amp ran ``jax.random``'s
samplers as JAX wrote them (its policies reach inside nested jits, and the samplers are nested
jits), the ``amp`` column scored 6, 6, 6: the float16 ``u * (max - min) + min`` of
``jax.random.uniform`` reached 1.0, a ``normal`` became inf, the orthogonal initializer's QR
turned it into NaN weights and every action was distrax's invalid -1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import numpy as np
from run_flax_examples import failure

import scalify.amp
from scalify import recipes

TIMESTEPS = 1e5
LEARNED = 100.0
PROGRAMS = ("ppo",)
COLUMNS = ("float32", "amp", "amp_bfloat16", "amp_matmul_bfloat16")
# flax's automatic names of ActorCritic's layers that read the 4 observations (Dense_0, Dense_3) or
# write the 2 action logits (Dense_2) and the value (Dense_5).
HIGH_PRECISION = {"ppo": ("Dense_0", "Dense_2", "Dense_3", "Dense_5")}
CONFIG = {  # the __main__ configuration of ppo.py, DEBUG off
    "LR": 2.5e-4,
    "NUM_ENVS": 4,
    "NUM_STEPS": 128,
    "UPDATE_EPOCHS": 4,
    "NUM_MINIBATCHES": 4,
    "GAMMA": 0.99,
    "GAE_LAMBDA": 0.95,
    "CLIP_EPS": 0.2,
    "ENT_COEF": 0.01,
    "VF_COEF": 0.5,
    "MAX_GRAD_NORM": 0.5,
    "ACTIVATION": "tanh",
    "ENV_NAME": "CartPole-v1",
    "ANNEAL_LR": True,
    "DEBUG": False,
}


def import_programs(root: Path) -> dict:
    """``{name: module}`` for the programs of the checkout (``purejaxrl/ppo.py``)."""
    for name in ("brax", "navix"):
        try:
            importlib.import_module(name)
        except ImportError:
            _stand_in(name)
    sys.path.insert(0, str(root / "purejaxrl"))
    return {name: importlib.import_module(name) for name in PROGRAMS}


def _stand_in(name: str) -> None:
    """Empty modules under ``name`` for the imports of ``wrappers.py`` these programs never call."""
    if name == "navix":
        sys.modules[name] = types.ModuleType(name)
        return
    training = types.ModuleType("brax.envs.wrappers.training")
    training.EpisodeWrapper = training.AutoResetWrapper = None
    for module in ("brax", "brax.envs", "brax.envs.wrappers"):
        sys.modules[module] = types.ModuleType(module)
    sys.modules["brax.envs.wrappers.training"] = training
    sys.modules["brax"].envs = sys.modules["brax.envs"]


def transform(program: str, column: str):
    """The transformation ``T`` a column applies to ``train``."""
    if column == "float32":
        return lambda train: train
    if column == "amp":
        return scalify.amp.amp
    if column == "amp_bfloat16":
        return lambda train: scalify.amp.amp(train, compute_dtype=jax.numpy.bfloat16)
    if column == "amp_matmul_bfloat16":
        policy = scalify.amp.matmul_amp_policy
        return lambda train: scalify.amp.amp(train, compute_dtype=jax.numpy.bfloat16, amp_policy=policy)
    recipe = recipes.BUILTINS[column].replace(high_precision_scopes=HIGH_PRECISION[program])
    return lambda train: recipes.apply(train, recipe)


def late_returns(metrics) -> list[float]:
    """Per seed, the mean return of the episodes that ended in the last 10% of the updates."""
    returns, ended = np.asarray(metrics["returned_episode_returns"]), np.asarray(metrics["returned_episode"])
    tail = max(1, returns.shape[1] // 10)
    return [float(r[-tail:][e[-tail:]].mean()) for r, e in zip(returns, ended, strict=True)]


def run(module, program: str, column: str, seeds: int, vmap: bool = False) -> tuple[str, str]:
    """``(outcome, detail)`` of one (program, column) over ``seeds`` seeds."""
    config = dict(CONFIG, TOTAL_TIMESTEPS=TIMESTEPS)
    try:
        train = transform(program, column)(module.make_train(dict(config)))
        keys = jax.random.split(jax.random.PRNGKey(30), seeds)
        start = time.perf_counter()
        if vmap:
            scores = late_returns(jax.jit(jax.vmap(train))(keys)["metrics"])
        else:
            train = jax.jit(train)
            scores = [s for key in keys for s in late_returns(jax.tree.map(lambda x: x[None], train(key)["metrics"]))]
        seconds = time.perf_counter() - start
    except Exception as exc:  # reported per (program, column); the run goes on
        outcome, detail = failure(exc)
        # a recipe refusing a width its blocks do not divide, with the error that says so
        refused = isinstance(exc, ValueError) and "not a multiple of" in str(exc)
        return "n/a" if refused else outcome, detail
    outcome = "ok" if all(np.isfinite(s) and s >= LEARNED for s in scores) else "FAIL"
    shown = ", ".join(f"{s:.0f}" for s in scores)
    return outcome, f"late return {shown} ({seconds:.0f} s with compilation)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="a checkout of luchris429/purejaxrl")
    parser.add_argument("--programs", nargs="*", default=list(PROGRAMS), choices=PROGRAMS)
    parser.add_argument("--columns", nargs="*", default=[*COLUMNS, *recipes.BUILTINS])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--vmap", action="store_true", help="train the seeds under one jax.vmap")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = parser.parse_args(argv)
    modules = import_programs(args.source.resolve())
    rows = []
    for program in args.programs:
        for column in args.columns:
            outcome, detail = run(modules[program], program, column, args.seeds, args.vmap)
            rows.append((program, column, outcome, detail))
            print(f"{program:8s} {column:24s} {outcome:5s} {detail}", flush=True)
    if args.markdown:
        print("\n| program | column | outcome | detail |\n| --- | --- | --- | --- |")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    return 0 if all(outcome in ("ok", "n/a") for *_, outcome, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
