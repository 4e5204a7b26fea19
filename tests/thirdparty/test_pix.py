"""dm-pix's image processing on scaled feature maps.

What scalify meets here is dm-pix's code: SSIM (a depthwise Gaussian filter of the images, their
squares and product, then a ratio), PSNR (a log of a mean), Gaussian blur (two separable
depthwise convolutions), rotation, affine transforms and elastic deformation (coordinates fed to
``jax.scipy.ndimage.map_coordinates``: gathers weighted by the fractional parts), flips and
random crops (``lax.dynamic_slice`` at a random offset), ``depth_to_space`` (reshapes and a
transpose), brightness / contrast / gamma adjustments (means, clips, a power) and padding. The
scaled operand is a batch of feature maps (2 x 32 x 32 x 32, blocked along the channels: the
layout of an activation); each program's output is compared whole, and the gradient of a fixed
weighting of it.

Reference: the same program in float32 on the dequantized maps. These are direct computations
(no solver, no stopping test), each output a short chain of float32 operations on the values:
the two programs round in different places (the carriers' scales, the rules' order), so they
agree to a few ulps per operation, except where the program cancels: ``adjustments`` raises
``(x + 0.1 - m) * 1.2 + m`` (``m`` the mean) to the power 0.8, and for ``x = 0`` that base is about
1e-2, so one ulp of the mean is some 60 ulps of the base and of the gamma's gradient there
(measured in NVFP4, whose two-level scales round the mean's sum differently: 6.8e-6 over the
gradient, 1.4e-4 at the worst element; every other program and format below 7e-7). The bound
:data:`RTOL` (relative 2-norm distance, about 340 eps32) covers that with a margin of 6; rounding
the maps to bfloat16 moves every program's output or gradient by over five times it (3.9e-4 to
2.3e-2, ``test_the_bound_detects_bfloat16_rounding``). Where float32's gradient is NaN
(``adjust_gamma``'s power at 0, after the clip of ``adjust_contrast``), the scalified one must be
NaN at the same elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thirdparty_harness import FEW_FORMATS, accepts, as_float64, relative_distance

import qformats as qf
import scalify

pix = pytest.importorskip("dm_pix", reason="dm-pix is not installed (pip install -e '.[test]')")

_RNG = np.random.default_rng(0)
MAPS = _RNG.uniform(0, 1, (2, 32, 32, 32)).astype(np.float32)
# SSIM against a correlated target (an uncorrelated one gives SSIM ~ 0, a cancellation that
# inflates any relative difference).
TARGET = np.clip(MAPS + 0.1 * _RNG.standard_normal(MAPS.shape), 0, 1).astype(np.float32)
KEY = jax.random.key(0)
RTOL = 4e-5
_SHEAR = np.array([[1.0, 0.1, 0.0], [0.05, 1.0, 0.0], [0.0, 0.0, 1.0]], np.float32)

# name: the program's output (an image, a batch of them, or a score per image) of the maps
PROGRAMS = {
    "ssim": lambda x: pix.ssim(x, TARGET),
    "psnr": lambda x: pix.psnr(x, TARGET),
    "gaussian_blur": lambda x: pix.gaussian_blur(x, sigma=1.5, kernel_size=5),
    "rotate": lambda x: jax.vmap(lambda im: pix.rotate(im, 0.3))(x),
    "affine_transform": lambda x: jax.vmap(lambda im: pix.affine_transform(im, jnp.asarray(_SHEAR), order=1))(x),
    "elastic_deformation": lambda x: jax.vmap(lambda im: pix.elastic_deformation(KEY, im, alpha=5.0, sigma=2.0))(x),
    "flip_and_crop": lambda x: pix.random_crop(KEY, pix.random_flip_left_right(KEY, x), (2, 16, 16, 32)),
    "depth_to_space": lambda x: pix.depth_to_space(x, 2),
    "adjustments": lambda x: pix.adjust_gamma(pix.adjust_contrast(pix.adjust_brightness(x, 0.1), 1.2), 0.8),
    "pad_to_size": lambda x: pix.pad_to_size(x[0], 40, 40),
}
# SSIM and an interpolation run in every registered format; the others add dm-pix's own code
# around the same rules (depthwise convolutions, gathers, slices, elementwise maps).
EVERY_FORMAT = ("ssim", "affine_transform")
OTHERS = [n for n in PROGRAMS if n not in EVERY_FORMAT]


def _gradient(fn):
    """The gradient of ``sum(fn(x) * w)``, ``w`` fixed weights of the output's shape (cosines of
    the flat index, so that every output element counts with its own sign)."""

    def loss(x):
        out = fn(x)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape))

    return jax.grad(loss)


def _check(name, fmt_name):
    fmt = qf.get_format(fmt_name)
    if not accepts(fmt, MAPS):
        pytest.skip(f"{fmt_name}'s layout does not accept {MAPS.shape} maps (its block is larger)")
    qx = scalify.as_scaled_array(jnp.asarray(MAPS), fmt=fmt)
    x = qx.to_array(jnp.float32)
    fn = PROGRAMS[name]
    for program, what in ((fn, "value"), (_gradient(fn), "gradient")):
        ref = as_float64(jax.jit(program)(x))
        got = as_float64(jax.jit(scalify.scalify(program))(qx))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{name} {what}: NaN pattern")
        assert relative_distance(got, ref) <= RTOL, f"{name} {what}: {relative_distance(got, ref):.2e} from float32"


@pytest.mark.parametrize("name", EVERY_FORMAT)
def test_pix_in_every_format(name, fmt_name):
    """SSIM and an affine transform's output and gradient with the maps scaled, against float32."""
    _check(name, fmt_name)


# The slow lane: the fast lane's time on CI's 2 cores (a clean-clone run took 74 min with them).
@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", FEW_FORMATS)
@pytest.mark.parametrize("name", OTHERS)
def test_pix_program(name, fmt_name):
    """A dm-pix program's output and gradient with the maps scaled, against float32."""
    _check(name, fmt_name)


def test_the_bound_detects_bfloat16_rounding():
    """Rounding the maps to bfloat16 moves each program's output or gradient by over five times RTOL."""
    x = jnp.asarray(MAPS)
    rounded = x.astype(jnp.bfloat16).astype(jnp.float32)
    for name, fn in PROGRAMS.items():
        moved = max(
            relative_distance(as_float64(jax.jit(program)(rounded)), as_float64(jax.jit(program)(x)))
            for program in (fn, _gradient(fn))
        )
        assert moved > 5 * RTOL, f"{name}: bfloat16 rounding moved it only {moved:.1e}"
