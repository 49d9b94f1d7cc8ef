"""Models as a first-class step: ``lance-cf models list|download`` and the check every build runs before its stages
load, against the Hub double (a real HTTP server on 127.0.0.1), a port that refuses connections and one that accepts
them and never answers."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from builder_helpers import REPO, make_imagefolder, short_diffusion, write_config
from hub_double import TOKEN, HubDouble

from builder.cli import main
from lance_pipeline.models import hub_cache
from lance_pipeline.models.needs import TRANSFORMERS_FILES, open_clip_weights, select_files

STAGE = "tests.fake_stages:HubModelCaptionStage"


def _random_bytes(n: int, seed: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# A model repository as the Hub holds one: what the loader reads, and what it never needs (pickle, ONNX).
TINY_LM = {
    "config.json": b'{"model_type": "tiny"}',
    "model.safetensors": _random_bytes(300_000, 0),
    "tokenizer.json": b'{"version": "1.0"}',
    "merges.txt": b"a b\n",
    "pytorch_model.bin": _random_bytes(1000, 1),
    "onnx/model.onnx": _random_bytes(1000, 2),
    "README.md": b"---\nlicense: apache-2.0\n---\n# tiny\n",
}
NEEDED = select_files(list(TINY_LM), TRANSFORMERS_FILES)


@pytest.fixture
def hub(hub, tmp_path, monkeypatch):
    """The shared double (tests/conftest.py), serving a gated repo's files only to its token, as the Hub does."""
    hub.gate_reads = True
    _point_at(monkeypatch, tmp_path, hub.url)
    return hub


def _point_at(monkeypatch, tmp_path: Path, url: str) -> None:
    """huggingface_hub (in this process) at ``url``, with an empty cache, no token, online."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    # hf_hub_url builds file URLs from this template, made from HF_ENDPOINT when huggingface_hub was imported.
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)  # the test's uploads
    monkeypatch.setenv("LANCE_CF_CACHE", str(tmp_path / "lance-cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def push(hub: HubDouble, tmp_path: Path, repo_id: str, files: dict[str, bytes], gated: bool = False) -> str:
    from huggingface_hub import HfApi

    folder = tmp_path / "upload" / repo_id
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo_id)
    api.upload_folder(folder_path=folder, repo_id=repo_id)
    if gated:
        api.update_repo_settings(repo_id, gated="auto")
    return hub.resolve("models", repo_id, "main")


def hub_config(tmp_path: Path, options: dict, name: str = "hub.yaml") -> Path:
    photos = make_imagefolder(tmp_path / "photos", ["cat", "dog"], 1)
    stages = [{"name": "caption", "type": STAGE, "configs": ["reconstructed"], "options": options}]
    stages.append({"name": "edit", "type": "tests.fake_stages:FakeEditStage", "configs": ["reconstructed"]})
    return write_config(tmp_path / name, f"imagefolder:{photos}", stages=stages, configs=["original", "reconstructed"])


def cached_file(repo_id: str, commit: str, name: str, tmp_path: Path) -> Path:
    return tmp_path / "hf-cache" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit / name


def test_list_then_download_exactly_the_files_a_loader_reads(hub, tmp_path, capsys, monkeypatch):
    commit = push(hub, tmp_path, "org/tiny-lm", TINY_LM)
    config = hub_config(tmp_path, {"model": "org/tiny-lm", "revision": commit})
    size = sum(len(TINY_LM[name]) for name in NEEDED)

    assert main(["models", "list", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"org/tiny-lm@{commit}: {hub_cache.format_size(size)} in {len(NEEDED)} file(s)" in out
    assert "licence apache-2.0, not gated, not cached" in out and "stages[caption].options.model" in out
    assert (
        "pytorch_model.bin" not in out and "model.onnx" not in out and f"next: lance-cf models download {config}" in out
    )

    assert main(["models", "download", str(config), "--no-progress"]) == 0
    for name in NEEDED:
        assert cached_file("org/tiny-lm", commit, name, tmp_path).read_bytes() == TINY_LM[name]
    assert not cached_file("org/tiny-lm", commit, "pytorch_model.bin", tmp_path).exists()
    capsys.readouterr()

    # Offline, the kept file list makes the check exact: every file, its size and licence, without a request.
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    requests = len(hub.log)
    assert main(["models", "list", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"{hub_cache.format_size(size)} in {len(NEEDED)} file(s), licence apache-2.0, not gated, cached" in out
    assert "next:" not in out and len(hub.log) == requests
    cached_file("org/tiny-lm", commit, "tokenizer.json", tmp_path).unlink()  # one file gone: not cached any more
    assert main(["models", "list", str(config)]) == 0
    assert "not cached" in capsys.readouterr().out


def test_a_gated_model_without_a_token_is_named_and_nothing_is_downloaded(hub, tmp_path, capsys, monkeypatch):
    commit = push(hub, tmp_path, "org/gated-lm", TINY_LM, gated=True)
    config = hub_config(tmp_path, {"model": "org/gated-lm", "revision": commit})
    capsys.readouterr()  # the upload's own progress bars (shown when an earlier test enabled them) are not the command's

    assert main(["models", "download", str(config), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and "gated: accept its conditions" in lines[0] and "HF_TOKEN" in lines[0], lines
    assert "without the Hub: every key above also takes a local directory" in lines[2], lines
    assert lines[1].strip().startswith(f"org/gated-lm@{commit[:12]} (") and TOKEN not in "".join(lines)
    assert not (tmp_path / "hf-cache" / "models--org--gated-lm").exists()

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["models", "download", str(config), "--no-progress"]) == 0
    assert (
        cached_file("org/gated-lm", commit, "model.safetensors", tmp_path).read_bytes() == TINY_LM["model.safetensors"]
    )
    assert TOKEN not in capsys.readouterr().out


def test_local_dir_copies_and_a_config_pointing_at_them(hub, tmp_path, capsys):
    commit = push(hub, tmp_path, "org/tiny-lm", TINY_LM)
    config = hub_config(tmp_path, {"model": "org/tiny-lm", "revision": commit})
    local = tmp_path / "offline-models"

    assert main(["models", "download", str(config), "--local-dir", str(local), "--no-progress"]) == 0
    copy = local / "org--tiny-lm"
    assert sorted(
        p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file() and ".cache" not in p.parts
    ) == sorted([*NEEDED, hub_cache.LOCAL_MARKER])
    assert json.loads((copy / hub_cache.LOCAL_MARKER).read_text())["revision"] == commit
    from builder.config import load_config

    written = load_config(str(local / "hub.yaml"))
    assert written.stages[0].options == {"model": str(copy.resolve()), "revision": commit}
    capsys.readouterr()
    assert main(["models", "list", str(local / "hub.yaml")]) == 0
    assert f"{copy.resolve()}: local directory, exists" in capsys.readouterr().out


def test_a_build_without_its_models_stops_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """A port with nothing listening: every model named once, with its key, and the command that fetches them."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _point_at(monkeypatch, tmp_path, f"http://127.0.0.1:{port}")
    config = hub_config(tmp_path, {"model": "org/a", "revision": "a" * 40, "helper": "org/b"})
    out = tmp_path / "out"

    assert main(["build", str(config), "--output", str(out), "--device", "cpu", "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("lance-cf build: error: 2 model(s) needed are neither cached nor reachable")
    assert f"cannot connect to http://127.0.0.1:{port}" in lines[0]
    assert lines[1] == f"  org/a@{'a' * 12} (size unknown offline) for stages[caption].options.model"
    assert lines[2] == "  org/b@main (size unknown offline) for stages[caption].options.helper"
    assert "every key above also takes a local directory" in lines[3] and "demo presets" in lines[3]
    assert f"lance-cf models download {config}" in lines[4] and len(lines) == 5
    assert not out.exists()


def test_cpu_honesty_counts_the_unet_evaluations_and_asks_for_device_cpu():
    from builder.config import apply_overrides, load_config
    from builder.model_check import build_needs, check_cpu, unet_evaluations
    from builder.validation import validate_build

    lance = validate_build(apply_overrides(load_config("lance"), source="demo"))
    counts = unet_evaluations(lance)
    # docs/performance.md, counted with the UNet hook: null-text inversion at 50 steps x 10 iterations is 1,240.
    assert counts["invert"] == 1240 and counts["reconstruct"] == 100
    with pytest.raises(ValueError, match=r"would run on the CPU: 3 image\(s\) x [\d,]+ UNet evaluations") as err:
        check_cpu(lance, build_needs(lance), 3, None, 1)
    assert "pass --device cpu" in str(err.value)
    check_cpu(lance, build_needs(lance), 3, "cpu", 1)  # asked for: runs
    demo = validate_build(load_config("demo"))
    assert build_needs(demo) == []
    check_cpu(demo, build_needs(demo), 3, None, 1)  # tiny models: the demo runs on the CPU as it does


@pytest.mark.slow  # imports open_clip (and torch): seconds
def test_open_clip_weights_are_read_from_open_clips_own_table():
    """The table is read from open_clip's source (importing it costs seconds); it must say what open_clip says."""
    import open_clip

    checked = 0
    for name, tag in open_clip.list_pretrained():
        hub = open_clip.get_pretrained_cfg(name, tag).get("hf_hub")
        if hub:
            assert (
                open_clip_weights(name, tag)[0] == hub.strip("/").rsplit("/", 1)[0]
                if hub.count("/") == 2 and not hub.endswith("/")
                else hub.strip("/")
            )
            checked += 1
    assert checked > 50
    assert open_clip_weights("ViT-L-14", "openai") == (
        "timm/vit_large_patch14_clip_224.openai",
        "open_clip_model.safetensors",
    )


# -- processes: what a user sees -------------------------------------------------------------------------------------
def _env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.startswith("HF_") and not k.endswith("_OFFLINE")
    }
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_XET="1",
        NO_PROXY="127.0.0.1,localhost",
        LANCE_CF_CACHE=str(tmp_path / "lance-cache"),
        PYTHONPATH=str(REPO) + os.pathsep + str(REPO / "tests"),
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.mark.e2e
@pytest.mark.parametrize("network", ["refuses", "hangs"])
def test_without_network_a_build_says_everything_once(network, tmp_path):
    """No retry storm: nothing but the error, each line once, on a network that refuses and on one that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    if network == "refuses":
        server.close()
    else:
        server.listen(64)  # the kernel accepts connections; nothing ever answers
    try:
        config = hub_config(tmp_path, {"model": "org/a", "revision": "a" * 40, "helper": "org/b"})
        proc = subprocess.run(
            [sys.executable, "-m", "builder.cli", "build", str(config), "--output", str(tmp_path / "out")],
            env=_env(tmp_path, f"http://127.0.0.1:{port}"), capture_output=True, text=True, cwd=tmp_path,
        )  # fmt: skip
    finally:
        server.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == ""
    reason = "cannot connect to" if network == "refuses" else "no answer from"
    assert lines[0].startswith("lance-cf build: error: 2 model(s)") and reason in lines[0], proc.stderr
    assert len(lines) == 5 and len(set(lines)) == 5, proc.stderr
    assert not (tmp_path / "out").exists()


DOWNLOAD_CHUNK = 64 * 1024
DOWNLOAD = rf"""
import sys
from huggingface_hub import constants
constants.DOWNLOAD_CHUNK_SIZE = {DOWNLOAD_CHUNK}  # write to the partial file as the bytes come
from builder.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_a_killed_download_resumes_where_it_stopped(hub, tmp_path):
    big = _random_bytes(3_000_000, 3)
    commit = push(hub, tmp_path, "org/big-lm", {**TINY_LM, "model.safetensors": big})
    config = hub_config(tmp_path, {"model": "org/big-lm", "revision": commit})
    env = _env(tmp_path, hub.url)
    command = [sys.executable, "-c", DOWNLOAD, "models", "download", str(config), "--no-progress"]
    hub.faults.hold_downloads_after = sent = 1_000_000
    # The server holds after ``sent`` bytes; the client writes every whole chunk of them and then waits for more, so
    # the partial file stops at this size. Killed there, never earlier: the server having sent the bytes does not
    # mean the client has written them (on a busy machine it may not have read one yet).
    written = sent // DOWNLOAD_CHUNK * DOWNLOAD_CHUNK
    blobs = tmp_path / "hf-home" / "hub" / "models--org--big-lm" / "blobs"
    first = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while True:  # no deadline: a busy machine only takes longer
        partials = list(blobs.glob("*" + hub_cache.PARTIAL_SUFFIX)) if blobs.is_dir() else []
        if hub.faults.held_downloads and [p.stat().st_size for p in partials] == [written]:
            break
        try:
            first.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(f"the download ended before it was held: {first.communicate()}")
    first.kill()  # kill -9 in the middle of model.safetensors
    first.communicate()
    (partial,) = blobs.glob("*" + hub_cache.PARTIAL_SUFFIX)
    kept = partial.stat().st_size
    assert kept == written
    hub.faults.hold_downloads_after = None
    hub.faults.release.set()

    second = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert ("model.safetensors", f"bytes={kept}-") in hub.downloads  # resumed, not started again
    snapshot = tmp_path / "hf-home" / "hub" / "models--org--big-lm" / "snapshots" / commit
    assert hashlib.sha256((snapshot / "model.safetensors").read_bytes()).digest() == hashlib.sha256(big).digest()


DEMO_MODELS = ("tiny-blip2", "tiny-causal-lm", "tiny-masked-lm", "tiny-stable-diffusion", "tiny-open-clip",
               "tiny-safety-checker")  # fmt: skip


def demo_on_the_hub(hub: HubDouble, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The demo preset with its tiny models put on the Hub double as repos ``org/NAME`` and named there at their
    commits: the config and ``{name: commit}``."""
    import yaml

    from builder.model_refs import materialize_demo_component

    preset = yaml.safe_load((REPO / "builder" / "presets" / "demo.yaml").read_text())
    commits = {}
    for name in DEMO_MODELS:
        folder = materialize_demo_component(name)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        commits[name] = push(hub, tmp_path, f"org/{name}", files)
    for stage in preset["stages"]:
        options = stage["options"]
        for key, revision_key in (("model", "revision"), ("clip_model", "clip_revision")):
            value = options.get(key)
            if isinstance(value, str) and value.startswith("demo:"):
                name = value.removeprefix("demo:")
                options[key] = f"hf-hub:org/{name}" if key == "clip_model" else f"org/{name}"
                options[revision_key] = commits[name]
    hub_yaml = tmp_path / "demo-hub.yaml"
    hub_yaml.write_text(yaml.safe_dump(preset, sort_keys=False))
    return hub_yaml, commits


@pytest.mark.slow  # two tiny builds
def test_the_declared_files_are_all_the_real_loaders_read(hub, tmp_path, monkeypatch):
    """The demo's tiny models, put on the Hub double as repos, fetched by `models download` and loaded by the real
    loaders (transformers, diffusers, open_clip) with the Hub switched off: the declared files are enough, and the
    release's shards are byte-identical to those built from the local copies."""
    from huggingface_hub import constants

    from builder.config import apply_overrides, load_config
    from builder.engine import build

    hub_yaml, _ = demo_on_the_hub(hub, tmp_path)
    assert main(["models", "download", str(hub_yaml), "--no-progress"]) == 0
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the loaders may read only what was declared
    requests = len(hub.log)
    local, from_hub = tmp_path / "local", tmp_path / "hub-release"
    build(short_diffusion(apply_overrides(load_config("demo"), limit=2)), local, device="cpu", progress=False)
    build(short_diffusion(apply_overrides(load_config(str(hub_yaml)), limit=2)), from_hub, device="cpu", progress=False)
    assert len(hub.log) == requests
    shards = sorted(p.relative_to(local).as_posix() for p in (local / "data").rglob("*.tar"))
    assert shards and shards == sorted(p.relative_to(from_hub).as_posix() for p in (from_hub / "data").rglob("*.tar"))
    for shard in shards:
        assert (local / shard).read_bytes() == (from_hub / shard).read_bytes(), shard
    manifest = json.loads((from_hub / "manifest.json").read_text())
    assert "org/tiny-blip2" in json.dumps(manifest["stages"])  # the release names the Hub models it was built with


@pytest.mark.slow  # two tiny builds
def test_a_build_from_local_copies_names_the_hub_models_and_publishes(hub, tmp_path, monkeypatch, caplog):
    """The air-gapped flow of docs/models.md: `models download --local-dir` where the Hub answers, the build from the
    written config with the Hub switched off. The release names each model as a local copy of its Hub id at its
    commit and holds no path of the build machine, so it publishes without --allow-local-paths; two copies at two
    paths give the same bytes; a moved folder resumes; a changed copy is recorded by name and digest, and refused."""
    import re
    import shutil

    from builder_helpers import release_files
    from huggingface_hub import constants

    from builder.engine import BuildRefused, build

    hub_yaml, commits = demo_on_the_hub(hub, tmp_path)
    first = tmp_path / "gpu-a" / "models"
    assert main(["models", "download", str(hub_yaml), "--local-dir", str(first), "--no-progress"]) == 0
    second = shutil.copytree(first, tmp_path / "gpu-b" / "elsewhere")  # copied to another machine, another path

    written = (first / "demo-hub.yaml").read_text()

    def config_at(folder: Path) -> Path:  # the written config, its paths edited to where the copies are
        (folder / "demo-hub.yaml").write_text(written.replace(str(first.resolve()), str(folder.resolve())))
        return folder / "demo-hub.yaml"

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the GPU machine has no network
    requests = len(hub.log)
    out_a, out_b = tmp_path / "release-a", tmp_path / "release-b"
    for folder, out in ((first, out_a), (second, out_b)):
        build(_limited(config_at(folder)), out, device="cpu", progress=False)
    assert len(hub.log) == requests
    assert release_files(out_a) == release_files(out_b)  # byte-identical, wherever the copies were

    manifest = json.loads((out_a / "manifest.json").read_text())
    stages = {s["name"]: s for s in manifest["config"]["stages"]}
    # Offline, with the copies not in the Hugging Face cache, a marker's claim cannot be checked (anyone can write
    # one): each copy is named by folder and digest, and the release says which model its marker names and why it
    # was not taken for it (tests/test_model_provenance.py: where the cache or the Hub confirms it, it is).
    assert "local_copies" not in stages["caption"]
    why = "cannot be checked here"
    assert why in stages["caption"]["local_copies_refused"]["model"]
    assert set(stages["edit"]["local_copies_refused"]) == {"model", "clip_model"}
    card, croissant = (out_a / "README.md").read_text(), (out_a / "croissant.json").read_text()
    for name, commit in commits.items():
        claim = f"not recorded as a copy of org/{name}@{commit}"
        assert claim in card and claim in croissant and f"local copy of org/{name}" not in card
    for path in out_a.rglob("*"):  # no machine path anywhere in what is published (shards included)
        if path.is_file() and ".lance-cf" not in path.relative_to(out_a).parts:
            data = path.read_bytes()
            assert str(tmp_path).encode() not in data and b"gpu-a" not in data, path

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["publish", str(out_a), "--repo-id", "user/demo-from-copies"]) == 0  # no --allow-local-paths
    assert "README.md" in hub.entries("datasets", "user/demo-from-copies", "main")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    # The copies moved (another parent folder, same folder names): the same config, so the build resumes.
    moved = tmp_path / "gpu-a-moved"
    shutil.move(tmp_path / "gpu-a", moved)
    before = release_files(out_a)
    build(_limited(config_at(moved / "models")), out_a, device="cpu", progress=False)
    assert release_files(out_a) == before

    # A copy whose files changed is not the Hub's model any more: recorded by name and digest, and refused as a
    # resume of the build it did not make.
    vocab = next((second / "org--tiny-masked-lm").glob("*.json"))
    vocab.write_text(vocab.read_text() + "\n")
    changed = _limited(config_at(second))
    random_edit = next(s for s in changed.public_dict()["stages"] if s["name"] == "random_edit")
    assert "local_copies" not in random_edit and random_edit["options"]["model"] == "org--tiny-masked-lm"
    assert "recorded by its name and digest, not as a copy of org/tiny-masked-lm@" in caplog.text
    with pytest.raises(BuildRefused, match=re.escape("stages[random_edit].local_inputs.model")):
        build(changed, out_b, device="cpu", progress=False)


def _limited(path: Path, limit: int = 2):
    from builder.config import load_config

    config = load_config(str(path))
    config.limit = limit
    return short_diffusion(config)


@pytest.mark.slow
def test_the_cpu_estimate_counts_the_unet_the_config_names(tiny_sd_dir, monkeypatch):
    """A config of tiny local models beside a Hub-id text model (the label check's) runs on the CPU: the estimate is
    the configured UNet's, counted on its architecture, not the pinned Stable Diffusion's (which refuses). The CPU's
    speed is fixed at 1 GFLOP/s (a slow CPU), so the outcome depends on the counted UNet, not on the machine's load."""
    import builder.model_check

    monkeypatch.setattr(builder.model_check, "measure_cpu_flops", lambda threads: 1e9)
    from builder.config import apply_overrides, load_config
    from builder.model_check import UNET_FORWARD_FLOPS_512, check_cpu, configured_unet, unet_forward_flops
    from builder.validation import validate_build
    from lance_pipeline.models.needs import SD_COMPONENT_FILES, TRANSFORMERS_FILES, ModelNeed

    lance = validate_build(apply_overrides(load_config("lance"), source="demo"))
    text = ModelNeed("sentence-transformers/all-MiniLM-L6-v2", None, TRANSFORMERS_FILES, (), "stage label", "k")
    # The session's tiny Stable Diffusion (tests/conftest.py, create_tiny_stable_diffusion), which this test only reads.
    sd = ModelNeed(None, None, SD_COMPONENT_FILES, (), "stage invert", "stages[invert].options.model",
                   local_path=str(tiny_sd_dir))  # fmt: skip
    label, unet, vae = configured_unet([text, sd])
    assert label == tiny_sd_dir.name and unet["block_out_channels"] == [8, 16] and vae is not None
    flops = unet_forward_flops(unet, vae, 512)
    assert 0 < flops < UNET_FORWARD_FLOPS_512 / 100  # a tiny UNet: over a hundred times fewer operations
    lance.config.image_size = 64  # the size a config of tiny models builds at (the demo's)
    check_cpu(lance, [text, sd], 3, None, 1)  # minutes at most: runs on the CPU without --device cpu
    with pytest.raises(ValueError, match=r"would run on the CPU: .*the pinned Stable Diffusion UNet"):
        check_cpu(lance, [text], 3, None, 1)


def test_a_missing_source_is_said_before_the_models(tmp_path, capsys):
    """`build hardimagenet --source imagenet:path/to/imagenet/val` with neither: the source, not six models."""
    config = hub_config(tmp_path, {"model": "org/a", "revision": "a" * 40})
    out = tmp_path / "out"
    argv = ["build", str(config), "--source", f"imagenet:{tmp_path / 'path/to/imagenet/val'}", "--output", str(out)]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a directory" in err and "neither cached" not in err and len(err.splitlines()) == 1
    assert not out.exists()
