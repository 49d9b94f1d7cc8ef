"""End-to-end tests of ``lance-cf publish`` / ``publish-results`` over real HTTP against the Hub double on 127.0.0.1.

Publishing runs in this process against ``tests/hub_double.py`` (``HF_HUB_DISABLE_XET`` so that large files take the
Git-LFS batch path the double implements). ``datasets.load_dataset("ORG/NAME", ...)`` runs in a subprocess, because
``datasets`` and ``huggingface_hub`` read ``HF_ENDPOINT`` when first imported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_double import TOKEN, HubDouble, client_env
from publish_fixture import make_release, make_results

from builder import release_format as rf
from builder.publish import PublishError, plan_release, publish_release
from builder.release_format.verify import verify_release
from dataset_cards import render_release_card

pytestmark = pytest.mark.e2e  # real HTTP against the local Hub double

ROOT = Path(__file__).resolve().parents[1]
REPO = "lance-org/lance-demo"

LOAD_SCRIPT = r"""
import json, sys
import datasets
from datasets import Features
from huggingface_hub import hf_hub_download
from builder.release_format import card_dataset_info
out = []
for spec in sys.argv[1:]:
    repo, config, revision = spec.split("@")
    ds = datasets.load_dataset(repo, config, split="test", revision=revision)
    manifest = json.load(open(hf_hub_download(repo, "manifest.json", repo_type="dataset", revision=revision)))
    declared = {info["config_name"]: info["features"] for info in card_dataset_info(manifest)}[config]
    keys = sorted(ds["__key__"])
    out.append({
        "spec": spec,
        "num_rows": len(ds),
        "features_declared": ds.features == Features._from_yaml_list(declared),
        "class_names": ds.features["cls"].names,
        "keys": keys,
        "clip_image": [r["scores"]["clip_image"] for r in ds["json"]],
        "score_types": sorted({type(v).__name__ for r in ds["json"] for v in r["scores"].values() if v is not None}),
        "image_size": list(ds[0]["png"].size),
    })
print("RESULT" + json.dumps(out))
"""


LEADERBOARD_SCRIPT = r"""
import json, sys
import datasets
ds = datasets.load_dataset(sys.argv[1], "leaderboard", split="train")
print("RESULT" + json.dumps([row["json"] for row in ds]))
"""


def split_card(text: str) -> tuple[dict, str]:
    """The card's YAML front matter (parsed) and its body."""
    import yaml

    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def load_leaderboard_over_http(hub: HubDouble, tmp_path: Path) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", LEADERBOARD_SCRIPT, REPO],
        env=client_env(hub.url, tmp_path / "hf_home"),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def load_over_http(hub: HubDouble, tmp_path: Path, *specs: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, *specs],
        env=client_env(hub.url, tmp_path / "hf_home"),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def built_release(tmp_path: Path, version: str, classes: list[str], per_class: int) -> tuple[Path, dict]:
    """A release made by the builder itself (``lance-cf build`` with the model-free stages of tests/fake_stages.py).

    Its card is the one the build rendered, which does not know the Hub repo yet.
    """
    from builder_helpers import FAKE_STAGES, cli, make_imagefolder, write_config

    root = tmp_path / f"built-{version}"
    folder = make_imagefolder(root / "src", classes, per_class=per_class)
    configs = ["original", "counterfactual", "lance_r"]
    cfg = write_config(
        root / "cfg.yaml",
        f"imagefolder:{folder}",
        stages=FAKE_STAGES,
        configs=configs,
        name="lance-demo",
        version=version,
    )
    cli("build", str(cfg), "--output", str(root / "release"), "--no-progress")
    return root / "release", json.loads((root / "release" / rf.MANIFEST_NAME).read_text(encoding="utf-8"))


def shard_keys(release_dir: Path, manifest: dict, config: str) -> list[str]:
    """The sample keys of one config, read from the local shards."""
    import tarfile

    keys = set()
    for shard in manifest["shards"]:
        if shard["config"] == config:
            with tarfile.open(release_dir / shard["path"]) as tar:
                keys |= {m.name.rsplit("/", 1)[-1].partition(".")[0] for m in tar if m.isfile()}
    return sorted(keys)


def release(tmp_path: Path, version: str = "1.0.0", **kwargs) -> tuple[Path, dict]:
    release_dir, manifest = make_release(tmp_path / f"release-{version}", version=version, **kwargs)
    render_release_card(release_dir, manifest, repo_id=REPO)
    return release_dir, manifest


def release_files(release_dir: Path) -> set[str]:
    return {
        p.relative_to(release_dir).as_posix()
        for p in release_dir.rglob("*")
        if p.is_file() and not p.relative_to(release_dir).as_posix().startswith(rf.WORK_DIR + "/")
    }


def count(hub: HubDouble, method: str, fragment: str, status: int | None = None) -> int:
    return sum(1 for m, p, s in hub.log if m == method and fragment in p and (status is None or s == status))


def test_dry_run_prints_plan_and_touches_no_network(hub_env, tmp_path, capsys, cli, caplog):
    release_dir, manifest = release(tmp_path)
    with caplog.at_level(logging.INFO, logger="builder.publish"):
        assert cli("publish", str(release_dir), "--repo-id", REPO, "--dry-run") == 0
    out = capsys.readouterr().out
    assert hub_env.log == []  # not a single request
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("publish check")]
    assert said[0].startswith("publish check: verifying") and "staging" in said[1], said  # each slow step, as it starts
    assert said[2:] == [
        f"publish check {i}/{len(manifest['configs'])}: load_dataset reads config {c} ({manifest['counts'][c]['total']} rows)"
        for i, c in enumerate(manifest["configs"], 1)
    ]
    plan = plan_release(release_dir, REPO)
    assert {f.path_in_repo for f in plan.files} == release_files(release_dir)
    assert not any(f.path_in_repo.startswith(rf.WORK_DIR) for f in plan.files)
    assert "tag: v1.0.0" in out and "target revision: main" in out
    for shard in manifest["shards"]:
        assert shard["path"] in out
    # every file as the release holds it, but croissant.json, which publish completes with url and datePublished
    staged_croissant = next(f.size for f in plan.files if f.path_in_repo == rf.CROISSANT_NAME)
    assert staged_croissant > (release_dir / rf.CROISSANT_NAME).stat().st_size
    assert plan.total_bytes - staged_croissant == sum(
        p.stat().st_size for p in release_dir.rglob("*") if p.is_file() and p.name != rf.CROISSANT_NAME
    ) - sum(p.stat().st_size for p in (release_dir / rf.WORK_DIR).rglob("*") if p.is_file())
    with pytest.raises(ValueError, match="ORG/NAME"):
        plan_release(release_dir, "not-a-repo-id")


def test_publish_versions_over_http(hub_env, tmp_path, caplog, capsys):
    """Releases made by the builder publish, load with their declared features and keep older versions loadable."""
    caplog.set_level(logging.DEBUG)
    hub = hub_env
    v1_dir, v1 = built_release(tmp_path, "1.0.0", ["cat", "dog", "zebra"], per_class=2)
    assert f'load_dataset("{REPO}"' not in (v1_dir / rf.CARD_NAME).read_text()  # the build did not know the repo
    # A transient 503 on one large-file upload and on the commit: both retried, the publish completes.
    hub.faults.fail = {"lfs_put": [503], "commit": [503]}
    result = publish_release(v1_dir, REPO)
    assert result.tag == "v1.0.0"
    assert count(hub, "PUT", "/lfs-upload/", 503) == 1 and count(hub, "POST", "/commit/main", 503) == 1
    refs = hub.refs("datasets", REPO)
    assert {t["name"]: t["targetCommit"] for t in refs["tags"]} == {"v1.0.0": result.commit}

    # Stored in git: the release files plus the Hub's .gitattributes; shards and PNGs as LFS pointers.
    entries = hub.entries("datasets", REPO, "v1.0.0")
    assert set(entries) == release_files(v1_dir) | {".gitattributes"}
    for shard in v1["shards"]:
        assert entries[shard["path"]]["lfs"]["oid"] == shard["sha256"]
    assert entries["README.md"]["lfs"] is None and entries["manifest.json"]["lfs"] is None
    # The published card tells users to load from this repo, not from a placeholder.
    v1_card = hub.read_file("datasets", REPO, entries["README.md"]).decode()
    assert f'load_dataset("{REPO}", "counterfactual", split="test", revision="v1.0.0")' in v1_card
    assert f"--release {REPO}@v1.0.0" in v1_card and "ORG/" not in v1_card
    assert verify_release(v1_dir) == []  # re-rendering the card for the repo keeps the release valid

    # Version 2 (a class dropped, more images per class) replaces the files on main; v1 stays loadable by tag.
    v2_dir, v2 = built_release(tmp_path, "2.0.0", ["cat", "zebra"], per_class=4)
    result2 = publish_release(v2_dir, REPO)  # renders the changelog against v1 fetched from the Hub
    v2_card = hub.read_file("datasets", REPO, hub.entries("datasets", REPO, "v2.0.0")["README.md"]).decode()
    assert "Changes from v1.0.0 to v2.0.0" in v2_card
    # matched by name although the builder renumbered zebra from 2 to 1
    assert "| `counterfactual` | class | dog (1 in v1.0.0) | 4 | 0 | -4 |" in v2_card
    assert "| `counterfactual` | class | zebra (1) | 4 | 8 | +4 |" in v2_card
    assert set(hub.entries("datasets", REPO, "main")) == release_files(v2_dir) | {".gitattributes"}
    assert hub.resolve("datasets", REPO, "v1.0.0") == result.commit != result2.commit
    assert len(hub.commits("datasets", REPO)) == 3  # initial + one commit per release, no more

    specs = [(v1, v1_dir, c, "v1.0.0") for c in ("original", "counterfactual", "lance_r")]
    specs.append((v2, v2_dir, "counterfactual", "v2.0.0"))
    loaded = load_over_http(hub, tmp_path, *(f"{REPO}@{config}@{tag}" for _, _, config, tag in specs))
    for item, (manifest, release_dir, config, _) in zip(loaded, specs, strict=True):
        assert item["num_rows"] == manifest["counts"][config]["total"], item["spec"]
        assert item["keys"] == shard_keys(release_dir, manifest, config), item["spec"]
        assert item["features_declared"], item["spec"]
        assert item["class_names"] == manifest["label_space"]["names"], item["spec"]  # cls is a ClassLabel
        assert item["image_size"] == [manifest["config"]["image_size"]] * 2, item["spec"]
    assert loaded[1]["num_rows"] != loaded[3]["num_rows"]
    assert loaded[1]["score_types"] == ["float"]  # integral scores load as declared float64, not inferred int

    # Republishing an existing version is refused, and nothing is written.
    commits_before = len(hub.commits("datasets", REPO))
    with pytest.raises(PublishError, match="already has tag v1.0.0"):
        publish_release(v1_dir, REPO)
    assert len(hub.commits("datasets", REPO)) == commits_before

    # The token was sent (the double requires it) but never logged, printed or written.
    out = capsys.readouterr()
    assert TOKEN not in caplog.text and TOKEN not in out.out and TOKEN not in out.err
    for directory in (v1_dir, v2_dir):
        for path in directory.rglob("*"):
            assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path


def test_interrupted_publish_resumes_without_duplicates(hub_env, tmp_path):
    hub = hub_env
    release_dir, manifest = release(tmp_path)
    lfs_files = {hashlib.sha256(p.read_bytes()).hexdigest() for p in release_dir.rglob("*.png")}
    lfs_files |= {s["sha256"] for s in manifest["shards"]}
    lfs_files |= {hashlib.sha256(p.read_bytes()).hexdigest() for p in (release_dir / rf.INDEX_DIR).glob("*.parquet")}
    # The server stops answering large-file uploads after two; the publishing process is then killed.
    hub.faults.hold_lfs_after = 2
    # A killed process cannot remove its temporary folder: it goes under the test's own.
    (tmp_path / "tmp").mkdir()
    env = client_env(hub.url, tmp_path / "hf_home", HF_TOKEN=TOKEN, TMPDIR=str(tmp_path / "tmp"))
    script = "import sys; from builder.publish import publish_release; publish_release(sys.argv[1], sys.argv[2])"
    proc = subprocess.Popen([sys.executable, "-c", script, str(release_dir), REPO], env=env, cwd=ROOT)
    try:
        while hub.faults.held == 0 and proc.poll() is None:  # no deadline: a busy machine only takes longer
            time.sleep(0.05)
        assert hub.faults.held > 0, "the publish never reached the held upload"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    uploaded_before = hub.lfs_puts_ok  # two, plus uploads that were already in flight on other threads
    assert 2 <= uploaded_before < len(lfs_files)
    assert hub.refs("datasets", REPO)["tags"] == []
    assert len(hub.commits("datasets", REPO)) == 1  # only the repo's initial commit

    hub.faults.hold_lfs_after = None
    hub.faults.release.set()
    result = publish_release(release_dir, REPO)
    # Only the missing objects were uploaded again; one release commit; tagged.
    assert hub.lfs_puts_ok == len(lfs_files)
    assert len(hub.commits("datasets", REPO)) == 2
    assert hub.resolve("datasets", REPO, "v1.0.0") == result.commit
    entries = hub.entries("datasets", REPO, "v1.0.0")
    assert set(entries) == release_files(release_dir) | {".gitattributes"}


def test_publish_interrupted_before_tag_resumes_without_new_commit(hub_env, tmp_path):
    hub = hub_env
    release_dir, _ = release(tmp_path)
    hub.faults.fail = {"tag": [403]}  # not transient: the publish stops after its commit
    with pytest.raises(Exception, match="403"):
        publish_release(release_dir, REPO)
    head = hub.resolve("datasets", REPO, "main")
    assert hub.refs("datasets", REPO)["tags"] == []
    puts = hub.lfs_puts_ok
    result = publish_release(release_dir, REPO)
    assert result.commit == head
    assert hub.lfs_puts_ok == puts  # nothing re-uploaded
    assert len(hub.commits("datasets", REPO)) == 2
    assert hub.resolve("datasets", REPO, "v1.0.0") == head


def test_release_failing_verification_is_not_published(hub_env, tmp_path):
    release_dir, manifest = release(tmp_path)
    shard = release_dir / manifest["shards"][0]["path"]
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF  # corrupt a byte inside the first member's content
    shard.write_bytes(bytes(data))
    with pytest.raises(PublishError, match="failed verification"):
        publish_release(release_dir, REPO)
    assert hub_env.log == []


def test_publish_results_adds_leaderboard_without_moving_tags(hub_env, tmp_path, capsys, cli):
    hub = hub_env
    release_dir, manifest = release(tmp_path)
    publish_release(release_dir, REPO)
    tags_before = hub.refs("datasets", REPO)["tags"]
    # The layout `lance-cf eval --output OUT` writes: OUT/<model slug>/results.json, plus other files.
    results_dir = tmp_path / "eval-out"
    metrics = {"accuracy": "1", "paired_accuracy_drop": "1", "flip_rate": "1"}
    for model, cf_acc in (("resnet18", 61.5), ("hf-hub:org/vit_tiny", 70.25)):
        result = make_results(manifest, model, cf_acc, schema_version=3, computed_metrics=metrics)
        slug = result["model"]["slug"]
        (results_dir / slug).mkdir(parents=True)
        (results_dir / slug / "results.json").write_text(json.dumps(result))
    (results_dir / "run-config.json").write_text(json.dumps({"batch_size": 64}))  # not a results file: ignored

    assert cli("publish-results", str(results_dir), "--repo-id", REPO) == 0
    out = capsys.readouterr().out
    assert "results/v1.0.0/resnet18.json" in out and "results/v1.0.0/hf-hub-org_vit_tiny.json" in out

    assert hub.refs("datasets", REPO)["tags"] == tags_before
    main = hub.entries("datasets", REPO, "main")
    card = hub.read_file("datasets", REPO, main["README.md"]).decode()
    table = hub.read_file("datasets", REPO, main["results/leaderboard.md"]).decode()
    # The card embeds evaluation's ranked table (best paired delta first).
    assert "## Leaderboard" in card and "| 1 | hf-hub:org/vit\\_tiny | 80.00 | 70.25 | -9.75 |" in card
    assert card.index("vit\\_tiny") < card.index("| resnet18 |")
    # The Markdown table is evaluation's ranked table, one section per release (best paired delta first).
    assert table.startswith("# Leaderboard\n\n## lance-demo v1.0.0\n")
    assert table.index("vit\\_tiny") < table.index("| resnet18 |")
    assert set(p for p in main if p.startswith("results/")) == {
        "results/leaderboard.md",
        "results/leaderboard.parquet",
        "results/leaderboard.tar",
        "results/v1.0.0/resnet18.json",
        "results/v1.0.0/hf-hub-org_vit_tiny.json",
    }
    tagged_card = hub.read_file("datasets", REPO, hub.entries("datasets", REPO, "v1.0.0")["README.md"]).decode()
    assert "## Leaderboard" not in tagged_card
    # The rest of the card is untouched: the same prose, and the same YAML plus the `leaderboard` config.
    front, body = split_card(card)
    tagged_front, tagged_body = split_card(tagged_card)
    assert body.replace(body[body.index("## Leaderboard") : body.index("## How it was built")], "") == tagged_body
    leaderboard_config = {
        "config_name": "leaderboard",
        "data_files": [{"split": "train", "path": "results/leaderboard.tar"}],
    }
    assert front["configs"] == [*tagged_front["configs"], leaderboard_config]
    assert front["dataset_info"][:-1] == tagged_front["dataset_info"]
    assert front["dataset_info"][-1]["config_name"] == "leaderboard"
    assert front["dataset_info"][-1]["splits"] == [{"name": "train", "num_examples": 2}]
    assert {k: v for k, v in front.items() if k not in ("configs", "dataset_info")} == {
        k: v for k, v in tagged_front.items() if k not in ("configs", "dataset_info")
    }
    # The table loads over HTTP as the `leaderboard` config: one row per model and config, the same rows as the
    # Parquet file beside it.
    rows = load_leaderboard_over_http(hub, tmp_path)
    assert sorted((r["model"], r["config"], r["acc1"], r["paired_delta_acc1"], r["release_version"]) for r in rows) == [
        ("hf-hub:org/vit_tiny", "counterfactual", 70.25, -9.75, "1.0.0"),
        ("resnet18", "counterfactual", 61.5, -18.5, "1.0.0"),
    ]
    assert all(r["complete"] and r["limit"] is None for r in rows)
    import io

    import pandas as pd

    parquet = pd.read_parquet(io.BytesIO(hub.read_file("datasets", REPO, main["results/leaderboard.parquet"])))
    assert sorted(parquet["model"]) == sorted(r["model"] for r in rows)
    assert sorted(parquet["acc1"]) == sorted(r["acc1"] for r in rows)
    # provenance: which release (id, version, manifest digest) and which metrics at which versions, on every row
    assert set(parquet["release_id"]) == {REPO} and set(parquet["release_version"]) == {"1.0.0"}
    assert set(parquet["manifest_sha256"]) == {manifest["manifest_sha256"]}
    assert [json.loads(v) for v in parquet["metric_versions"]] == [metrics] * 2
    assert f"Release `{REPO}` v1.0.0, manifest sha256 `{manifest['manifest_sha256']}`" in table

    # Re-running with the same results is a no-op: no new commit.
    commits = len(hub.commits("datasets", REPO))
    assert cli("publish-results", str(results_dir), "--repo-id", REPO) == 0
    assert len(hub.commits("datasets", REPO)) == commits

    # Results computed on other data, or on a version never published here, are refused and nothing is written.
    stray = json.loads((results_dir / "resnet18" / "results.json").read_text())
    for release_fields, message in (
        ({"manifest_sha256": "0" * 64}, "manifest sha256"),
        ({"version": "9.9.9"}, "has no tag v9.9.9"),
    ):
        other = tmp_path / f"stray-{message.split()[-1]}" / "results.json"
        other.parent.mkdir()
        other.write_text(json.dumps({**stray, "release": {**stray["release"], **release_fields}}))
        assert cli("publish-results", str(other.parent), "--repo-id", REPO) == 1
        assert message in capsys.readouterr().err
    assert len(hub.commits("datasets", REPO)) == commits


def test_refused_token_is_one_clear_line_without_the_token(hub_env, tmp_path, monkeypatch, capsys, cli):
    release_dir, _ = release(tmp_path)
    wrong = "hf_wrong_token_never_printed_42"
    monkeypatch.setenv("HF_TOKEN", wrong)
    assert cli("publish", str(release_dir), "--repo-id", REPO) == 1
    err = capsys.readouterr().err
    assert "401" in err and "HF_TOKEN" in err and hub_env.url in err
    assert "Traceback" not in err and wrong not in err
    assert not hub_env.exists("datasets", REPO)  # refused before anything was created


def test_real_eval_of_the_hub_release_publishes_to_its_leaderboard(hub_env, tmp_path, monkeypatch, cli):
    """The whole chain over HTTP: builder release -> publish -> `lance-cf eval --release ORG/NAME@v1.0.0` (downloaded
    from the double) -> `publish-results` of that real output -> the card's leaderboard on main, tags unmoved."""
    from huggingface_hub import constants

    hub = hub_env
    release_dir, manifest = built_release(tmp_path, "1.0.0", ["cat", "dog", "zebra"], per_class=2)
    publish_release(release_dir, REPO)
    tags_before = hub.refs("datasets", REPO)["tags"]
    # huggingface_hub fixed its default endpoint at import; the eval reads HF_ENDPOINT (set by hub_env) when it runs
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}"
    )

    class_map = tmp_path / "map.txt"
    class_map.write_text("0\n1\n2\n")
    out = tmp_path / "eval-out"
    assert (
        cli(
            *["eval", "--release", f"{REPO}@v1.0.0", "--model", "test_vit", "--no-pretrained", "--class-map"],
            *[
                str(class_map),
                "--workers",
                "0",
                "--bootstrap",
                "0",
                "--no-insights",
                "--no-report",
                "--output",
                str(out),
            ],
        )
        == 0
    )
    result = json.loads((out / manifest["name"] / "test_vit__random" / "results.json").read_text())
    assert result["release"]["revision"] == "v1.0.0"
    assert result["release"]["manifest_sha256"] == manifest["manifest_sha256"]
    assert {c: result["metrics"][c]["n"] for c in manifest["configs"]} == {
        c: manifest["counts"][c]["total"] for c in manifest["configs"]
    }

    assert cli("publish-results", str(out), "--repo-id", REPO) == 0
    assert hub.refs("datasets", REPO)["tags"] == tags_before
    main = hub.entries("datasets", REPO, "main")
    assert json.loads(hub.read_file("datasets", REPO, main["results/v1.0.0/test_vit__random.json"])) == result
    card = hub.read_file("datasets", REPO, main["README.md"]).decode()
    row = next(line for line in card.splitlines() if "test\\_vit" in line and line.startswith("| 1 |"))
    assert row.startswith("| 1 | test\\_vit (random weights) |")  # evaluation's ranked table, in the card
    assert f"| {result['metrics']['counterfactual']['acc1']:.2f} |" in row
