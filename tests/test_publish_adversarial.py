"""Attacks on ``lance-cf publish``: what must never be uploaded, printed or changed (stray files, machine paths, tokens,
nothing changed in place) and gated releases.

Every publish here runs against the Hub double on 127.0.0.1 (tests/hub_double.py); "before any remote change" is
checked on the double's request log and its git repositories.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from builder_helpers import lock_held_by_another_process
from hub_double import TOKEN, HubDouble, client_env
from publish_fixture import make_release, make_results
from test_publish import REPO, ROOT, release, release_files

from builder import release_format as rf
from builder.publish import plan_release, publish_release
from builder.release_format.hub_client import (
    PublishError,
    local_paths,
    redact_url,
    scrub_local_paths,
)
from dataset_cards import render_release_card

pytestmark = pytest.mark.e2e  # publishes over real HTTP against the local Hub double

SECRET_TOKEN = "hf_private_token_in_a_dotenv_file_987"
PRIVATE_KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot-a-real-key-but-private-4242\n"
ENDPOINT_PASSWORD = "endpoint-password-1729"


def add_strays(release_dir: Path, outside: Path) -> None:
    """What a careless release directory holds: a token, a git config, a link to a private key, a temp file."""
    (release_dir / ".env").write_text(f"HF_TOKEN={SECRET_TOKEN}\n")
    (release_dir / ".git").mkdir()
    (release_dir / ".git" / "config").write_text("[remote]\n\turl = https://me:gitpass@example.org/x.git\n")
    (release_dir / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "id_ed25519").write_bytes(PRIVATE_KEY)
    (release_dir / "id_ed25519").symlink_to(outside / "id_ed25519")
    (release_dir / "private").symlink_to(outside, target_is_directory=True)
    (release_dir / "assets" / "notes.txt").write_text("a note beside the gallery, not part of the card\n")
    (release_dir / (rf.MANIFEST_NAME + ".tmp")).write_bytes((release_dir / rf.MANIFEST_NAME).read_bytes())


def hub_bytes(hub: HubDouble) -> bytes:
    """Everything the double stores: every git object (loose and packed) and every LFS object, concatenated."""
    out = []
    for repo_git in hub.root.rglob("*.git"):
        out.append(hub.git(repo_git, "cat-file", "--batch-all-objects", "--batch"))
        out += [p.read_bytes() for p in (repo_git / "lfs").rglob("*") if p.is_file()]
    return b"".join(out)


def expected_upload(manifest: dict) -> set[str]:
    gallery = {f"assets/gallery-{i:02d}.png" for i in range(6)}
    croissant = {rf.CROISSANT_NAME, *(rf.index_path(c) for c in manifest["configs"])}
    return (
        {rf.MANIFEST_NAME, rf.TIMM_INFO_NAME, rf.CARD_NAME, *(s["path"] for s in manifest["shards"])}
        | gallery
        | croissant
    )


# ------------------------------------------------------------------------------------ 1. only what the manifest lists
def test_stray_files_and_links_never_reach_the_plan_or_the_hub(hub_env, tmp_path, capsys, cli):
    hub = hub_env
    release_dir, manifest = release(tmp_path)
    add_strays(release_dir, tmp_path / "home" / ".ssh")

    plan = plan_release(release_dir, REPO)
    assert {f.path_in_repo for f in plan.files} == expected_upload(manifest)
    assert plan.left_out == [
        ".env (not listed in the manifest)",
        ".git/ (directory, 2 files, not listed in the manifest)",
        "assets/notes.txt (not listed in the manifest)",
        "id_ed25519 (symbolic link, not followed)",
        "manifest.json.tmp (not listed in the manifest)",
        "private (symbolic link, not followed)",
    ]
    # The dry run names what it leaves out; --strict refuses the directory, naming every stray.
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "left out (not listed in the manifest; --strict refuses them): 6" in out and "  .env (not listed" in out
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--strict") == 1
    err = capsys.readouterr().err
    assert "holds 6 entries the manifest does not list (--strict)" in err and err.count("\n") == 1
    assert ".env" in err and "id_ed25519" in err and "manifest.json.tmp" in err
    assert not hub.exists("datasets", REPO) and {m for m, _, _ in hub.log} <= {"GET"}  # reads only

    result = publish_release(release_dir, REPO)
    stored = hub.entries("datasets", REPO, result.tag)
    assert set(stored) == expected_upload(manifest) | {".gitattributes"}
    everything = hub_bytes(hub)
    for secret in (SECRET_TOKEN.encode(), PRIVATE_KEY, b"gitpass"):
        assert secret not in everything
    # The release directory was only read: the strays are still there, untouched.
    assert (release_dir / ".env").read_text() == f"HF_TOKEN={SECRET_TOKEN}\n"


def test_listed_file_behind_a_link_or_outside_the_release_is_refused(hub_env, tmp_path):
    from release_fixture import write_manifest

    hub = hub_env
    # A shard replaced by a link to identical bytes elsewhere: verify follows it and passes, publish must not.
    release_dir, manifest = release(tmp_path)
    shard = release_dir / manifest["shards"][0]["path"]
    elsewhere = tmp_path / "elsewhere" / "shard.tar"
    elsewhere.parent.mkdir()
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)
    with pytest.raises(PublishError, match=re.escape(f"{manifest['shards'][0]['path']} is a symbolic link")):
        publish_release(release_dir, REPO)

    # The whole data directory as a link.
    release_dir2, _ = make_release(tmp_path / "r2")
    moved = tmp_path / "r2-data"
    shutil.move(release_dir2 / rf.DATA_DIR, moved)
    (release_dir2 / rf.DATA_DIR).symlink_to(moved, target_is_directory=True)
    with pytest.raises(PublishError, match=r": data is a symbolic link"):
        publish_release(release_dir2, REPO, verify=False)

    # A sealed manifest that lists a path leaving the release.
    release_dir3, manifest3 = make_release(tmp_path / "r3")
    manifest3.pop("manifest_sha256")
    manifest3["shards"][0]["path"] = "../outside.tar"
    write_manifest(release_dir3, manifest3, croissant=False)  # croissant.json would read the shard
    with pytest.raises(PublishError, match=r"'\.\./outside\.tar', which is not a plain path inside the release"):
        publish_release(release_dir3, REPO, verify=False)
    assert hub.log == []


def test_machine_paths_are_not_published(hub_env, tmp_path, capsys, cli):
    hub = hub_env
    release_dir, manifest = make_release(tmp_path / "r", source_spec="imagefolder:/home/alice/photos")
    render_release_card(release_dir, manifest, repo_id=REPO)
    with pytest.raises(PublishError, match=r"source\.spec = 'imagefolder:/home/alice/photos'.*--allow-local-paths"):
        publish_release(release_dir, REPO)
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 1
    assert "holds local machine paths" in capsys.readouterr().err
    assert hub.log == []
    # The explicit override publishes as it is.
    assert publish_release(release_dir, REPO, allow_local_paths=True).tag == "v1.0.0"


def test_the_token_is_never_published(hub_env, tmp_path, capsys, cli):
    """The token a publish uploads with, found in the manifest or in a results JSON, stops it (never printed)."""
    hub = hub_env
    release_dir, manifest = make_release(tmp_path / "r", source_spec=f"hf:user/data?token={TOKEN}")
    render_release_card(release_dir, manifest, repo_id=REPO)
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 1
    err = capsys.readouterr().err
    assert "manifest.json holds the Hugging Face token" in err and TOKEN not in err
    assert hub.log == []

    clean_dir, clean = release(tmp_path)
    publish_release(clean_dir, REPO)
    leaky = make_results(clean, "resnet18", 60.0, options={"batch_size": 8, "hub_token": TOKEN})
    directory = write_results(tmp_path / "out", leaky)
    commits = len(hub.commits("datasets", REPO))
    assert cli("publish-results", str(directory), "--repo-id", REPO) == 1
    err = capsys.readouterr().err
    assert "results.json holds the Hugging Face token" in err and TOKEN not in err
    assert len(hub.commits("datasets", REPO)) == commits


def test_local_path_detection_and_scrubbing():
    obj = {
        "release": {"source": "/home/alice/out/rel", "name": "lance-demo", "repo": "https://huggingface.co/x/y"},
        "model": {"class_map": "C:\\Users\\alice\\map.txt", "name": "resnet18", "ratio": "n/a", "split": "a/b"},
        "weights": {"checkpoint": "file:///srv/ckpt/model.safetensors", "id": "timm/resnet18.a1_in1k"},
        "notes": ["loaded imagefolder:/data/x and ~/models/blip", "relative data/original/test-000000.tar"],
    }
    found = dict(local_paths(obj))
    assert sorted(found) == ["model.class_map", "notes[0]", "release.source", "weights.checkpoint"]
    clean, changed = scrub_local_paths(obj)
    assert sorted(changed) == sorted(found)
    assert clean["release"]["source"] == "rel" and clean["model"]["class_map"] == "map.txt"
    assert clean["weights"]["checkpoint"] == "model.safetensors"
    assert clean["notes"][0] == "loaded imagefolder:x and blip"
    assert clean["release"]["repo"] == obj["release"]["repo"] and clean["notes"][1] == obj["notes"][1]
    assert local_paths(clean) == []


def test_versions_are_ordered_as_packaging_orders_them():
    from builder.publish import _previous_version
    from evaluation.publish_results import by_release

    tags = {"v1.9.0": "a", "v1.10.0": "b", "v2.0.0-rc1": "c", "v2.0.0": "d", "latest": "e"}
    assert _previous_version(tags, "v2.0.0") == "v2.0.0-rc1"
    assert _previous_version(tags, "v2.0.0-rc1") == "v1.10.0"
    results = [{"release": {"name": "n", "version": v, "manifest_sha256": v}} for v in ("10.0.0", "2.0.0", "1.0.0")]
    assert [release["version"] for release, _ in by_release(results)] == ["1.0.0", "2.0.0", "10.0.0"]


# --------------------------------------------------------------------------------- credentials in HF_ENDPOINT URLs
def test_redact_url():
    text = "GET http://user:pw@h:1/a and https://tok@hub.example.org/x, not mailto a@b or http://h/p@x"
    assert redact_url(text) == "GET http://***@h:1/a and https://***@hub.example.org/x, not mailto a@b or http://h/p@x"


def test_endpoint_credentials_never_printed(hub_env, tmp_path, monkeypatch, capsys, caplog, cli):
    import logging

    hub = hub_env
    release_dir, _ = release(tmp_path)
    caplog.set_level(logging.DEBUG)
    # A reachable endpoint whose URL carries credentials: the client sends them as basic auth, the double refuses.
    monkeypatch.setenv("HF_ENDPOINT", hub.url.replace("http://", f"http://alice:{ENDPOINT_PASSWORD}@"))
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "on http://***@127.0.0.1:" in out
    assert cli("publish", str(release_dir), "--repo-id", REPO) == 1
    err = capsys.readouterr().err
    assert "http://***@127.0.0.1:" in err and err.count("\n") == 1
    # An unreachable one.
    monkeypatch.setenv("HF_ENDPOINT", f"http://alice:{ENDPOINT_PASSWORD}@127.0.0.1:9")
    assert cli("publish", str(release_dir), "--repo-id", REPO) == 1
    err2 = capsys.readouterr().err
    assert "cannot reach the Hub at http://***@127.0.0.1:9" in err2 and err2.count("\n") == 1
    for text in (out, err, err2):
        assert ENDPOINT_PASSWORD not in text
    assert not hub.exists("datasets", REPO)


def test_offline_mode_is_one_line_and_the_dry_run_still_works(hub_env, tmp_path, monkeypatch, capsys, cli):
    from huggingface_hub import constants

    release_dir, _ = release(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 0  # needs no network
    capsys.readouterr()
    assert cli("publish", str(release_dir), "--repo-id", REPO) == 1
    err = capsys.readouterr().err
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in err and "unset HF_HUB_OFFLINE" in err and err.count("\n") == 1
    assert hub_env.log == []


# ---------------------------------------------------------------------- 2. releases load_dataset could not open
def test_empty_required_config_is_refused_before_any_remote_change(hub_env, tmp_path, capsys, cli):
    hub = hub_env
    release_dir, manifest = make_release(tmp_path / "r", empty_configs=("counterfactual",))
    render_release_card(release_dir, manifest)
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 1
    err = capsys.readouterr().err
    assert "required config(s) counterfactual have no samples" in err and "load_dataset" in err
    with pytest.raises(PublishError, match="required config"):
        publish_release(release_dir, REPO)
    assert hub.log == []


def test_release_with_no_samples_is_refused(hub_env, tmp_path, capsys, cli):
    hub = hub_env
    release_dir, _ = make_release(tmp_path / "r", empty_configs=("original", "counterfactual"))
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 1
    assert "has no samples in any config (1 failure(s) recorded" in capsys.readouterr().err
    assert hub.log == []


def test_release_load_dataset_cannot_open_is_refused(hub_env, tmp_path, monkeypatch, capsys, cli):
    """A card whose YAML points a config at no files (as a renderer bug would) never reaches the Hub."""
    import dataset_cards

    hub = hub_env
    release_dir, _ = release(tmp_path)
    real_render = dataset_cards.render_release_card

    def broken_render(directory, manifest, **kwargs):
        text = real_render(directory, manifest, **kwargs).replace("data/counterfactual/test-*", "data/cf/test-*")
        (Path(directory) / rf.CARD_NAME).write_text(text, encoding="utf-8")
        return text

    monkeypatch.setattr(dataset_cards, "render_release_card", broken_render)
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 1
    err = capsys.readouterr().err
    assert "the card's config 'counterfactual' resolves to 0 data file(s), the manifest lists 3" in err
    assert err.count("\n") == 1
    assert cli("publish", str(release_dir), "--repo-id", REPO) == 1
    assert not hub.exists("datasets", REPO)
    assert not any(method != "GET" for method, _, _ in hub.log)  # only reads (refs) happened

    # A declared feature the rows do not cast to (a label name declared as an integer): every row is read, so the
    # first row that fails stops the publish.
    def wrong_type(directory, manifest, **kwargs):
        text = real_render(directory, manifest, **kwargs)
        text = text.replace("- name: label_name\n      dtype: string", "- name: label_name\n      dtype: int64")
        (Path(directory) / rf.CARD_NAME).write_text(text, encoding="utf-8")
        return text

    monkeypatch.setattr(dataset_cards, "render_release_card", wrong_type)
    capsys.readouterr()
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 1
    err = capsys.readouterr().err
    assert "load_dataset cannot open config 'original'" in err and "tench" in err and err.count("\n") == 1


def test_card_metadata_the_hub_refuses_stops_before_the_repo_is_created(hub_env, tmp_path, monkeypatch, capsys, cli):
    import dataset_cards

    hub = hub_env
    release_dir, _ = release(tmp_path)
    real_render = dataset_cards.render_release_card

    def bad_metadata(directory, manifest, **kwargs):
        text = real_render(directory, manifest, **kwargs).replace("- n<1K", "- tiny", 1)
        (Path(directory) / rf.CARD_NAME).write_text(text, encoding="utf-8")
        return text

    monkeypatch.setattr(dataset_cards, "render_release_card", bad_metadata)
    assert cli("publish", str(release_dir), "--repo-id", REPO) == 1
    err = capsys.readouterr().err
    assert "the Hub refuses the card's metadata" in err and "'tiny' is not one of" in err and err.count("\n") == 1
    assert not hub.exists("datasets", REPO)


# ------------------------------------------------------------------------------------ 3. a read-only release dir
def _snapshot(directory: Path) -> dict[str, tuple]:
    snap = {}
    for path in sorted(directory.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        snap[path.relative_to(directory).as_posix()] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return snap


def test_publish_never_writes_into_the_release(hub_env, tmp_path):
    hub = hub_env
    release_dir, _ = release(tmp_path)
    before = _snapshot(release_dir)
    publish_release(release_dir, REPO)
    assert _snapshot(release_dir) == before
    assert hub.resolve("datasets", REPO, "v1.0.0") is not None


def _read_only_runner(release_dir: Path) -> list[str] | None:
    """A command prefix that runs its argument with ``release_dir`` read-only, or None when this machine cannot."""
    if os.geteuid() != 0:
        return []  # permissions suffice: the caller makes the tree read-only
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount --bind -o ro '{release_dir}' '{release_dir}' && ! touch '{release_dir}/x'",
        ],
        capture_output=True,
    )
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{release_dir}" "{release_dir}" && exec "$@"', "sh"]


def test_publish_from_a_read_only_directory(hub_env, tmp_path):
    hub = hub_env
    release_dir, manifest = release(tmp_path)
    runner = _read_only_runner(release_dir)
    if runner is None:
        pytest.skip("running as root without a usable `unshare -m` for a read-only bind mount")
    if not runner:
        for path in [release_dir, *release_dir.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
    env = client_env(hub.url, tmp_path / "hf_home", HF_TOKEN=TOKEN)
    script = "import sys; from builder.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [*runner, sys.executable, "-c", script, "publish", str(release_dir), "--repo-id", REPO],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "published lance-org/lance-demo v1.0.0" in proc.stdout
    assert set(hub.entries("datasets", REPO, "v1.0.0")) == release_files(release_dir) | {".gitattributes"}
    card = hub.read_file("datasets", REPO, hub.entries("datasets", REPO, "v1.0.0")[rf.CARD_NAME]).decode()
    assert f'load_dataset("{REPO}", "counterfactual"' in card and manifest["name"] in card


def test_publish_is_refused_while_a_build_holds_the_directory(hub_env, tmp_path, capsys, cli):
    """A real second process holds the release directory as a build does (builder.release_format.lock, exclusive)."""
    hub = hub_env
    release_dir, _ = release(tmp_path)
    with lock_held_by_another_process(release_dir, "build") as pid:
        for extra in ([], ["--dry-run"]):
            with pytest.raises(ValueError, match=rf"in use by lance-cf pid {pid} \(build\)"):
                cli("publish", str(release_dir), "--repo-id", REPO, *extra)
        assert hub.log == []
    assert publish_release(release_dir, REPO).tag == "v1.0.0"  # free again


# ---------------------------------------------------------------------------------------------------- 4. gating
def test_gated_card_gates_the_repo_before_any_data_lands(hub_env, tmp_path):
    hub = hub_env
    release_dir, _ = release(tmp_path)  # ImageNet-derived: the card says gated
    assert plan_release(release_dir, REPO).gated == "auto"
    result = publish_release(release_dir, REPO)
    assert result.gated == "auto"
    assert hub.settings_calls == [("datasets", REPO, {"gated": "auto"})]
    assert hub.settings[("datasets", REPO)]["gated"] == "auto"
    order = [(m, p) for m, p, s in hub.log if s == 200]
    settings_at = order.index(("PUT", f"/api/datasets/{REPO}/settings"))
    commit_at = next(i for i, (m, p) in enumerate(order) if m == "POST" and "/commit/" in p)
    assert settings_at < commit_at
    # Read back after setting it (repo info carries the gate).
    assert any(m == "GET" and p.startswith(f"/api/datasets/{REPO}") for m, p in order[settings_at + 1 : commit_at])

    # A manual gate is kept by a later publish without --gated, and set on request with --gated manual.
    hub.settings[("datasets", REPO)]["gated"] = "manual"
    v2_dir, _ = release(tmp_path, version="1.1.0")
    assert publish_release(v2_dir, REPO).gated == "manual"
    assert len(hub.settings_calls) == 1
    v3_dir, _ = release(tmp_path, version="1.2.0")
    assert publish_release(v3_dir, REPO, gated="auto").gated == "auto"
    assert hub.settings_calls[-1] == ("datasets", REPO, {"gated": "auto"})


def test_gated_manual_option_and_ungated_cards(hub_env, tmp_path, cli):
    hub = hub_env
    release_dir, _ = release(tmp_path)
    assert cli("publish", str(release_dir), "--repo-id", REPO, "--gated", "manual") == 0
    assert hub.settings_calls == [("datasets", REPO, {"gated": "manual"})]
    # A card that does not say gated: no settings call.
    other = "lance-org/open-photos"
    open_dir, open_manifest = make_release(tmp_path / "open", imagenet_derived=False)
    render_release_card(open_dir, open_manifest)
    assert plan_release(open_dir, other).gated is None
    assert publish_release(open_dir, other).gated is None
    assert [call for call in hub.settings_calls if call[1] == other] == []


def test_gating_that_does_not_hold_stops_before_the_upload(hub_env, tmp_path, cli):
    from builder.release_format.hub_client import create_api

    hub = hub_env
    release_dir, _ = release(tmp_path)

    class IgnoredSettings(type(create_api())):
        def update_repo_settings(self, *args, **kwargs):  # a hub that answers 200 and keeps the repo open
            return None

    with pytest.raises(PublishError, match="gating was set to 'auto' but the Hub reports False"):
        publish_release(release_dir, REPO, api=IgnoredSettings(endpoint=hub.url))
    assert len(hub.commits("datasets", REPO)) == 1  # the Hub's initial commit only: no data uploaded

    hub.faults.fail = {"settings": [403]}
    assert cli("publish", str(release_dir), "--repo-id", REPO) == 1
    assert len(hub.commits("datasets", REPO)) == 1
    assert publish_release(release_dir, REPO).gated == "auto"  # re-running completes


# --------------------------------------------------------------------------------------------------- publish-results
def write_results(directory: Path, *results: dict) -> Path:
    for result in results:
        (directory / result["model"]["slug"]).mkdir(parents=True, exist_ok=True)
        (directory / result["model"]["slug"] / "results.json").write_text(json.dumps(result))
    return directory


def test_incomplete_or_invalid_results_are_refused(hub_env, tmp_path, capsys, caplog, cli):
    import logging

    hub = hub_env
    release_dir, manifest = release(tmp_path)
    publish_release(release_dir, REPO)
    capsys.readouterr()  # the library call's upload progress (shown when an earlier test enabled the bars)
    commits = len(hub.commits("datasets", REPO))
    cases = [
        (make_results(manifest, "resnet18", 60.0, limit=5), "results of a --limit 5 run"),
        (
            make_results(manifest, "resnet18", 60.0, failures=[{"key": "src000", "reason": "truncated"}]),
            "1 sample(s) could not be scored",
        ),
    ]
    for i, (result, message) in enumerate(cases):
        directory = write_results(tmp_path / f"case{i}", result)
        assert cli("publish-results", str(directory), "--repo-id", REPO) == 1
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    # A file that claims to be results but fails evaluation's validation: ValueError naming the file and the field.
    broken = make_results(manifest, "resnet18", 60.0)
    del broken["release"]["manifest_sha256"]
    directory = write_results(tmp_path / "broken", broken)
    with pytest.raises(ValueError, match=r"resnet18/results\.json: .*'release\.manifest_sha256'"):
        cli("publish-results", str(directory), "--repo-id", REPO)
    # A failed evaluation is left out with a warning; with nothing else there is nothing to publish.
    caplog.set_level(logging.WARNING)
    failed = make_results(manifest, "vit_tiny", 0.0, status="error", error="CUDA out of memory")
    failed.pop("metrics")
    directory = write_results(tmp_path / "failed", failed)
    assert cli("publish-results", str(directory), "--repo-id", REPO) == 1
    assert "no publishable results among 1 file(s)" in capsys.readouterr().err
    assert "the evaluation of this model failed (CUDA out of memory)" in caplog.text
    assert len(hub.commits("datasets", REPO)) == commits


def test_results_machine_paths_are_stripped(hub_env, tmp_path, caplog, cli):
    import logging

    hub = hub_env
    release_dir, manifest = release(tmp_path)
    publish_release(release_dir, REPO)
    result = make_results(manifest, "resnet18", 60.0)
    result["release"]["source"] = "/home/alice/releases/lance-demo"
    result["model"]["class_map"] = "/home/alice/maps/imagenet-5.txt"
    result["weights"] = {"checkpoint": "/srv/alice/ckpt/resnet18-ft.safetensors"}
    caplog.set_level(logging.WARNING)
    assert cli("publish-results", str(write_results(tmp_path / "out", result)), "--repo-id", REPO) == 0
    assert (
        "machine paths removed before publishing from model.class_map, release.source, weights.checkpoint"
        in caplog.text
    )
    stored = hub.entries("datasets", REPO, "main")
    published = json.loads(hub.read_file("datasets", REPO, stored["results/v1.0.0/resnet18.json"]))
    assert published["release"]["source"] == "lance-demo"
    assert published["model"]["class_map"] == "imagenet-5.txt"
    assert published["weights"]["checkpoint"] == "resnet18-ft.safetensors"
    assert b"/home/alice" not in hub_bytes(hub) and b"/srv/alice" not in hub_bytes(hub)


def test_leaderboard_over_two_releases(hub_env, tmp_path, cli):
    from test_publish import load_leaderboard_over_http, split_card

    hub = hub_env
    v1_dir, v1 = release(tmp_path, "1.0.0")
    publish_release(v1_dir, REPO)
    out1 = write_results(
        tmp_path / "out1", make_results(v1, "resnet18", 61.5), make_results(v1, "hf-hub:org/vit_tiny", 70.25)
    )
    assert cli("publish-results", str(out1), "--repo-id", REPO) == 0
    v2_dir, v2 = release(tmp_path, "2.0.0", drop_classes=(4,))
    publish_release(v2_dir, REPO)
    assert (
        cli(
            "publish-results",
            str(write_results(tmp_path / "out2", make_results(v2, "resnet18", 50.0))),
            "--repo-id",
            REPO,
        )
        == 0
    )

    rows = load_leaderboard_over_http(hub, tmp_path)
    assert sorted((r["release_version"], r["rank"], r["model"], r["acc1"]) for r in rows) == [
        ("1.0.0", 1, "hf-hub:org/vit_tiny", 70.25),
        ("1.0.0", 2, "resnet18", 61.5),
        ("2.0.0", 1, "resnet18", 50.0),
    ]
    main = hub.entries("datasets", REPO, "main")
    # v2 has fewer shards than v1: the release commit deleted v1's extra files; results stayed.
    assert (
        {p for p in main if p.startswith("data/")}
        == {s["path"] for s in v2["shards"]}
        != {s["path"] for s in v1["shards"]}
    )
    table = hub.read_file("datasets", REPO, main["results/leaderboard.md"]).decode()
    assert table.index("## lance-demo v2.0.0") < table.index("## lance-demo v1.0.0")
    # The card on main describes v2: its leaderboard lists the v2 result only.
    card = hub.read_file("datasets", REPO, main[rf.CARD_NAME]).decode()
    section = card[card.index("## Leaderboard") : card.index("## How it was built")]
    assert "resnet18" in section and "vit_tiny" not in section and "v1.0.0 |" not in section
    front, _ = split_card(card)
    assert [c["config_name"] for c in front["configs"]].count("leaderboard") == 1
    assert front["dataset_info"][-1]["splits"] == [{"name": "train", "num_examples": 3}]


def test_recorded_card_assets_must_match_the_rendered_ones(hub_env, tmp_path, monkeypatch):
    """Format v2 records the gallery's hashes in the manifest: publish uploads a re-rendered card, whose assets must be
    those bytes (the gallery does not depend on the repo), or the published release would fail verify."""
    from release_fixture import write_manifest

    import dataset_cards

    hub = hub_env
    release_dir, manifest = release(tmp_path)
    manifest.pop("manifest_sha256")
    manifest["assets"] = [
        {
            "path": p.relative_to(release_dir).as_posix(),
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "bytes": p.stat().st_size,
        }
        for p in sorted((release_dir / "assets").glob("gallery-*.png"))
    ]
    assert len(manifest["assets"]) == 6
    render_release_card(release_dir, write_manifest(release_dir, manifest), repo_id=REPO)
    assert {f.path_in_repo for f in plan_release(release_dir, REPO).files} == expected_upload(manifest)

    real_render = dataset_cards.render_release_card

    def drifted_render(directory, manifest, **kwargs):  # a renderer whose gallery changed since the build
        text = real_render(directory, manifest, **kwargs)
        with open(Path(directory) / "assets" / "gallery-03.png", "ab") as f:
            f.write(b"\0")
        return text

    monkeypatch.setattr(dataset_cards, "render_release_card", drifted_render)
    with pytest.raises(PublishError, match=r"card assets rendered for the repo differ .*\(assets/gallery-03\.png\)"):
        publish_release(release_dir, REPO)
    assert not hub.exists("datasets", REPO)
