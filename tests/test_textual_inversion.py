"""Textual inversion (dataset interfaces' class tokens) on the tiny Stable Diffusion: real diffusers classes."""

from __future__ import annotations

import pytest
import torch
from builder_helpers import photo

from lance_pipeline.interfaces.textual_inversion import (
    TextualInversionOptions,
    TextualInversionTrainer,
    load_token,
    save_token,
    token_for_class,
)

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def _options(tiny_sd_dir, **overrides):
    settings = {"model": str(tiny_sd_dir), "revision": None, "steps": 30, "resolution": 32, "learning_rate": 5e-2}
    return TextualInversionOptions(**{**settings, **overrides})


@pytest.fixture(scope="module")
def trained(tiny_sd_dir):
    trainer = TextualInversionTrainer(_options(tiny_sd_dir))
    trainer.load()
    before = trainer.text_encoder.get_input_embeddings().weight.detach().clone()
    images = [photo(i, (40, 48)) for i in range(4)]
    learned = trainer.learn(images, "dog sled", token_for_class("dog sled", 537))
    return trainer, before, learned


@pytest.mark.slow
def test_only_the_new_row_changes_and_its_norm_is_held(trained):
    trainer, before, learned = trained
    after = trainer.text_encoder.get_input_embeddings().weight.detach()
    token_id = trainer.tokenizer.convert_tokens_to_ids(learned.token)
    assert after.shape[0] == before.shape[0] + 1 and token_id == before.shape[0]
    assert torch.equal(after[:token_id], before)  # every old row bit-identical
    pieces = trainer.tokenizer("dog sled", add_special_tokens=False).input_ids
    init = before[pieces].mean(0)
    assert not torch.allclose(after[token_id], init)  # the token moved ...
    assert after[token_id].norm().item() == pytest.approx(init.norm().item(), rel=1e-5)  # ... on the init's sphere
    for module in (trainer.unet, trainer.vae):
        assert not any(p.requires_grad for p in module.parameters())


@pytest.mark.slow
def test_training_lowers_the_loss(trained):
    losses = trained[2].losses
    assert len(losses) == 30
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first, (first, last)


@pytest.mark.slow
def test_training_is_deterministic(tiny_sd_dir, trained):
    again = TextualInversionTrainer(_options(tiny_sd_dir))
    learned = again.learn([photo(i, (40, 48)) for i in range(4)], "dog sled", token_for_class("dog sled", 537))
    assert torch.equal(learned.embedding, trained[2].embedding)


@pytest.mark.slow
def test_token_round_trips_through_diffusers_load_textual_inversion(tiny_sd_dir, trained, tmp_path):
    from diffusers import StableDiffusionPipeline

    learned = trained[2]
    path = save_token(tmp_path / "537.safetensors", learned)
    token, embedding = load_token(path)
    assert token == learned.token and torch.equal(embedding, learned.embedding)
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_sd_dir), safety_checker=None, requires_safety_checker=False)
    pipe.load_textual_inversion(str(path))
    token_id = pipe.tokenizer.convert_tokens_to_ids(learned.token)
    assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[token_id].detach(), learned.embedding)


@pytest.mark.slow
def test_released_imagenet_star_bin_loads_without_unpickling_objects(tmp_path, trained):
    learned = trained[2]
    plain = tmp_path / "0.bin"
    torch.save({"<tench-0>": learned.embedding.clone()}, plain)
    assert load_token(plain)[0] == "<tench-0>"

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "1.bin"
    torch.save({"<goldfish-1>": Evil()}, evil)
    with pytest.raises(ValueError, match="not a plain token file"):
        load_token(evil)


def test_bad_options_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="resolution"):
        TextualInversionOptions(resolution=30)
    with pytest.raises(ValueError, match="templates"):
        TextualInversionOptions(templates=("a photo of a dog",))


@pytest.mark.slow
def test_learn_tokens_command_learns_each_class_once_and_resumes(tiny_sd_dir, tmp_path, capsys, lance_cf):
    import json

    from builder_helpers import make_imagefolder

    from lance_pipeline.interfaces.textual_inversion import load_token

    photos = make_imagefolder(tmp_path / "photos", ["n01440764", "n01443537"], 2)  # tench, goldfish synsets
    out = tmp_path / "tokens"
    args = ["interfaces", "learn-tokens", "--source", f"imagefolder:{photos}", "--output", str(out),
            "--model", str(tiny_sd_dir), "--steps", "2", "--resolution", "32", "--no-progress", "--device", "cpu"]  # fmt: skip
    code, stdout, _ = lance_cf(*args)
    assert code == 0 and "learned 2 token(s)" in stdout
    index = json.loads((out / "tokens.json").read_text())
    assert {info["token"] for info in index["classes"].values()} == {"<tench-0>", "<goldfish-1>"}
    assert load_token(out / "0.safetensors")[0] == "<tench-0>"
    # A killed run leaves finished classes in place: remove one, re-run, only that class is learned again.
    kept = (out / "1.safetensors").read_bytes()
    (out / "0.safetensors").unlink()
    code, stdout, err = lance_cf(*args)
    assert code == 0 and "learned 1 token(s)" in stdout and "resuming with 1" in err
    assert (out / "1.safetensors").read_bytes() == kept
    # Other settings into the same directory are refused in one line.
    code, _, err = lance_cf(*[a if a != "2" else "3" for a in args])
    assert code == 2 and "other settings" in err and len(err.strip().splitlines()) == 1


def _madrylab_reference(tiny_sd_dir, image, class_name, token, steps, lr, weight_decay, seed):
    """MadryLab's norm constraint written out independently: their ``SplitEmbedding`` (frozen main rows, one free
    auxiliary row scaled to the initialiser's norm in the forward pass) under AdamW, on the same draws as ours."""
    import numpy as np
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tiny_sd_dir, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(tiny_sd_dir, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(tiny_sd_dir, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(tiny_sd_dir, subfolder="unet")
    scheduler = DDPMScheduler.from_pretrained(tiny_sd_dir, subfolder="scheduler")
    for module in (text_encoder, vae, unet):
        module.requires_grad_(False)
    init = text_encoder.get_input_embeddings().weight[tokenizer(class_name, add_special_tokens=False).input_ids].mean(0)
    tokenizer.add_tokens(token)
    main = text_encoder.get_input_embeddings().weight.detach().clone()
    aux = torch.nn.Parameter(init.clone()[None])
    target = init.norm()

    class SplitEmbedding(torch.nn.Module):
        def forward(self, ids):
            normalised = aux * target / torch.linalg.norm(aux, dim=1, keepdim=True)
            return torch.cat([main, normalised])[ids]

    text_encoder.set_input_embeddings(SplitEmbedding())
    optimizer = torch.optim.AdamW([aux], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.from_numpy(np.asarray(image.convert("RGB").resize((32, 32)), dtype=np.float32) / 127.5 - 1)
    pixels = pixels.permute(2, 0, 1)[None]
    ids = tokenizer([f"a photo of a {token}"], padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids  # fmt: skip
    for _ in range(steps):
        with torch.no_grad():
            posterior = vae.encode(pixels).latent_dist
            latents = (posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)) * (
                vae.config.scaling_factor
            )
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (1,), generator=generator)
        predicted = unet(scheduler.add_noise(latents, noise, timesteps), timesteps, text_encoder(ids)[0]).sample
        target_value = (
            noise
            if scheduler.config.prediction_type == "epsilon"
            else scheduler.get_velocity(latents, noise, timesteps)
        )
        loss = F.mse_loss(predicted, target_value)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (aux * target / aux.norm()).detach()[0]


@pytest.mark.slow
def test_norm_constraint_is_madrylabs_reparameterised_row(tiny_sd_dir):
    from lance_pipeline.interfaces.textual_inversion import _seed_for

    image = photo(3, (32, 32))
    token = token_for_class("dog sled", 537)
    settings = {"steps": 4, "learning_rate": 5e-2, "weight_decay": 0.5, "flip_p": 0.0,
                "templates": ("a photo of a {}",)}  # fmt: skip
    ours = TextualInversionTrainer(_options(tiny_sd_dir, **settings)).learn([image], "dog sled", token)
    reference = _madrylab_reference(str(tiny_sd_dir), image, "dog sled", token, 4, 5e-2, 0.5, _seed_for(0, token))
    assert torch.allclose(ours.embedding, reference, atol=1e-6), (ours.embedding - reference).abs().max()
    # The projection variant is another dynamic; and under the reference's, weight decay acts (on the free vector).
    rescaled = TextualInversionTrainer(_options(tiny_sd_dir, norm_constraint="rescale", **settings)).learn(
        [image], "dog sled", token
    )
    assert not torch.allclose(rescaled.embedding, reference, atol=1e-4)
    no_decay = TextualInversionTrainer(_options(tiny_sd_dir, **{**settings, "weight_decay": 0.0})).learn(
        [image], "dog sled", token
    )
    assert not torch.allclose(no_decay.embedding, ours.embedding, atol=1e-6)
    assert ours.embedding.norm().item() == pytest.approx(ours.initializer_norm, rel=1e-5)
