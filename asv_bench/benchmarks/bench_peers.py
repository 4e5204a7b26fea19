"""Against google's qwix, when it is installed: the same quantization of the same array, both jitted,
timed interleaved in the same process.

Each scheme pairs a qwix ``qtype`` with our format of the same convention
(``tests/test_peer_qwix.py`` checks that they agree bit for bit, or states where and why not):

* ``mxfp8`` / ``mxfp4``: qwix's qtype with blocks of 32 along the last axis; ours ``MXFP8`` /
  ``MXFP4`` with ``scale_mode="rceil"``;
* ``nvfp4``: qwix's, blocks of 16, no tensor scale; ours ``NVFP4.replace(tensor_scale=False)``;
* ``fp8_e4m3``: per tensor; ours ``FP8_E4M3.replace(scale_mode="exact")``;
* ``int8_per_channel``: one scale per row (qwix's bound 127.5, ours 127).

Ratios: ours over qwix for quantize and for the round trip (``fake_quantize`` here, ``dequantize(
quantize(x))`` there: what a quantization-aware training step computes), below 1 when ours is the
faster; and qwix's quantize over ``x * 2``, the unit of the targets in docs/performance.md.

``QwixTrainingStep``: a flax linen MLP (``Dense(h) -> gelu -> Dense(d)``, MSE loss) at a
transformer MLP's size, ``jax.value_and_grad`` under ``jax.jit``, with every GEMM in MXFP8 or MXFP4
forward and backward: qwix's ``QtProvider`` (weights, activations and gradients in the format,
blocks of 32) against the unchanged loss under ``scalify.recipes.apply`` with our recipe of the
same forward (``tests/test_peer_qwix.py``: equal bit for bit). The backward passes differ: qwix
quantizes the incoming gradient after moving the forward scales onto it, ours requantizes each
operand along the backward GEMM's contraction axis (torchao's and Transformer Engine's recipe).
"""

from __future__ import annotations

from ._common import RATIO_SHAPE, SHAPES, SMALL, block, interleaved_ratio, make_data, parse_shape, times_two

SCHEMES = ("mxfp8", "mxfp4", "nvfp4", "fp8_e4m3", "int8_per_channel")


def _require_qwix():
    try:
        import qwix
    except ImportError:
        raise NotImplementedError("qwix is not installed (pip install qwix)") from None
    return qwix


def _pair(name):
    """``(our format, qwix quantize function)`` for ``name`` on a rank-2 array."""
    import jax.numpy as jnp
    import qwix

    import qformats as qf

    rows = {"channelwise_axes": (0,)}
    ours, qtype, layout = {
        "mxfp8": (qf.MXFP8.replace(scale_mode="rceil"), "mxfp8", {"tiled_axes": {1: 32}, **rows}),
        "mxfp4": (qf.MXFP4.replace(scale_mode="rceil"), "mxfp4", {"tiled_axes": {1: 32}, **rows}),
        "nvfp4": (qf.NVFP4.replace(tensor_scale=False), "nvfp4", {"tiled_axes": {1: 16}, **rows}),
        "fp8_e4m3": (qf.FP8_E4M3.replace(scale_mode="exact"), jnp.float8_e4m3fn, {}),
        "int8_per_channel": (qf.INT8_PER_CHANNEL.replace(axis=0), jnp.int8, rows),
    }[name]
    return ours, lambda x: qwix.quantize(x, qtype, **layout)


class Qwix:
    """Ours over qwix 0.1.8+ (quantize, round trip), and qwix over ``x * 2``."""

    params = (list(SCHEMES), [RATIO_SHAPE] if RATIO_SHAPE in SHAPES else SHAPES[-1:])
    param_names = ("scheme", "shape")
    unit = "ratio"
    repeats_inner = 21
    timeout = 300

    def setup(self, name, shape):
        qwix = _require_qwix()
        import jax
        import jax.numpy as jnp

        ours, theirs = _pair(name)
        self.x = jnp.asarray(make_data("gaussian", parse_shape(shape)))
        self.ours = jax.jit(ours.quantize)
        self.theirs = jax.jit(theirs)
        self.ours_round_trip = jax.jit(ours.fake_quantize)
        self.theirs_round_trip = jax.jit(lambda x: qwix.dequantize(theirs(x)))
        self.ref = times_two()
        for f in (self.ours, self.theirs, self.ours_round_trip, self.theirs_round_trip, self.ref):
            block(f(self.x))

    def track_ours_over_qwix_quantize(self, name, shape):
        return interleaved_ratio(self.ours, (self.x,), self.theirs, (self.x,), self.repeats_inner)

    def track_ours_over_qwix_round_trip(self, name, shape):
        return interleaved_ratio(self.ours_round_trip, (self.x,), self.theirs_round_trip, (self.x,), self.repeats_inner)

    def track_qwix_quantize_ratio(self, name, shape):
        return interleaved_ratio(self.theirs, (self.x,), self.ref, (self.x,), self.repeats_inner)


STEP_DIMS = (32, 64, 128) if SMALL else (256, 1024, 4096)  # tokens, d_model, d_hidden


class QwixTrainingStep:
    """Ours over qwix for one MXFP8 / MXFP4 training step (value and gradients), and each over float32."""

    params = (["mxfp8", "mxfp4"],)
    param_names = ("format",)
    unit = "ratio"
    repeats_inner = 11
    timeout = 600

    def setup(self, name):
        qwix = _require_qwix()
        import flax.linen as nn
        import jax
        import jax.numpy as jnp

        import scalify

        tokens, d, h = STEP_DIMS

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(d)(nn.gelu(nn.Dense(h)(x)))

        model = MLP()
        self.x = jnp.asarray(make_data("gaussian", (tokens, d)))
        self.y = jnp.asarray(make_data("gaussian", (tokens, d), seed=1))
        self.params = model.init(jax.random.key(0), self.x)
        # qwix needs the input-gradient GEMM's tile given through additional_qt_config: its rule
        # sets a backward tile only for the GEMM that produces the weight gradient.
        rule = qwix.QtRule(
            module_path=".*", weight_qtype=name, act_qtype=name, bwd_qtype=name, tile_size=32,
            bwd_weight_grad_tile_size=32, additional_qt_config={"dlhs_tile_size": 32},
        )  # fmt: skip
        qmodel = qwix.quantize_model(model, qwix.QtProvider([rule]))

        def loss_of(apply):
            return lambda p, x, y: jnp.mean((apply(p, x) - y) ** 2)

        recipe = {"mxfp8": scalify.recipes.MXFP8_RCEIL, "mxfp4": scalify.recipes.MXFP4_RCEIL}[name]
        self.ours = jax.jit(jax.value_and_grad(scalify.recipes.apply(loss_of(model.apply), recipe)))
        self.theirs = jax.jit(jax.value_and_grad(loss_of(qmodel.apply)))
        self.plain = jax.jit(jax.value_and_grad(loss_of(model.apply)))
        self.args = (self.params, self.x, self.y)
        for f in (self.ours, self.theirs, self.plain):
            block(f(*self.args))

    def track_ours_over_qwix_step(self, name):
        return interleaved_ratio(self.ours, self.args, self.theirs, self.args, self.repeats_inner)

    def track_ours_over_float32_step(self, name):
        return interleaved_ratio(self.ours, self.args, self.plain, self.args, self.repeats_inner)

    def track_qwix_over_float32_step(self, name):
        return interleaved_ratio(self.theirs, self.args, self.plain, self.args, self.repeats_inner)
