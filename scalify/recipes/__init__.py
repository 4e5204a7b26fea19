"""Low-precision training recipes: a format per GEMM operand, applied to an unchanged function.

    from scalify import recipes
    loss_q = recipes.apply(loss, recipes.MXFP8)        # forward and both backward GEMMs in MXFP8
    grads = jax.grad(loss_q)(params, batch)
    my = recipes.MXFP8.replace(wgrad_lhs=None, wgrad_rhs=None)   # high-precision weight gradient

See ``docs/recipes.md``.
"""

from scalify.recipes._apply import RecipeContraction, apply, policy
from scalify.recipes._builtins import (
    BUILTINS,
    FLOAT8_BLOCKWISE,
    FLOAT8_BLOCKWISE_POW2,
    FLOAT8_ROWWISE,
    FLOAT8_TENSORWISE,
    FLOAT8_TENSORWISE_POW2,
    MXFP4,
    MXFP4_RCEIL,
    MXFP8,
    MXFP8_RCEIL,
    NVFP4,
    get_recipe,
)
from scalify.recipes._gemm import recipe_contraction
from scalify.recipes._recipe import ROLES, Recipe

__all__ = [
    "BUILTINS",
    "FLOAT8_BLOCKWISE",
    "FLOAT8_BLOCKWISE_POW2",
    "FLOAT8_ROWWISE",
    "FLOAT8_TENSORWISE",
    "FLOAT8_TENSORWISE_POW2",
    "MXFP4",
    "MXFP4_RCEIL",
    "MXFP8",
    "MXFP8_RCEIL",
    "NVFP4",
    "ROLES",
    "Recipe",
    "RecipeContraction",
    "apply",
    "get_recipe",
    "policy",
    "recipe_contraction",
]
