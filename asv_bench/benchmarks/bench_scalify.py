"""Models under ``scalify``, per format, against the same step in plain JAX.

* an MLP training step (forward, backward, SGD update);
* a transformer block forward + backward (layer norm, single-head attention, GELU MLP).

``track_*_ratio`` is the jitted step under scalify over the plain jitted step (interleaved
medians); ``track_*_trace_lower_ratio`` is the time to trace and lower the scalified step over the
plain one (the interpreter's one-off price); ``track_compile_ratio`` adds XLA's compile to both.
Skipped while ``scalify.scalify`` is not importable, or when scalify lacks a rule the model needs
for that format.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from ._common import FORMAT_NAMES, MODEL_DIMS, SMALL, block, get_format, interleaved_ratio, make_data, scalify_or_skip

BATCH, D_MODEL, D_HIDDEN = MODEL_DIMS


def _init(shapes, seed):
    import jax.numpy as jnp

    return {
        k: jnp.asarray(make_data("gaussian", s, seed=seed + i) / np.sqrt(s[0]))
        for i, (k, s) in enumerate(shapes.items())
    }


def mlp_step(params, x, y):
    import jax
    import jax.numpy as jnp

    def loss(p):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    g = jax.grad(loss)(params)
    return jax.tree.map(lambda p, d: p - 0.01 * d, params, g)


def transformer_fwd_bwd(params, x):
    import jax
    import jax.numpy as jnp

    def layer_norm(h):
        mu = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(var + 1e-5)

    def loss(p):
        h = layer_norm(x)
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
        att = jax.nn.softmax((q @ k.T) / np.float32(np.sqrt(D_MODEL)), axis=-1)
        h = x + (att @ v) @ p["wo"]
        h = h + jax.nn.gelu(layer_norm(h) @ p["w1"]) @ p["w2"]
        return jnp.mean(h**2)

    return jax.value_and_grad(loss)(params)


def _scaled_tree(tree, fmt, as_scaled_array):
    import jax

    return jax.tree.map(lambda a: as_scaled_array(a, fmt=fmt), tree)


def _plain(tree):
    import jax

    return jax.tree.map(
        lambda a: a.to_array() if hasattr(a, "to_array") else a, tree, is_leaf=lambda a: hasattr(a, "to_array")
    )


def _trace_lower_seconds(make_fn, args, repeats=1 if SMALL else 3, compile=False):
    """Best time to trace and lower (and, with ``compile``, XLA-compile) a fresh jit of ``make_fn()``."""
    import jax

    best = float("inf")
    for _ in range(repeats):
        fn = make_fn()  # a fresh function: nothing cached
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        if compile:
            lowered.compile()
        best = min(best, time.perf_counter() - t0)
    return best


class _ScalifyModel:
    params = (FORMAT_NAMES,)
    param_names = ("format",)
    timeout = 300
    model = None  # (step, param shapes, make extra args)

    def setup(self, fmt_name):
        import jax

        scalify, as_scaled_array = scalify_or_skip()
        fmt = get_format(fmt_name)
        step, shapes = self.model
        p = _init(shapes, seed=10)
        extra = self.extra_args()
        self.plain_args = (p, *extra)
        self.plain = jax.jit(step)
        block(self.plain(*self.plain_args))
        self._make_plain = lambda: lambda *a: step(*a)
        self._make_scaled = lambda: lambda *a: _plain(scalify(step)(*a))
        try:
            self.scaled_args = (
                _scaled_tree(p, fmt, as_scaled_array),
                *_scaled_tree(extra[:1], fmt, as_scaled_array),
                *extra[1:],
            )
            self.scaled = jax.jit(self._make_scaled())
            block(self.scaled(*self.scaled_args))
        except Exception as e:
            raise NotImplementedError(f"scalify cannot run this model in {fmt_name}: {type(e).__name__}: {e}") from e

    def time_plain(self, fmt_name):
        block(self.plain(*self.plain_args))

    def time_scalified(self, fmt_name):
        block(self.scaled(*self.scaled_args))

    def track_ratio(self, fmt_name):
        return interleaved_ratio(self.scaled, self.scaled_args, self.plain, self.plain_args, 11)

    def track_trace_lower_ratio(self, fmt_name):
        t_scaled = _trace_lower_seconds(self._make_scaled, self.scaled_args)
        t_plain = _trace_lower_seconds(self._make_plain, self.plain_args)
        return t_scaled / t_plain

    def track_compile_ratio(self, fmt_name):
        """Trace, lower and XLA-compile the scalified step, over the same for the plain step: the
        price a user pays once per program and shape (XLA's part grows with the scale arithmetic)."""
        t_scaled = _trace_lower_seconds(self._make_scaled, self.scaled_args, compile=True)
        t_plain = _trace_lower_seconds(self._make_plain, self.plain_args, compile=True)
        return t_scaled / t_plain

    track_ratio.unit = track_trace_lower_ratio.unit = track_compile_ratio.unit = "ratio"


class MLPTrainStep(_ScalifyModel):
    model = (mlp_step, {"w1": (D_MODEL, D_HIDDEN), "w2": (D_HIDDEN, D_MODEL)})

    def extra_args(self):
        import jax.numpy as jnp

        return (
            jnp.asarray(make_data("gaussian", (BATCH, D_MODEL), 20)),
            jnp.asarray(make_data("gaussian", (BATCH, D_MODEL), 21)),
        )


class TransformerBlockFwdBwd(_ScalifyModel):
    model = (
        transformer_fwd_bwd,
        {
            "wq": (D_MODEL, D_MODEL),
            "wk": (D_MODEL, D_MODEL),
            "wv": (D_MODEL, D_MODEL),
            "wo": (D_MODEL, D_MODEL),
            "w1": (D_MODEL, D_HIDDEN),
            "w2": (D_HIDDEN, D_MODEL),
        },
    )

    def extra_args(self):
        import jax.numpy as jnp

        return (jnp.asarray(make_data("gaussian", (BATCH, D_MODEL), 22)),)


ISSUE_MLP_DIMS = (32, 64, 64, 10) if SMALL else (784, 1024, 1024, 10)
ISSUE_MLP_BATCH = 16 if SMALL else 256


def classifier_step(params, x, y):
    """Softmax cross-entropy MLP classifier, forward + backward + SGD, in the dtype of ``params``."""
    import jax
    import jax.numpy as jnp

    def loss(params):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(h) * y, axis=-1))

    g = jax.grad(loss)(params)
    return jax.tree.map(lambda p, d: p - jnp.asarray(0.01, p.dtype) * d, params, g)


class _PlainVsScalified:
    """``self.plain`` on ``self.plain_args`` against ``self.scaled`` on ``self.scaled_args``
    (both jitted and warmed by ``setup``)."""

    def time_plain(self):
        block(self.plain(*self.plain_args))

    def time_scalified(self):
        block(self.scaled(*self.scaled_args))

    def track_ratio(self):
        return interleaved_ratio(self.scaled, self.scaled_args, self.plain, self.plain_args, 41)

    track_ratio.unit = "ratio"


class Float16MLPStep(_PlainVsScalified):
    """The scalify issue's target: MLP 784-1024-1024-10, batch 256, float16 data with float32
    per-tensor scales, against the same step on plain float16 arrays (no format parameter)."""

    timeout = 300

    def setup(self):
        import jax
        import jax.numpy as jnp

        scalify, as_scaled_array = scalify_or_skip()
        dims = ISSUE_MLP_DIMS
        rng = np.random.default_rng(0)
        params = [
            (jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float16), jnp.zeros((b,), jnp.float16))
            for a, b in itertools.pairwise(dims)
        ]
        x = jnp.asarray(rng.standard_normal((ISSUE_MLP_BATCH, dims[0])), jnp.float16)
        y = jax.nn.one_hot(rng.integers(0, dims[-1], ISSUE_MLP_BATCH), dims[-1], dtype=jnp.float16)
        self.plain_args = (params, x, y)
        self.scaled_args = (
            as_scaled_array(params, scale=np.float32(1.0)),
            as_scaled_array(x, scale=np.float32(1.0)),
            y,
        )
        self._make_plain = lambda: lambda *a: classifier_step(*a)
        self._make_scaled = lambda: lambda *a: scalify(classifier_step)(*a)
        self.plain = jax.jit(self._make_plain())
        self.scaled = jax.jit(self._make_scaled())
        block(self.plain(*self.plain_args))
        block(self.scaled(*self.scaled_args))

    def track_trace_lower_ratio(self):
        return _interleaved_trace_lower_ratio(self._make_scaled, self.scaled_args, self._make_plain, self.plain_args)

    track_trace_lower_ratio.unit = "ratio"


def adam_update(p, m, v, g):
    """One Adam update of a parameter and its moments (bias correction left out: a scalar)."""
    import jax.numpy as jnp

    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v


class OptimizerUpdate(_PlainVsScalified):
    """An Adam update of a 2048x2048 float32 parameter on float32 carriers with traced scales,
    against the same update on plain arrays: the program's three outputs are settled where they
    are produced (an amax each; the rescale only outside the window), and ``g * g`` renormalises
    ``g`` first (its magnitude is not known at trace time). Its ratio is that bookkeeping's price
    on a memory-bound update."""

    timeout = 300

    def setup(self):
        import jax
        import jax.numpy as jnp

        scalify, as_scaled_array = scalify_or_skip()
        shape = (256, 256) if SMALL else (2048, 2048)
        p, g = (make_data("gaussian", shape, seed) for seed in (30, 31))
        self.plain_args = tuple(jnp.asarray(a) for a in (p, 0.1 * g, 0.01 * g * g, g))
        self.scaled_args = tuple(as_scaled_array(a, scale=jnp.float32(1.0)) for a in self.plain_args)
        self.plain = jax.jit(adam_update)
        self.scaled = jax.jit(scalify(adam_update))
        block(self.plain(*self.plain_args))
        block(self.scaled(*self.scaled_args))


def _interleaved_trace_lower_ratio(make_a, args_a, make_b, args_b, repeats=1 if SMALL else 15):
    """Median trace+lower time of fresh ``make_a()`` over fresh ``make_b()``, interleaved."""
    import jax

    t_a, t_b = [], []
    for _ in range(repeats):
        for make, args, acc in ((make_a, args_a, t_a), (make_b, args_b, t_b)):
            fn = make()  # a fresh function: nothing cached
            t0 = time.perf_counter()
            jax.jit(fn).lower(*args)
            acc.append(time.perf_counter() - t0)
    return float(np.median(t_a) / np.median(t_b))
