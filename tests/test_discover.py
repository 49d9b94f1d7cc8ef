"""Failure discovery's bookkeeping and command line, on deterministic stand-ins with a planted failure
(``lance_pipeline/tiny/discovery_components.py``): resume after a kill, refused settings, the checks that come before
any model runs, the demo command end to end, discovery over an existing release, and the real components at tiny
size. The method's findings on planted failures are tested in ``test_discovery_planted.py``.
"""

from __future__ import annotations

import json

import pytest

from builder.discovery.run import Discovery
from lance_pipeline.discovery.clustering import ClusteringSettings
from lance_pipeline.discovery.search import ClassTarget, DiscoverySettings, discovered
from lance_pipeline.tiny.discovery_components import NULL, PLANTED_RED, create_demo_components

CLASSES = [ClassTarget(0, "tench", "fish", "tench"), ClassTarget(1, "goldfish", "fish", "goldfish")]


def _components(fail_after=None, generated=None):
    """The planted-red stand-ins; ``generated`` collects how many images each generate() call made."""
    components = create_demo_components(PLANTED_RED, [t.name for t in CLASSES])
    real = components.generator.generate

    def counted(prompts, seeds):
        if fail_after is not None and generated is not None and len(generated) >= fail_after:
            raise KeyboardInterrupt  # a kill in the middle of the discovery
        images = real(prompts, seeds)
        if generated is not None:
            generated.append(len(images))
        return images

    components.generator.generate = counted
    return components


def _settings(seed=0, **kw):
    """Small runs: these tests are about bookkeeping, not statistics (test_discovery_planted.py uses the defaults)."""
    return DiscoverySettings(**{"n_base": 40, "n_test": 20, "seed": seed, "batch_size": 16, **kw})


@pytest.mark.slow
def test_killed_discovery_resumes_without_regenerating_and_gives_the_same_result(tmp_path):
    clean_calls: list[int] = []
    clean = Discovery(tmp_path / "clean", CLASSES, _components(generated=clean_calls), _settings())
    expected = clean.run()
    clean.close()
    out = tmp_path / "killed"
    before_kill: list[int] = []
    first = Discovery(out, CLASSES, _components(fail_after=5, generated=before_kill), _settings())
    with pytest.raises(KeyboardInterrupt):
        first.run()
    first.close()
    after_kill: list[int] = []
    second = Discovery(out, CLASSES, _components(generated=after_kill), _settings())
    assert second.run() == expected
    second.close()
    assert len(before_kill) == 5 and after_kill
    assert sum(before_kill) + sum(after_kill) == sum(clean_calls)  # nothing finished was generated twice


def test_other_settings_in_the_same_output_are_refused(tmp_path):
    Discovery(tmp_path / "out", CLASSES, _components(), _settings()).close()
    with pytest.raises(ValueError, match="other settings"):
        Discovery(tmp_path / "out", CLASSES, _components(), _settings(n_base=10))
    other = create_demo_components(NULL, [t.name for t in CLASSES])  # same model name, another planted rule
    loaded = []
    other.loaders.append(lambda: loaded.append(True))
    with pytest.raises(ValueError, match="other settings"):
        Discovery(tmp_path / "out", CLASSES, other, _settings())
    assert loaded == []  # refused before any model was loaded


@pytest.mark.e2e
def test_discover_demo_command_writes_discoveries_and_a_report_that_renders(tmp_path, capsys, lance_cf):
    import re
    import shutil
    import subprocess

    out = tmp_path / "disc"
    args = ("discover", "--demo", "--output", str(out), "--n-base", "60", "--n-test", "30", "--no-progress")
    code, stdout, _ = lance_cf(*args)
    assert (
        code == 0 and "2 discovered failure(s)" in stdout and '+ "red" (by the target label and total test)' in stdout
    )
    assert f"next:\n  lance-cf verify {out / 'release'}\n  lance-cf eval --release {out / 'release'} --model " in stdout
    document = json.loads((out / "discoveries.json").read_text())
    assert document["schema"] == "lance-cf/discoveries"
    assert {r["refined_description"] for r in discovered(document)} == {"red"}
    page = (out / "report.html").read_text()
    assert "planted failure" in page and page.count("<figure>") >= 4
    browser = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    if browser is None:
        pytest.skip("no Chromium here (make test-e2e installs it)")
    probe = out / "_probe.html"
    probe.write_text(page.replace("</body>", "<script>window.addEventListener('load', () => { const p = document."
                                  "createElement('pre'); p.id = 'probe'; p.textContent = JSON.stringify(Array.from("
                                  "document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])); "
                                  "document.body.appendChild(p); });</script></body>"))  # fmt: skip
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
               "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    match = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.S)
    assert match, result.stderr[-2000:]
    images = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert len(images) >= 5 and all(complete and width > 0 for _, complete, width in images), images
    # resumable: the same command again regenerates nothing and gives the same document
    assert lance_cf(*args)[0] == 0
    assert json.loads((out / "discoveries.json").read_text()) == document
    # the discovered-failure images are a release like every other: one config per discovery, full metadata
    import datasets

    from builder.release_format.verify import verify_release

    release = out / "release"
    assert verify_release(release) == []
    manifest = json.loads((release / "manifest.json").read_text())
    assert sorted(manifest["configs"]) == sorted(
        ["planted_colour_classifier_goldfish_red_pond", "planted_colour_classifier_tench_red_pond"]
    )
    rows = datasets.load_dataset(str(release), "planted_colour_classifier_tench_red_pond", split="test",
                                 cache_dir=str(tmp_path / "hf"))  # fmt: skip
    assert len(rows) == 30
    for row in rows:
        meta = row["json"]
        assert meta["label_name"] == "tench" and meta["discovery"] == "red pond" and meta["probe_prediction"] == 1
        assert meta["refined_description"] == "red" and meta["discovered_by"] == "target_label,total"
        assert meta["prompt"].endswith(", red pond") and meta["failure_rate"] == 1.0 and meta["target_rate"] == 1.0
        assert meta["target_label"] == 1 and 0 < meta["target_base_rate"] < 1 and meta["target_q_value"] < 0.05
    # the card lists the discovery deviations that apply to a demo release (stand-ins; no generator or captioner row)
    card = (release / "README.md").read_text()
    assert "**Failure discovery (`lance-cf discover`)**" in card and "| stand-ins |" in card
    assert "| generator |" not in card and "| refinement |" in card
    assert manifest["source"]["discovery"]["stand_in"] is True and manifest["source"]["discovery"]["n_base"] == 60
    # ... and a table of the discovered failures, one row per config, from the manifest
    section = card.split("## Discovered failures", 1)[1].split("\n## ", 1)[0]
    assert section.count("| `planted_colour_classifier_") == 2
    assert (
        "| red pond | red (total 100%, q " in section
        and "; vs full q 1) | target label and total | goldfish (1)" in (section)
    )
    # every image passed the safety checker before its shard was written (the demo's tiny checker flags nothing)
    assert manifest["screening"]["safety"] | {"fields": None} == {
        "fields": None, "kind": "safety_checker", "checked": 60, "flagged": 0, "removed": {"image": 0},
    }  # fmt: skip
    assert all(row["json"]["safety_nsfw"] is False and row["json"]["safety_score"] <= 0 for row in rows)
    _check_discovery_release_safety(out, tmp_path)
    assert manifest["kind"] == "discovery"
    from croissant_check import assert_croissant_matches_datasets

    assert assert_croissant_matches_datasets(release, tmp_path) == sum(c["total"] for c in manifest["counts"].values())
    code, stdout, _ = lance_cf("eval", "--release", str(release), "--model", "resnet18", "--no-pretrained",
                           "--output", str(tmp_path / "eval"), "--no-insights", "--device", "cpu")  # fmt: skip
    assert code == 0 and "planted_colour_classifier_tench_red_pond: acc@1" in stdout
    # ... and reviewed by people like every other kind: review apply keeps every sample and verifies
    from review_check import assert_review_apply_keeps_every_sample

    assert_review_apply_keeps_every_sample(release, tmp_path / "review")


def test_discover_needs_a_model_and_classes_in_one_line(tmp_path, capsys, lance_cf):
    code, _, err = lance_cf("discover", "--output", str(tmp_path / "x"))
    assert code == 2 and "--model" in err and len(err.strip().splitlines()) == 1


def test_discovery_on_an_existing_release_clusters_and_describes_failing_counterfactuals(tmp_path):
    """Release mode: a stand-in classifier (wrong whenever the image is reddish) on a fixture release; every count,
    cluster and description recomputed independently."""
    import io

    import numpy as np
    from PIL import Image
    from release_fixture import write_release

    from builder import release_format as rf
    from builder.discovery.run import describe_release_failures
    from lance_pipeline.discovery.descriptions import merge_captions

    root = write_release(tmp_path / "release", labels=(1, 2), originals_per_class=4, edits_per_original=3)

    def reddish(image) -> bool:
        rgb = np.asarray(image.convert("RGB"), dtype=np.float32).reshape(-1, 3).mean(0)
        return bool(rgb[0] > rgb[1])

    def classify(images):  # stand-in: the true label is unknown to it, so it reads it from a lookup by pixels
        return [lookup[np.asarray(im.convert("RGB")).tobytes()] for im in images]

    manifest = rf.load_manifest(root)
    lookup, truth = {}, {}
    for config in ("original", "counterfactual"):
        paths = [root / s.path for s in manifest.shards if s.config == config]
        for key, members in rf.read_samples(paths).items():
            meta = json.loads(members["json"])
            image = Image.open(io.BytesIO(members["png"])).convert("RGB")
            predicted = meta["label"] + 1 if reddish(image) else meta["label"]
            lookup[np.asarray(image).tobytes()] = predicted
            truth[(config, key)] = (meta, predicted)
    document = describe_release_failures(
        root, {"stand-in": classify}, lambda ims: np.stack([np.asarray(i, dtype=np.float32).mean((0, 1)) for i in ims]),
        settings=ClusteringSettings(min_cluster_size=1),
    )  # fmt: skip
    assert document["mode"] == "release" and document["release"]["config"] == "counterfactual"
    classes = document["models"]["stand-in"]["classes"]
    assert 0 < sum(e["failures"] for e in classes) < sum(e["n"] for e in classes)  # the fixture has both kinds
    for entry in document["models"]["stand-in"]["classes"]:
        cf = {k: v for (c, k), v in truth.items() if c == "counterfactual" and v[0]["label"] == entry["label"]}
        failing = {k for k, (meta, p) in cf.items() if p != meta["label"]}
        assert entry["n"] == len(cf) and entry["failures"] == len(failing)
        assert {k for c in entry["clusters"] for k in c["members"]} == failing
        for cluster in entry["clusters"]:
            metas = [cf[k][0] for k in cluster["members"]]
            assert cluster["description"] == merge_captions([m["edited_caption"] for m in metas], entry["class_name"])
            originals_right = sum(1 for m in metas if truth[("original", m["source_key"])][1] == m["label"])
            assert cluster["caused_by_edit"] == originals_right
            wrong = [cf[k][1] for k in cluster["members"]]
            assert cluster["target_label"] == min(set(wrong), key=lambda t: (-wrong.count(t), t))


@pytest.mark.slow
def test_discover_release_mode_through_the_cli(tmp_path, capsys, lance_cf):
    from release_fixture import write_release

    root = write_release(tmp_path / "release", labels=(1, 2), originals_per_class=2, edits_per_original=2)
    out = tmp_path / "disc"
    code, stdout, _ = lance_cf("discover", "--release", str(root), "--model", "resnet18", "--no-pretrained",
                           "--clip-model", "demo:tiny-open-clip", "--output", str(out), "--device", "cpu")  # fmt: skip
    assert code == 0 and "failure cluster(s)" in stdout
    document = json.loads((out / "discoveries.json").read_text())
    entries = document["models"]["resnet18"]["classes"]
    assert {e["label"] for e in entries} == {1, 2} and all(e["n"] == 4 for e in entries)
    code, _, err = lance_cf("discover", "--release", str(tmp_path), "--model", "x", "--output", str(out))
    assert code == 2 and "not a release directory" in err


@pytest.mark.e2e
def test_discover_runs_on_the_real_components_at_tiny_size(tmp_path, capsys, lance_cf):
    """The real path (Stable Diffusion generator, BLIP-2 captioner, CLIP, a timm model) on tiny random-weight
    components: nothing meaningful can be found, but every step runs, is recorded and names models by reference."""
    out = tmp_path / "real"
    args = ("discover", "--model", "resnet18", "--no-pretrained", "--classes", "tench,goldfish", "--output", str(out),
            "--generator", "demo:tiny-stable-diffusion", "--captioner", "demo:tiny-blip2",
            "--clip-model", "demo:tiny-open-clip", "--steps", "2", "--image-size", "32", "--n-base", "6",
            "--n-test", "4", "--batch-size", "6", "--device", "cpu", "--no-progress", "--no-release")  # fmt: skip
    code, stdout, _ = lance_cf(*args)
    assert code == 0 and "discovered failure(s)" in stdout
    document = json.loads((out / "discoveries.json").read_text())
    assert document["generator"]["model"] == "demo:tiny-stable-diffusion"
    assert document["captioner"]["model"] == "demo:tiny-blip2"
    for entry in document["models"]["resnet18"]["classes"]:
        assert entry["base"]["n"] == 6 and entry["superclass"] == "cyprinid"
        for cluster in entry["clusters"]:
            assert len(cluster["captions"]) == len(cluster["members"])  # every member captioned by the tiny BLIP-2
    assert str(tmp_path) not in (out / "discoveries.json").read_text()


def _no_model_may_load(monkeypatch):
    """Every model the discover command could load raises if it is loaded."""
    from builder.discovery import cli

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(cli.TimmClassifier, "load", refuse)
    monkeypatch.setattr(cli.ClipScorer, "load", refuse)
    monkeypatch.setattr(cli.ShiftGenerator, "load", refuse)
    monkeypatch.setattr(cli.LabelConditionedCaptioner, "load", refuse)


def test_bad_output_paths_and_options_fail_in_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, lance_cf):
    from release_fixture import write_release

    _no_model_may_load(monkeypatch)
    release = write_release(tmp_path / "release", labels=(1, 2), originals_per_class=1, edits_per_original=1)
    a_file = tmp_path / "results.json"
    a_file.write_text("{}")
    model = ("--model", "resnet18", "--no-pretrained", "--device", "cpu")
    generate = (*model, "--classes", "tench", "--generator", "demo:tiny-stable-diffusion", "--captioner",
                "demo:tiny-blip2", "--clip-model", "demo:tiny-open-clip")  # fmt: skip
    cases = {
        ("--release", str(release), "--output", str(a_file), *model): "is a file",
        ("--release", str(release), "--output", str(a_file / "sub"), *model): "nothing can be created under it",
        ("--output", str(a_file), *generate): "is a file",
        ("--demo", "--output", str(a_file)): "is a file",
        ("--output", str(tmp_path / "o"), *generate, "--image-size", "1000000000"): "--image-size",
        ("--output", str(tmp_path / "o"), *generate, "--steps", "0"): "--steps",
        ("--output", str(tmp_path / "o"), *generate, "--alpha", "1.5"): "alpha",
        ("--demo", "no-such-scenario", "--output", str(tmp_path / "o")): "unknown discovery demo",
        ("--demo", "nul", "--output", str(tmp_path / "o")): "did you mean 'null'",
    }
    for args, expected in cases.items():
        code, stdout, err = lance_cf("discover", *args)
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (args, err)
        assert "Traceback" not in err and stdout == ""
    assert a_file.read_text() == "{}" and not (tmp_path / "o").exists()  # nothing written


@pytest.mark.slow
def test_release_and_generating_discoveries_never_share_an_output(tmp_path, capsys, monkeypatch, lance_cf):
    from release_fixture import write_release

    out = tmp_path / "disc"
    args = ("discover", "--demo", "--output", str(out), "--n-base", "20", "--n-test", "10", "--no-progress",
            "--no-release")  # fmt: skip
    assert lance_cf(*args)[0] == 0
    before = (out / "discoveries.json").read_bytes()
    _no_model_may_load(monkeypatch)
    release = write_release(tmp_path / "release", labels=(1, 2), originals_per_class=1, edits_per_original=1)
    code, _, err = lance_cf("discover", "--release", str(release), "--model", "resnet18", "--output", str(out))
    assert code == 2 and "holds a generating discovery" in err and (out / "discoveries.json").read_bytes() == before
    release_out = tmp_path / "release-disc"
    release_out.mkdir()
    (release_out / "discoveries.json").write_text(json.dumps({"mode": "release", "release": {}, "models": {}}))
    code, _, err = lance_cf("discover", "--demo", "--output", str(release_out))
    assert code == 2 and "holds the discoveries of a release" in err
    code, _, err = lance_cf("discover", "--release", str(release), "--model", "resnet18", "--output",
                        str(release_out))  # fmt: skip
    assert code == 2 and "another release or other models" in err


def test_the_discovery_deviations_are_decided_from_the_release_manifest():
    from lance_pipeline import deviations as dv

    def topics(source):
        return [d.topic for d in dv.deviations_for({"source": source}) if d.mode == "discovery"]

    real = {"kind": "discovery", "discovery": {"stand_in": False, "refine": True}}
    assert topics(real) == ["generator", "captioner", "describing failures", "what counts as a failure found",
                            "sample sizes", "refinement"]  # fmt: skip
    demo = {"kind": "discovery", "discovery": {"stand_in": True, "refine": False}}
    assert topics(demo) == ["stand-ins", "describing failures", "what counts as a failure found", "sample sizes"]
    assert topics({"kind": "imagefolder"}) == [] and [t.name for t, _ in dv.tables_for({"source": real})] == [
        "discovery"
    ]


def test_the_card_section_of_a_discovery_release_escapes_what_comes_from_data():
    from dataset_cards.discovery_section import discovery_section

    hostile = "x | y <b>\n# heading"
    row = {
        "config": "c`1",
        "model": hostile,
        "label": 0,
        "class_name": hostile,
        "description": hostile,
        "refined_description": hostile,
        "discovered_by": ["total"],
        "target_label": 3,
        "target_rate": 0.25,
        "target_base_rate": 0.05,
        "target_q_value": 0.0123,
        "rate": 0.7,
        "base_rate": 0.2,
        "q_value": 1e-9,
        "n": 100,
    }
    section = discovery_section({"source": {"discovery": {"n_base": 200, "n_test": 100, "alpha": 0.05,
                                                          "discoveries": [row]}},
                                 "label_space": {"names": ["a", "b", "c", hostile]}})  # fmt: skip
    table_row = section.strip().splitlines()[-1]
    assert table_row.count(" | ") == 8  # nine cells: nothing from the data opened a cell, a line or a tag
    assert "<b>" not in section and "\n# heading" not in section
    assert "| total | x \\| y &lt;b&gt; \\# heading (3): 25% (5%), 0.012 | 70% (20%), 1e-09 | 100 |" in table_row
    assert discovery_section({"source": {"kind": "discovery"}}) == ""


def _check_discovery_release_safety(out, tmp_path):
    """A discovery release without a safety stage is refused unless it says `safety: off` (then the card says so);
    with a checker that flags everything, no image is released and each is a failure with its reason."""
    from builder.config import BuildConfig, StageConfig
    from builder.discovery.source import DiscoverySource
    from builder.engine import build
    from builder.validation import validate_build
    from lance_pipeline.tiny.safety_components import create_tiny_safety_checker

    spec = f"discovery:{out}"
    configs = DiscoverySource(spec, str(out)).config_names

    def config(**given):
        return BuildConfig(name="d", source=spec, configs=configs, image_size=None, **given)

    with pytest.raises(ValueError, match=r"generated images of config 'planted_colour_classifier_.*safety: off"):
        validate_build(config())
    unscreened = build(config(safety=False), tmp_path / "off", progress=False, device="cpu")
    assert unscreened["config"]["safety"] == "off" and "screening" not in unscreened or not unscreened["screening"]
    assert "**Safety checking is off** (`safety: off`" in (tmp_path / "off" / "README.md").read_text()
    flags = create_tiny_safety_checker(tmp_path / "flags", flag_everything=True)
    stage = StageConfig("safety", "safety_check_discovery", list(configs), {"model": str(flags)})
    manifest = build(config(stages=[stage]), tmp_path / "flagged", progress=False, device="cpu")
    assert sorted(manifest["empty_configs"]) == sorted(configs)
    assert len(manifest["failures"]) == 60
    assert all(f["stage"] == "safety" and f["reason"].startswith("flagged by the safety checker") for f in
               manifest["failures"])  # fmt: skip
