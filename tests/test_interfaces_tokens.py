"""Class-token folders attacked the way a careless or hostile user would: every bad file is refused in one line naming
it, before any image is generated; a folder that covers none of the build's classes fails in `validate`; a local
folder is recorded in the release by its name (and a digest), never by its machine path."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from lance_pipeline.tiny.image_components import TEXT_HIDDEN_SIZE

pytestmark = pytest.mark.usefixtures("single_thread_torch")
CLASSES = ["n01440764", "n01443537"]  # tench (0), goldfish (1)


def _token(path, token, vector):
    save_file({token: vector.reshape(1, -1).contiguous()}, str(path))


def _good(directory, labels=(0, 1)):
    directory.mkdir(parents=True, exist_ok=True)
    for label in labels:
        vector = torch.randn(TEXT_HIDDEN_SIZE, generator=torch.Generator().manual_seed(label)) * 0.05
        _token(directory / f"{label}.safetensors", f"<class-{label}>", vector)
    return directory


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    return create_tiny_open_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


def _config(tmp_path, tiny_sd_dir, clip_dir, tokens, shift_name="in_the_snow"):
    shifts = [{"name": "base", "prompt": "A photo of a <TOKEN>"},
              {"name": shift_name, "prompt": "A photo of a <TOKEN> in the snow", "shift_caption": "a photo in the snow",
               "threshold": -1.0}]  # fmt: skip
    configs = ["base", shift_name]
    data = {
        "name": "tokens-test",
        "safety": False,  # tiny random images; the safety stage is tested elsewhere
        "source": "generate:imagenet",
        "source_options": {"classes": CLASSES, "per_class": 1, "shifts": [], "custom_shifts": shifts},
        "configs": configs,
        "image_size": 16,
        "batch_size": 4,
        "stages": [
            {"name": "generate", "type": "shift_generation", "configs": configs,
             "options": {"model": str(tiny_sd_dir), "revision": None, "tokens": str(tokens), "num_inference_steps": 2,
                         "generation_size": 32, "image_size": 16, "batch_size": 4}},
            {"name": "filter", "type": "shift_filter", "configs": configs,
             "options": {"clip_model": str(clip_dir), "clip_pretrained": None, "object_filter": False}},
        ],
    }  # fmt: skip
    path = tmp_path / "tokens-test.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    "attack",
    ["nan", "inf", "integer", "complex", "two_files_one_label", "bin_and_safetensors", "arabic_digits", "superscript",
     "two_vectors", "same_token_twice", "widths_differ", "not_a_token_file"],
)  # fmt: skip
def test_bad_token_files_are_refused_in_validate_naming_the_file(
    attack, tmp_path, tiny_sd_dir, clip_dir, capsys, lance_cf
):
    tokens = _good(tmp_path / "tokens")
    vector = torch.full((TEXT_HIDDEN_SIZE,), 0.01)
    culprit = tokens / "1.safetensors"
    if attack == "nan":
        _token(culprit, "<class-1>", vector.clone().index_fill_(0, torch.tensor([3]), float("nan")))
    elif attack == "inf":
        _token(culprit, "<class-1>", vector.clone().index_fill_(0, torch.tensor([0]), float("inf")))
    elif attack == "integer":
        _token(culprit, "<class-1>", torch.ones(TEXT_HIDDEN_SIZE, dtype=torch.int64))
    elif attack == "complex":
        culprit = tokens / "1.bin"
        (tokens / "1.safetensors").unlink()
        torch.save({"<class-1>": torch.complex(vector, vector)}, culprit)
    elif attack == "two_files_one_label":
        culprit = tokens / "01.safetensors"
        _token(culprit, "<other-1>", vector)
    elif attack == "bin_and_safetensors":
        culprit = tokens / "1.safetensors"
        torch.save({"<other-1>": vector}, tokens / "1.bin")
    elif attack == "arabic_digits":
        culprit = tokens / "٣.safetensors"
        _token(culprit, "<class-3>", vector)
    elif attack == "superscript":
        culprit = tokens / "².bin"
        torch.save({"<class-2>": vector}, culprit)
    elif attack == "two_vectors":
        save_file({"<class-1>": torch.zeros(2, TEXT_HIDDEN_SIZE)}, str(culprit))
    elif attack == "same_token_twice":
        _token(culprit, "<class-0>", vector)
    elif attack == "widths_differ":
        _token(culprit, "<class-1>", torch.full((TEXT_HIDDEN_SIZE + 1,), 0.01))
    elif attack == "not_a_token_file":
        culprit.write_bytes(b"not safetensors at all")
    config = _config(tmp_path, tiny_sd_dir, clip_dir, tokens)
    code, _, err = lance_cf("validate", str(config))
    assert code == 2
    _one_line(err, culprit.name)
    out = tmp_path / "out"
    code, _, err = lance_cf("build", str(config), "--output", str(out), "--device", "cpu", "--no-progress")
    assert code == 2 and not out.exists()  # refused before anything was written
    _one_line(err, culprit.name)


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["wrong_width", "word_of_the_vocabulary", "huge_norm"])
def test_tokens_that_do_not_fit_the_text_encoder_are_refused_at_load_naming_the_file(
    attack, tmp_path, tiny_sd_dir, clip_dir, capsys, lance_cf
):
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    small = torch.full((TEXT_HIDDEN_SIZE,), 0.01)
    if attack == "wrong_width":
        for label in (0, 1):
            _token(tokens / f"{label}.safetensors", f"<class-{label}>", torch.full((TEXT_HIDDEN_SIZE * 2,), 0.01))
    else:
        _good(tokens, labels=(1,))
        if attack == "word_of_the_vocabulary":
            from transformers import CLIPTokenizer

            word = next(iter(CLIPTokenizer.from_pretrained(str(tiny_sd_dir), subfolder="tokenizer").get_vocab()))
            _token(tokens / "0.safetensors", word, small)
        else:
            _token(tokens / "0.safetensors", "<class-0>", small * 1e6)
    config = _config(tmp_path, tiny_sd_dir, clip_dir, tokens)
    assert lance_cf("validate", str(config))[0] == 0  # only the loaded text encoder can tell
    code, _, err = lance_cf("build", str(config), "--output", str(tmp_path / "out"), "--device", "cpu",
                        "--no-progress")  # fmt: skip
    assert code == 2
    _one_line(err, "0.safetensors")
    from builder_helpers import stored_stage_outputs

    assert stored_stage_outputs(tmp_path / "out") == 0  # not one image generated


def test_validate_refuses_tokens_that_cover_none_or_part_of_the_classes(
    tmp_path, tiny_sd_dir, clip_dir, capsys, lance_cf
):
    config = _config(tmp_path, tiny_sd_dir, clip_dir, _good(tmp_path / "none", labels=(5, 7)))
    code, _, err = lance_cf("validate", str(config))
    assert code == 2
    _one_line(err, "0 of the build's 2 class(es) have a token", "0 (tench)", "1 (goldfish)", "--classes")
    config = _config(tmp_path, tiny_sd_dir, clip_dir, _good(tmp_path / "part", labels=(1,)))
    code, _, err = lance_cf("validate", str(config))
    assert code == 2
    _one_line(err, "1 of the build's 2 class(es)", "0 (tench)")


def test_a_long_shift_name_fails_validate_not_the_build(tmp_path, tiny_sd_dir, clip_dir, capsys, lance_cf):
    config = _config(tmp_path, tiny_sd_dir, clip_dir, _good(tmp_path / "tokens"), shift_name="s" * 300)
    code, _, err = lance_cf("validate", str(config))
    assert code == 2
    _one_line(err, "at most 64")


@pytest.mark.slow
def test_a_local_token_folder_is_recorded_by_name_and_digest(tmp_path, tiny_sd_dir, clip_dir, capsys, lance_cf):
    from builder.publish import local_paths

    tokens = _good(tmp_path / "my-tokens")
    config = _config(tmp_path, tiny_sd_dir, clip_dir, tokens)
    out = tmp_path / "release"
    code, _, err = lance_cf("build", str(config), "--output", str(out), "--device", "cpu", "--no-progress")
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text())
    # (the tiny models are local directories here too; how those are recorded is not the tokens' business)
    assert [key for key, _ in local_paths(manifest) if "token" in key] == []
    assert str(tokens) not in json.dumps(manifest) and str(tokens) not in (out / "README.md").read_text()
    stage = manifest["config"]["stages"][0]
    assert stage["options"]["tokens"] == "my-tokens" and stage["local_inputs"]["tokens"].startswith("sha256:")
    assert manifest["stages"]["generate"]["tokens"] == "my-tokens"
    assert manifest["stages"]["generate"]["tokens_sha256"].startswith("sha256:")
    # the same folder elsewhere is the same config: the build resumes (nothing to do), byte-identical
    moved = tmp_path / "elsewhere" / "my-tokens"
    moved.parent.mkdir()
    tokens.rename(moved)
    before = (out / "manifest.json").read_bytes()
    code, _, err = lance_cf("build", str(_config(tmp_path, tiny_sd_dir, clip_dir, moved)), "--output", str(out),
                        "--device", "cpu", "--no-progress")  # fmt: skip
    assert code == 0, err
    assert (out / "manifest.json").read_bytes() == before
    # other token contents under the same name are another config: the resume is refused
    _token(moved / "1.safetensors", "<class-1>", torch.full((TEXT_HIDDEN_SIZE,), 0.02))
    code, _, err = lance_cf("build", str(_config(tmp_path, tiny_sd_dir, clip_dir, moved)), "--output", str(out),
                        "--device", "cpu", "--no-progress")  # fmt: skip
    assert code == 2 and "config" in err
