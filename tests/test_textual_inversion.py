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


def test_training_lowers_the_loss(trained):
    losses = trained[2].losses
    assert len(losses) == 30
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first, (first, last)


def test_training_is_deterministic(tiny_sd_dir, trained):
    again = TextualInversionTrainer(_options(tiny_sd_dir))
    learned = again.learn([photo(i, (40, 48)) for i in range(4)], "dog sled", token_for_class("dog sled", 537))
    assert torch.equal(learned.embedding, trained[2].embedding)


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


def _run(capsys, *args):
    """The CLI in this process (no interpreter start-up per call), with its exit code and output."""
    from builder.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_learn_tokens_command_learns_each_class_once_and_resumes(tiny_sd_dir, tmp_path, capsys):
    import json

    from builder_helpers import make_imagefolder

    from lance_pipeline.interfaces.textual_inversion import load_token

    photos = make_imagefolder(tmp_path / "photos", ["n01440764", "n01443537"], 2)  # tench, goldfish synsets
    out = tmp_path / "tokens"
    args = ["interfaces", "learn-tokens", "--source", f"imagefolder:{photos}", "--output", str(out),
            "--model", str(tiny_sd_dir), "--steps", "2", "--resolution", "32", "--no-progress", "--device", "cpu"]  # fmt: skip
    code, stdout, _ = _run(capsys, *args)
    assert code == 0 and "learned 2 token(s)" in stdout
    index = json.loads((out / "tokens.json").read_text())
    assert {info["token"] for info in index["classes"].values()} == {"<tench-0>", "<goldfish-1>"}
    assert load_token(out / "0.safetensors")[0] == "<tench-0>"
    # A killed run leaves finished classes in place: remove one, re-run, only that class is learned again.
    kept = (out / "1.safetensors").read_bytes()
    (out / "0.safetensors").unlink()
    code, stdout, err = _run(capsys, *args)
    assert code == 0 and "learned 1 token(s)" in stdout and "resuming with 1" in err
    assert (out / "1.safetensors").read_bytes() == kept
    # Other settings into the same directory are refused in one line.
    code, _, err = _run(capsys, *[a if a != "2" else "3" for a in args])
    assert code == 2 and "other settings" in err and len(err.strip().splitlines()) == 1
