"""Run Hugging Face diffusers' Flax models and Stable Diffusion pipelines, unchanged, under ``scalify``.

    python scripts/run_diffusers_flax.py                      # pip download diffusers (DIFFUSERS_VERSION)
    python scripts/run_diffusers_flax.py --source DIR         # an unpacked diffusers wheel with its pins
    python scripts/run_diffusers_flax.py --formats all --markdown
    python scripts/run_diffusers_flax.py --recipes all        # scalify.recipes.apply on the training losses

The models are the ``Flax*`` classes of ``diffusers`` 0.39 (the last release with Flax; 0.40
removed them), built at a tiny size through their constructors (latents 4 x 16 x 16, channels
(32, 64), one layer per block, heads of 32, text width 32, 8 prompt tokens), initialised by the
library (``init_weights``), and called as its training examples and pipelines call them. Nothing of
them is copied here.

Training checks, each a loss of diffusers' training scripts on one random batch, its gradient and
one Adam update (the third-party harness's check and tolerance: every weight the format accepts
becomes a ScaledArray, the reference is float32 on the dequantized weights):

* ``unet_sd``: Stable Diffusion 1.x's UNet (cross-attention transformers between 1x1-convolution
  projections, GroupNorm, sinusoidal timestep embedding), the noise-prediction loss on latents
  noised by ``FlaxDDPMScheduler.add_noise`` at two timesteps;
* ``unet_v``: SD 2.x's variant: linear projections, ``split_head_dim``, the v-prediction target
  (``get_velocity``);
* ``unet_memeff``: ``use_memory_efficient_attention`` (attention computed in query and key chunks
  under ``lax.map`` and ``lax.scan``, as in Rabe and Staats);
* ``unet_sdxl``: SDXL's UNet: two transformer layers per block and the ``text_time`` additional
  embedding (pooled text and six size/crop conditions);
* ``controlnet``: ``FlaxControlNetModel`` (its conditioning embedding, zero-initialised
  convolutions) whose residuals feed the UNet, as ``train_controlnet_flax.py`` trains it;
* ``vae``: ``FlaxAutoencoderKL``: encode, a reparameterised sample of the posterior from a PRNG key,
  decode; reconstruction error plus the KL term.

Generation checks run a pipeline's own ``_generate`` (what ``pipeline(...)`` calls, under
``jax.pmap`` with ``jit=True``) as ``jax.jit(scalify.scalify(...))`` with the text encoders, UNet,
ControlNet and VAE weights in the format and the scheduler state in float32, three denoising steps
with classifier-free guidance:
``sd_ddim`` (``FlaxStableDiffusionPipeline``, DDIM), ``sd_dpm`` (the same with DPM-Solver++
multistep, whose state carries earlier model outputs through the ``fori_loop``), ``sd_img2img``
(``FlaxStableDiffusionImg2ImgPipeline``: the VAE encodes an image, noise is added at the start
step), ``sd_controlnet`` (``FlaxStableDiffusionControlNetPipeline``) and ``sdxl``
(``FlaxStableDiffusionXLPipeline``: two CLIP text encoders, one with a projection, and the pooled
embedding). The decoded images must equal float32's within the harness's tolerance.

With ``--recipes`` the float32 weights stay as they are and each training loss runs as
``recipes.apply(loss, recipe)`` under ``jax.value_and_grad`` (``run_keras_hub_models.check_recipe``)
at 32 images and 32 prompt tokens (the VAE's of 64 x 64), so that the weight gradients' sums over
the batch (a convolution's, and the UNet's timestep-embedding layers') are multiples of MX's block;
generation is ``n/a`` there. The UNet's first convolution has 4 input channels and its last 4
output channels, the VAE's 3, and the VAE's 1x1 convolutions around the latents
(``quant_conv``, ``post_quant_conv``) 8 and 4, which no block format can block: pass
``--high-precision-scopes conv_in,conv_out,quant_conv,post_quant_conv`` (Transformer Engine keeps
first and last layers in high precision too).

The pipelines import ``transformers`` (the CLIP text encoders); diffusers 0.39 and transformers
4.57 share ``huggingface_hub`` 0.36, and the script downloads the four wheels (``pip download
--no-deps``) and puts them first on ``sys.path``, leaving the installed packages as they are, so the
tests run it in a subprocess.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _jax_scalify_source import fetch_wheels  # noqa: E402
from run_flax_examples import failure  # noqa: E402
from run_hf_flax_models import WHEELS as TRANSFORMERS_WHEELS  # noqa: E402
from run_hf_flax_models import import_transformers  # noqa: E402
from run_keras_hub_models import check, check_recipe  # noqa: E402
from run_recurrentgemma import run_table  # noqa: E402
from thirdparty_harness import Case, assert_tree_close, dequantize_tree, n_scaled, quantize_tree  # noqa: E402

import scalify  # noqa: E402

# The version the figures in docs/examples.md were measured with.
DIFFUSERS_VERSION = "0.39.0"
WHEELS = (f"diffusers=={DIFFUSERS_VERSION}", *TRANSFORMERS_WHEELS)
BATCH, RECIPE_BATCH = 2, 32
CHANNELS, LATENT, SCALE = 4, 16, 8  # latents 4 x 16 x 16 of 128 x 128 images, as Stable Diffusion's VAE
TOKENS, RECIPE_TOKENS, VOCAB, TEXT_WIDTH = 8, 32, 64, 32
STEPS, GUIDANCE = 3, 7.5
IMAGE = LATENT * SCALE


def fetch(work: Path) -> Path:
    """:data:`WHEELS` (``pip download --no-deps``) unpacked under ``work``; the directory to import from."""
    return fetch_wheels(work, WHEELS, "Unpack those wheels into one directory and pass --source DIR.")


def import_diffusers(root: Path):
    """``diffusers`` imported from ``root`` (``transformers`` beside it), deprecation notices silenced."""
    hf = import_transformers(root)
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    return types.SimpleNamespace(diffusers=diffusers, transformers=hf)


def _normal(shape, seed: int):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _ids(seed: int, tokens: int = TOKENS, batch: int = BATCH):
    return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, (batch, tokens)), jnp.int32)


# The blocks of a two-level UNet; diffusers' ``attention_head_dim`` is the number of heads (its
# documented naming), so 1 gives heads of 32 at the first level.
UNET = {
    "sample_size": LATENT,
    "in_channels": CHANNELS,
    "out_channels": CHANNELS,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "attention_head_dim": 1,
    "cross_attention_dim": TEXT_WIDTH,
}
# SDXL's pooled text embedding (the second encoder's projection) and its six size/crop conditions.
POOLED, TIME_EMBED = 32, 8
SDXL = {
    "use_linear_projection": True,
    "transformer_layers_per_block": (2, 1),
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": TIME_EMBED,
    "projection_class_embeddings_input_dim": POOLED + 6 * TIME_EMBED,
    # Two text encoders side by side.
    "cross_attention_dim": 2 * TEXT_WIDTH,
}
UNETS = {
    "unet_sd": {},
    "unet_v": {"use_linear_projection": True, "split_head_dim": True},
    "unet_memeff": {"use_memory_efficient_attention": True},
    "unet_sdxl": SDXL,
}
VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (32, 32, 64, 64),
    "latent_channels": CHANNELS,
    "sample_size": IMAGE,
}
# Its conditioning embedding (diffusers' default) takes the 128 x 128 image to the latents' 16 x 16.
CONTROLNET = {k: v for k, v in UNET.items() if k not in ("out_channels", "up_block_types")}
# Stable Diffusion's noise schedule.
SCHEDULE = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}


def _unet(lib, name: str):
    unet = lib.diffusers.FlaxUNet2DConditionModel(**{**UNET, **UNETS.get(name, {})})
    return unet, unet.init_weights(jax.random.PRNGKey(0))


def _noising(lib, batch: int):
    """``(scheduler, state, (latents, noise, timesteps))``: a DDPM schedule and a batch to noise with it."""
    scheduler = lib.diffusers.FlaxDDPMScheduler(**SCHEDULE)
    shape = (batch, CHANNELS, LATENT, LATENT)
    timesteps = jnp.asarray(np.random.default_rng(2).integers(0, 1000, batch), jnp.int32)
    return scheduler, scheduler.create_state(), (_normal(shape, 0), _normal(shape, 1), timesteps)


def unet_case(lib, name: str, recipe_run: bool) -> Case:
    """Mean squared error of the UNet's prediction: the noise, or (``unet_v``) the velocity."""
    batch, tokens = (RECIPE_BATCH, RECIPE_TOKENS) if recipe_run else (BATCH, TOKENS)
    unet, params = _unet(lib, name)
    scheduler, state, noised = _noising(lib, batch)
    width = unet.cross_attention_dim
    added = {}
    if name == "unet_sdxl":
        added = {"text_embeds": _normal((batch, POOLED), 4), "time_ids": jnp.full((batch, 6), float(IMAGE))}

    def loss(params, batch):
        (latents, noise, timesteps), context, added = batch
        noisy = scheduler.add_noise(state, latents, noise, timesteps)
        target = scheduler.get_velocity(state, latents, noise, timesteps) if name == "unet_v" else noise
        pred = unet.apply({"params": params}, noisy, timesteps, context, added_cond_kwargs=added or None).sample
        return jnp.mean((pred - target) ** 2)

    return Case(name, loss, params, (noised, _normal((batch, tokens, width), 3), added))


def controlnet_case(lib, name: str, recipe_run: bool) -> Case:
    """The UNet's noise-prediction error with a ControlNet's residuals added, both trained."""
    batch, tokens = (RECIPE_BATCH, RECIPE_TOKENS) if recipe_run else (BATCH, TOKENS)
    unet, unet_params = _unet(lib, "unet_sd")
    controlnet = lib.diffusers.FlaxControlNetModel(**CONTROLNET)
    scheduler, state, noised = _noising(lib, batch)
    # Its zero convolutions start at zero; one step from zero would leave their gradient's rounding
    # untested, so they start where a trained ControlNet would be: small, nonzero.
    params = {"unet": unet_params, "controlnet": _perturb_zero_convs(controlnet.init_weights(jax.random.PRNGKey(1)))}

    def loss(params, batch):
        (latents, noise, timesteps), context, condition = batch
        noisy = scheduler.add_noise(state, latents, noise, timesteps)
        down, mid = controlnet.apply(
            {"params": params["controlnet"]}, noisy, timesteps, context, condition, train=True, return_dict=False
        )
        pred = unet.apply(
            {"params": params["unet"]},
            noisy,
            timesteps,
            context,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        ).sample
        return jnp.mean((pred - noise) ** 2)

    condition = _normal((batch, 3, IMAGE, IMAGE), 5)
    return Case(name, loss, params, (noised, _normal((batch, tokens, TEXT_WIDTH), 3), condition))


def _perturb_zero_convs(params):
    """Every all-zero weight set to small Gaussian values (seeded by its position)."""
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(
        tree, [0.02 * _normal(v.shape, 100 + i) if not jnp.any(v) else v for i, v in enumerate(leaves)]
    )


def vae_case(lib, name: str, recipe_run: bool) -> Case:
    """Reconstruction error of a posterior sample (a PRNG key in the batch) plus 1e-3 times the KL term.
    Under a recipe, 32 images of 64 x 64: a block recipe blocks a convolution's weight gradient along
    the batch, and attention's products along the mid-block's 8 x 8 tokens."""
    batch, size = (RECIPE_BATCH, IMAGE // 2) if recipe_run else (BATCH, IMAGE)
    vae = lib.diffusers.FlaxAutoencoderKL(**VAE)
    params = vae.init_weights(jax.random.PRNGKey(2))

    def loss(params, batch):
        images, key = batch
        posterior = vae.apply({"params": params}, images, method=vae.encode).latent_dist
        decoded = vae.apply({"params": params}, posterior.sample(key), method=vae.decode).sample
        return jnp.mean((decoded - images) ** 2) + 1e-3 * posterior.kl().mean()

    return Case(name, loss, params, (jnp.tanh(_normal((batch, 3, size, size), 6)), jax.random.PRNGKey(7)))


BUILDERS = {**dict.fromkeys(UNETS, unet_case), "controlnet": controlnet_case, "vae": vae_case}


# -- pipelines -------------------------------------------------------------------------------------
def _text_encoder(lib, projection: bool = False):
    hf = lib.transformers
    config = hf.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=TEXT_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=1,
        intermediate_size=64,
        max_position_embeddings=16,
        projection_dim=POOLED,
    )
    return (hf.FlaxCLIPTextModelWithProjection if projection else hf.FlaxCLIPTextModel)(config, seed=0)


def _pipeline(lib, name: str):
    """``(generate(weights, key), weights)`` for a generation check: ``generate`` is the pipeline's
    ``_generate`` on fixed prompts (and image) with the scheduler's state in float32, three steps,
    guidance 7.5."""
    d = lib.diffusers
    scheduler_cls = d.FlaxDPMSolverMultistepScheduler if name == "sd_dpm" else d.FlaxDDIMScheduler
    scheduler = scheduler_cls(**SCHEDULE)
    unet, unet_params = _unet(lib, "unet_sdxl" if name == "sdxl" else "unet_sd")
    vae = d.FlaxAutoencoderKL(**VAE)
    text = _text_encoder(lib)
    weights = {"unet": unet_params, "vae": vae.init_weights(jax.random.PRNGKey(2)), "text_encoder": text.params}
    parts = {"vae": vae, "text_encoder": text, "tokenizer": None, "unet": unet, "scheduler": scheduler}
    state = scheduler.create_state()
    prompt, negative = _ids(8), _ids(9)
    image = jnp.tanh(_normal((BATCH, 3, IMAGE, IMAGE), 10))
    if name == "sdxl":
        text_2 = _text_encoder(lib, projection=True)
        weights["text_encoder_2"] = text_2.params
        pipe = d.FlaxStableDiffusionXLPipeline(**parts, text_encoder_2=text_2, tokenizer_2=None)
        # (batch, encoder, tokens): one row of ids per text encoder.
        prompt, negative = jnp.stack([prompt, _ids(11)], 1), jnp.stack([negative, _ids(12)], 1)

        def generate(w, key):
            return pipe._generate(prompt, {**w, "scheduler": state}, key, STEPS, IMAGE, IMAGE, GUIDANCE, None, negative)

    elif name == "sd_controlnet":
        controlnet = d.FlaxControlNetModel(**CONTROLNET)
        weights["controlnet"] = _perturb_zero_convs(controlnet.init_weights(jax.random.PRNGKey(1)))
        pipe = d.FlaxStableDiffusionControlNetPipeline(
            **parts, controlnet=controlnet, safety_checker=None, feature_extractor=None
        )

        def generate(w, key):
            return pipe._generate(prompt, image, {**w, "scheduler": state}, key, STEPS, GUIDANCE, None, negative)

    elif name == "sd_img2img":
        pipe = d.FlaxStableDiffusionImg2ImgPipeline(**parts, safety_checker=None, feature_extractor=None)
        # Start at step 1 of 4: the image's latents, noised to the second timestep, then three steps.
        start = 1

        def generate(w, key):
            steps, params = STEPS + start, {**w, "scheduler": state}
            return pipe._generate(prompt, image, params, key, start, steps, IMAGE, IMAGE, GUIDANCE, None, negative)

    else:
        pipe = d.FlaxStableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None)

        def generate(w, key):
            return pipe._generate(prompt, {**w, "scheduler": state}, key, STEPS, IMAGE, IMAGE, GUIDANCE, None, negative)

    return generate, weights


GENERATE = ("sd_ddim", "sd_dpm", "sd_img2img", "sd_controlnet", "sdxl")
CHECKS = (*BUILDERS, *GENERATE)


def check_generate(lib, name: str, fmt) -> tuple[str, str]:
    """``(outcome, detail)`` of ``jit(scalify(generate))`` with the weights in ``fmt`` against float32's."""
    try:
        generate, weights = _pipeline(lib, name)
    except Exception as exc:  # a pipeline the library cannot build is a row of its own
        return failure(exc)
    qweights = quantize_tree(weights, fmt)
    if n_scaled(qweights) == 0:
        return "n/a", f"no weight has a shape {fmt.name} accepts"
    key = jax.random.PRNGKey(3)
    try:
        expected = jax.jit(generate)(dequantize_tree(qweights), key)
        got = jax.jit(scalify.scalify(generate))(qweights, key)
        # Classifier-free guidance, u + g (c - u), multiplies the rounding of c - u by g: measured on
        # sdxl, float32 itself moves by 6.5e-5 to 7.2e-5 when its weights move by one ulp, 4e-6 at g = 1
        # (scalify: 6.3e-5 and 3.3e-6). The harness's tolerance, made for one forward and backward
        # pass, is scaled by g (docs/examples.md).
        assert_tree_close(got, expected, fmt, f"{name} images", rtol_factor=GUIDANCE)
    except Exception as exc:  # reported per format; the run goes on
        return failure(exc)
    return "ok", f"images {tuple(expected.shape)} as float32's, {n_scaled(qweights)} weights scaled"


def run_check(lib, name: str, column, recipe_run: bool) -> tuple[str, str]:
    if name in GENERATE and recipe_run:
        return "n/a", "a recipe quantizes a training step's GEMMs"
    if name in GENERATE:
        return check_generate(lib, name, column)
    try:
        case = BUILDERS[name](lib, name, recipe_run)
    except Exception as exc:  # a model the library cannot build is a row of its own
        return failure(exc)
    return check_recipe(case, column) if recipe_run else check(case, column)


def main(argv=None) -> int:
    this = types.SimpleNamespace(
        __doc__=__doc__, package="diffusers", version=DIFFUSERS_VERSION, fetch=fetch, load=import_diffusers
    )
    return run_table(this, 14, CHECKS, run_check, argv)


if __name__ == "__main__":
    sys.exit(main())
