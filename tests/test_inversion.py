"""Null-text inversion (Mokady et al. 2023) on tiny real-class Stable Diffusion components."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lance_pipeline.editing.inversion import (  # noqa: E402
    NullTextInversion,
    ddim_inversion,
    ddim_sample,
    encode_image,
    encode_prompts,
)

STEPS = 8
SIZE = 32
CAPTION = "a photo of a dog on the grass"


pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(scope="module")
def image():
    rng = np.random.RandomState(0)
    return Image.fromarray((rng.rand(SIZE, SIZE, 3) * 255).astype("uint8"))


def _weights_digest(module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_null_text_lowers_reconstruction_error_at_guidance_7_5(tiny_sd, image):
    before = _weights_digest(tiny_sd.unet)
    inverter = NullTextInversion(
        tiny_sd.unet,
        tiny_sd.vae,
        tiny_sd.text_encoder,
        tiny_sd.tokenizer,
        tiny_sd.scheduler_config,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        image_size=SIZE,
    )
    result = inverter.invert(image, CAPTION)
    z0 = encode_image(tiny_sd.vae, image, SIZE)
    assert torch.equal(result.pivot_latents[0], z0)
    assert result.null_embeddings.shape == (STEPS, tiny_sd.tokenizer.model_max_length, 32)
    assert len(result.inner_steps) == STEPS and all(1 <= k <= 10 for k in result.inner_steps)

    cond = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, [CAPTION])
    empty = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, [""]).expand(STEPS, -1, -1)
    # Plain DDIM inversion: sample from the same x_T with the unoptimised null embedding at guidance 7.5.
    plain = ddim_sample(tiny_sd.unet, tiny_sd.scheduler_config, result.latent, cond, empty, 7.5)
    optimised = ddim_sample(tiny_sd.unet, tiny_sd.scheduler_config, result.latent, cond, result.null_embeddings, 7.5)
    plain_error = torch.nn.functional.mse_loss(plain, z0).item()
    optimised_error = torch.nn.functional.mse_loss(optimised, z0).item()
    assert optimised_error < 0.8 * plain_error, (optimised_error, plain_error)
    # The optimisation never touched the shared UNet.
    assert _weights_digest(tiny_sd.unet) == before
    assert all(p.grad is None for p in tiny_sd.unet.parameters())


def test_early_stop_and_learning_schedule(tiny_sd, image):
    common = dict(num_inference_steps=4, guidance_scale=7.5, image_size=SIZE)
    args = (tiny_sd.unet, tiny_sd.vae, tiny_sd.text_encoder, tiny_sd.tokenizer, tiny_sd.scheduler_config)
    loose = NullTextInversion(*args, early_stop_epsilon=1e3, **common).invert(image, CAPTION)
    assert loose.inner_steps == [1, 1, 1, 1]
    none = NullTextInversion(*args, num_inner_steps=0, **common).invert(image, CAPTION)
    assert none.inner_steps == [0, 0, 0, 0]
    # Without optimisation every null embedding stays the empty prompt's embedding.
    empty = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, [""])[0]
    assert all(torch.equal(e, empty) for e in none.null_embeddings)
    assert not torch.equal(loose.null_embeddings[0], empty)


def test_ddim_inversion_follows_the_scheduler_config(tiny_sd, image):
    """The first inversion step uses the checkpoint's alphas with set_alpha_to_one=False and steps_offset=1."""
    z0 = encode_image(tiny_sd.vae, image, SIZE)
    cond = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, [CAPTION])
    pivots = ddim_inversion(tiny_sd.unet, tiny_sd.scheduler_config, z0, cond, 2)
    assert len(pivots) == 3
    config = tiny_sd.scheduler_config
    betas = torch.linspace(config["beta_start"] ** 0.5, config["beta_end"] ** 0.5, 1000, dtype=torch.float32) ** 2
    alphas = torch.cumprod(1 - betas, 0)
    first_t = 1  # steps_offset
    with torch.no_grad():
        eps = tiny_sd.unet(z0, first_t, encoder_hidden_states=cond).sample
    a_from, a_to = alphas[0], alphas[first_t]  # from "t = -499" (alphas[0], not 1) to t = 1
    x0_pred = (z0 - (1 - a_from).sqrt() * eps) / a_from.sqrt()
    expected = a_to.sqrt() * x0_pred + (1 - a_to).sqrt() * eps
    assert torch.allclose(pivots[1], expected, atol=1e-5)
    # The latent is the posterior mean scaled by the VAE's configured factor.
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
    with torch.no_grad():
        raw = tiny_sd.vae.encode(pixels).latent_dist.mean
    assert torch.allclose(z0, raw * tiny_sd.vae.config.scaling_factor)


class PlainDDIMInversion:
    """A minimal inversion method written in a test: DDIM inversion without optimisation (the recipe test)."""

    name = "plain_ddim_test"

    def __init__(self, components, options):
        self.components, self.options = components, options

    def invert(self, images, captions):
        c, o = self.components, self.options
        out = []
        for image, caption in zip(images, captions, strict=True):
            cond = encode_prompts(c.tokenizer, c.text_encoder, [caption])
            latent = encode_image(c.vae, image, o.image_size)
            trajectory = ddim_inversion(c.unet, c.scheduler_config, latent, cond, o.num_inference_steps)
            null = encode_prompts(c.tokenizer, c.text_encoder, [""])[0]
            out.append(
                {
                    "latent": trajectory[-1].float().cpu(),
                    "null_embeddings": null.expand(o.num_inference_steps, -1, -1).float().cpu(),
                    "caption": caption,
                    "method": self.name,
                    "inner_steps": [],
                }
            )
        return out

    def describe(self):
        return {"method": self.name}


def test_an_inversion_method_registered_from_a_test_runs_in_the_stages(tiny_sd_dir, image):
    from lance_pipeline.editing.inversion import InversionMethod
    from lance_pipeline.editing.stages import InversionStage, ReconstructionStage
    from lance_pipeline.registry import INVERSIONS

    assert isinstance(PlainDDIMInversion(None, None), InversionMethod)
    INVERSIONS.register("plain_ddim_test", f"{__name__}:PlainDDIMInversion")
    try:
        opts = {
            "model": str(tiny_sd_dir),
            "image_size": SIZE,
            "num_inference_steps": STEPS,
            "inversion": "plain_ddim_test",
        }
        stage = InversionStage(**opts)
        stage.load("cpu")
        (update,) = stage.process([{"key": "k", "image": image, "caption": CAPTION}])
        assert update["inversion"]["method"] == "plain_ddim_test" and stage.describe()["inversion"] == "plain_ddim_test"
        reconstruct = ReconstructionStage(**opts)
        reconstruct.load("cpu")
        (rebuilt,) = reconstruct.process([{"key": "k", "caption": CAPTION, **update}])
        assert rebuilt["reconstruction"].size == (SIZE, SIZE)
    finally:
        INVERSIONS._targets.pop("plain_ddim_test")
    with pytest.raises(ValueError, match="unknown inversion method 'nul_text'.*did you mean 'null_text'"):
        InversionStage(model=str(tiny_sd_dir), inversion="nul_text")


@pytest.mark.slow
def test_batched_null_text_equals_one_image_at_a_time_and_gives_the_reconstruction(tiny_sd, image):
    """Null-text over a batch of images follows each image's own schedule (Adam state, early stop)."""
    from lance_pipeline.editing.cost import count_unet_evaluations
    from lance_pipeline.editing.inversion import NullTextMethod, decode_latents
    from lance_pipeline.editing.options import ImageEditorOptions

    steps = 5
    rng = np.random.RandomState(1)
    other = Image.fromarray((rng.rand(SIZE, SIZE, 3) * 255).astype("uint8"))
    images, captions = [image, other, image], [CAPTION, "a photo of a cat on a sofa", "a dog"]
    # early_stop_epsilon chosen so that the images stop after different numbers of iterations.
    opts = dict(num_inference_steps=steps, image_size=SIZE, num_inner_steps=4, early_stop_epsilon=0.1)
    single = NullTextInversion(
        tiny_sd.unet, tiny_sd.vae, tiny_sd.text_encoder, tiny_sd.tokenizer, tiny_sd.scheduler_config, **opts
    )
    references = [single.invert(im, cap) for im, cap in zip(images, captions, strict=True)]
    method = NullTextMethod(tiny_sd, ImageEditorOptions(model=str(tiny_sd.model), **opts))
    with count_unet_evaluations(tiny_sd.unet) as count:
        batched = method.invert(images, captions)
    used = [r.inner_steps for r in references]
    assert len({tuple(u) for u in used}) > 1, used  # the test exercises different early stops
    for reference, result in zip(references, batched, strict=True):
        assert result["inner_steps"] == reference.inner_steps
        torch.testing.assert_close(result["latent"], reference.latent, rtol=0, atol=1e-5)
        # Float tolerance: batching changes rounding (~1e-7), and Adam's normalised update (m / sqrt(v)) amplifies it
        # in the few elements whose gradient is near eps; a batch of one agrees to 1e-7 after the first step.
        torch.testing.assert_close(result["null_embeddings"], reference.null_embeddings, rtol=0, atol=2e-3)
    # One UNet call per phase for the whole batch: 3 images ride in every call (converged ones included).
    iterations = [max(u[i] for u in used) for i in range(steps)]
    assert count.forwards == 3 * (steps + steps + sum(iterations) + 2 * steps)
    assert count.backwards == 3 * sum(iterations)
    # The final latent of the optimisation is the reconstruction's (same guided steps, same embeddings).
    for reference, result in zip(references, batched, strict=True):
        cond = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, [result["caption"]])
        sampled = ddim_sample(
            tiny_sd.unet, tiny_sd.scheduler_config, reference.latent, cond, reference.null_embeddings, 7.5
        )
        torch.testing.assert_close(result["reconstruction_latent"], sampled, rtol=0, atol=2e-3)
        a = np.asarray(decode_latents(tiny_sd.vae, result["reconstruction_latent"])[0], dtype=np.int16)
        b = np.asarray(decode_latents(tiny_sd.vae, sampled)[0], dtype=np.int16)
        assert np.abs(a - b).max() <= 1


def test_long_loops_show_a_progress_bar(tiny_sd, image, monkeypatch):
    import tqdm.auto

    seen = []

    class Recorder:
        def __init__(self, iterable, desc=None, total=None, leave=True, disable=False, unit=None):
            seen.append((desc, leave, disable))
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    latent = encode_image(tiny_sd.vae, image, SIZE)
    cond = encode_prompts(tiny_sd.tokenizer, tiny_sd.text_encoder, [CAPTION])
    ddim_inversion(tiny_sd.unet, tiny_sd.scheduler_config, latent, cond, 2)
    # Shown under the build's bar, removed when done, and off when stderr is not a terminal (disable=None).
    assert seen == [("DDIM inversion x1", False, None)]
