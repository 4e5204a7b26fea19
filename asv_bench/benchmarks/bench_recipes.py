"""Training recipes: a GPT block's forward + backward under ``scalify.recipes.apply``.

The block (pre-norm, causal multi-head attention, GELU MLP) runs at d_model 1024, sequence 256,
batch 8 (``QFORMATS_BENCH_SMALL=1``: d_model 128, sequence 64, batch 2), every recipe against the
same jitted float32 step in the same process: ``track_step_ratio`` is the recipe step's median
time over the plain step's (interleaved runs). Skipped while ``scalify.recipes`` is not importable.
"""

from __future__ import annotations

import numpy as np

from ._common import SMALL, block, interleaved_ratio, make_data

D_MODEL, SEQ, BATCH, HEADS = (128, 64, 2, 4) if SMALL else (1024, 256, 8, 16)


def _recipes():
    """The built-in recipes; the blockwise ones on linear layers only (``weights_only``), as torchao and
    Transformer Engine apply them: attention's head dimension (64; 32 small) holds no 128-block."""
    try:
        from scalify import recipes
    except ImportError:  # pragma: no cover
        return {}
    linear_only = {recipes.FLOAT8_BLOCKWISE.name, recipes.FLOAT8_BLOCKWISE_POW2.name}
    return {n: r.replace(weights_only=True) if n in linear_only else r for n, r in recipes.BUILTINS.items()}


RECIPE_NAMES = sorted(_recipes())


def gpt_block_loss(p, x, heads=HEADS):
    """Pre-norm causal attention + GELU MLP block, loss ``mean(out^2)``."""
    import jax
    import jax.numpy as jnp

    def norm(h):
        mu = jnp.mean(h, axis=-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(jnp.mean((h - mu) ** 2, axis=-1, keepdims=True) + 1e-5)

    b, t, d = x.shape
    dh = d // heads
    h = norm(x)
    q, k, v = (jnp.reshape(h @ p[n], (b, t, heads, dh)) for n in ("wq", "wk", "wv"))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(dh))
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, np.float32(-1e9))
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(b, t, d)
    x = x + o @ p["wo"]
    x = x + jax.nn.gelu(norm(x) @ p["w1"]) @ p["w2"]
    return jnp.mean(x**2)


def gpt_block_params():
    import jax.numpy as jnp

    shapes = {"wq": (D_MODEL, D_MODEL), "wk": (D_MODEL, D_MODEL), "wv": (D_MODEL, D_MODEL), "wo": (D_MODEL, D_MODEL)}
    shapes |= {"w1": (D_MODEL, 4 * D_MODEL), "w2": (4 * D_MODEL, D_MODEL)}
    return {k: jnp.asarray(make_data("gaussian", s, seed=i) / np.sqrt(s[0])) for i, (k, s) in enumerate(shapes.items())}


class _RecipeStep:
    """A loss's forward + backward under each built-in recipe against the same jitted float32 step;
    subclasses give ``loss`` and ``make_args``."""

    params = (RECIPE_NAMES,)
    param_names = ("recipe",)
    timeout = 600

    def setup(self, name):
        import jax

        from scalify import recipes

        recipe = _recipes().get(name)
        if recipe is None:
            raise NotImplementedError("scalify.recipes is not importable")
        self.args = self.make_args()
        self.plain = jax.jit(jax.value_and_grad(self.loss))
        self.recipe = jax.jit(jax.value_and_grad(recipes.apply(self.loss, recipe)))
        block(self.plain(*self.args))
        block(self.recipe(*self.args))

    def time_plain(self, name):
        block(self.plain(*self.args))

    def time_recipe(self, name):
        block(self.recipe(*self.args))

    def track_step_ratio(self, name):
        return interleaved_ratio(self.recipe, self.args, self.plain, self.args, 9)

    track_step_ratio.unit = "ratio"


class GPTBlockRecipeStep(_RecipeStep):
    loss = staticmethod(gpt_block_loss)

    @staticmethod
    def make_args():
        import jax.numpy as jnp

        return gpt_block_params(), jnp.asarray(make_data("gaussian", (BATCH, SEQ, D_MODEL), seed=99))


# A mixture of experts' expert bank: tokens x top-k routed rows in groups, two grouped GEMMs per layer
MOE_ROWS, MOE_D, MOE_EXPERTS = (256, 128, 4) if SMALL else (2048, 512, 8)


def moe_loss(p, x, sizes):
    """An expert bank's FFN on routed rows ``x`` (``sizes[g]`` consecutive rows per expert):
    ``ragged_dot(gelu(ragged_dot(x, w1)), w2)``, loss ``mean(out^2)``."""
    import jax
    import jax.numpy as jnp

    h = jax.nn.gelu(jax.lax.ragged_dot(x, p["w1"], sizes))
    return jnp.mean(jax.lax.ragged_dot(h, p["w2"], sizes) ** 2)


class MoERecipeStep(_RecipeStep):
    """The expert bank's forward + backward under each recipe (grouped GEMMs, one group at a time)
    against the same jitted float32 step: 2048 routed rows (batch 8 x sequence 128 x top-2), d_model
    and expert width 512, 8 experts of uneven load (``QFORMATS_BENCH_SMALL=1``: 256 rows, 128, 4)."""

    loss = staticmethod(moe_loss)

    @staticmethod
    def make_args():
        import jax.numpy as jnp

        load = np.random.default_rng(0).dirichlet(np.ones(MOE_EXPERTS) * 2)
        sizes = np.floor(load * MOE_ROWS).astype(np.int32)
        sizes[-1] += MOE_ROWS - sizes.sum()
        shape = (MOE_EXPERTS, MOE_D, MOE_D)
        params = {f"w{i}": jnp.asarray(make_data("gaussian", shape, seed=i) / np.sqrt(MOE_D)) for i in (1, 2)}
        x = jnp.asarray(make_data("gaussian", (MOE_ROWS, MOE_D), seed=7))
        return params, x, jnp.asarray(sizes)
