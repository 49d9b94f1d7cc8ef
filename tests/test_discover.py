"""Failure discovery end to end on deterministic stand-ins with a PLANTED failure (see tiny_discovery_components).

The stand-in generator paints the colour a prompt names (or a seeded one), the stand-in timm model misclassifies red
images, and the stand-in captioner names the dominant colour: discovery must find "red", with statistics that are
recomputed here independently; a null model (errors independent of colour) must yield no discovery over several seeds.
"""

from __future__ import annotations

import json
import math

import pytest

from builder.discovery.run import ClassTarget, Discovery, DiscoveryComponents, DiscoverySettings, discovered
from lance_pipeline.discovery.method import ClusteringSettings
from lance_pipeline.tiny.discovery_components import (
    ColourCaptioner,
    PaletteGenerator,
    colour_histogram_embedder,
    planted_classifier_fn,
)

CLASSES = [ClassTarget(0, "tench", "fish", "tench"), ClassTarget(1, "goldfish", "fish", "goldfish")]


def _components(planted, null_error_rate=0.0, fail_after=None, generated=None):
    """Stand-in components; ``generated`` collects how many images each generate() call made."""
    generator = PaletteGenerator([t.name for t in CLASSES])
    real = generator.generate

    def counted(prompts, seeds):
        if fail_after is not None and generated is not None and len(generated) >= fail_after:
            raise KeyboardInterrupt  # a kill in the middle of the discovery
        images = real(prompts, seeds)
        if generated is not None:
            generated.append(len(images))
        return images

    generator.generate = counted
    name = "planted" if planted else "null"
    return DiscoveryComponents(
        generator=generator,
        classifiers={name: planted_classifier_fn(2, planted, null_error_rate)},
        captioner=ColourCaptioner(),
        embedder=colour_histogram_embedder,
    )


def _settings(seed=0, **kw):
    values = {"n_base": 60, "n_test": 40, "seed": seed, "batch_size": 16,
              "clustering": ClusteringSettings(min_cluster_size=4, images_per_cluster=50)}  # fmt: skip
    return DiscoverySettings(**{**values, **kw})


def _hypergeom_upper_tail(a, row1, col1, total):
    return sum(
        math.comb(row1, x) * math.comb(total - row1, col1 - x) for x in range(a, min(row1, col1) + 1)
    ) / math.comb(total, col1)


def test_planted_failure_is_discovered_and_described_with_the_planted_word(tmp_path):
    run = Discovery(tmp_path / "out", CLASSES, _components("red"), _settings())
    document = run.run()
    run.close()
    found = discovered(document)
    assert {(r["class_name"], r["refined_description"]) for r in found} == {("tench", "red"), ("goldfish", "red")}
    for row in found:
        assert row["rate"] == 1.0  # every red image fails
        # statistics recomputed independently from the counts
        entry = next(e for e in document["models"]["planted"]["classes"] if e["class_name"] == row["class_name"])
        k0, n0 = entry["base"]["failures"], entry["base"]["n"]
        k1, n1 = round(row["rate"] * row["n"]), row["n"]
        assert row["p_value"] == pytest.approx(_hypergeom_upper_tail(k1, n1, k1 + k0, n1 + n0), rel=1e-9)
        assert 0 < k0 < n0  # about a fifth of the baseline is red
    json.dumps(document)  # serialisable as discoveries.json


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_null_model_yields_no_discovery(tmp_path, seed):
    run = Discovery(tmp_path / "out", CLASSES, _components(None, null_error_rate=0.25), _settings(seed=seed))
    document = run.run()
    run.close()
    assert discovered(document) == []
    assert document["models"]["null"]["descriptions_tested"] >= 1  # descriptions were tested, none passed


def test_killed_discovery_resumes_without_regenerating_and_gives_the_same_result(tmp_path):
    clean_calls: list[int] = []
    clean = Discovery(tmp_path / "clean", CLASSES, _components("red", generated=clean_calls), _settings())
    expected = clean.run()
    clean.close()
    out = tmp_path / "killed"
    before_kill: list[int] = []
    first = Discovery(out, CLASSES, _components("red", fail_after=5, generated=before_kill), _settings())
    with pytest.raises(KeyboardInterrupt):
        first.run()
    first.close()
    after_kill: list[int] = []
    second = Discovery(out, CLASSES, _components("red", generated=after_kill), _settings())
    assert second.run() == expected
    second.close()
    assert len(before_kill) == 5 and after_kill
    assert sum(before_kill) + sum(after_kill) == sum(clean_calls)  # nothing finished was generated twice


def test_other_settings_in_the_same_output_are_refused(tmp_path):
    Discovery(tmp_path / "out", CLASSES, _components("red"), _settings()).close()
    with pytest.raises(ValueError, match="other settings"):
        Discovery(tmp_path / "out", CLASSES, _components("red"), _settings(n_base=10))


def _run(capsys, *args):
    from builder.cli import main

    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.e2e
def test_discover_demo_command_writes_discoveries_and_a_report_that_renders(tmp_path, capsys):
    import re
    import shutil
    import subprocess

    out = tmp_path / "disc"
    args = ("discover", "--demo", "--output", str(out), "--n-base", "60", "--n-test", "30", "--no-progress")
    code, stdout, _ = _run(capsys, *args)
    assert code == 0 and "2 discovered failure(s)" in stdout and '+ "red"' in stdout
    document = json.loads((out / "discoveries.json").read_text())
    assert document["schema"] == "lance-cf/discoveries"
    assert {r["refined_description"] for r in discovered(document)} == {"red"}
    page = (out / "report.html").read_text()
    assert "planted failure" in page and page.count("<figure>") >= 4
    browser = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    if browser is None:
        pytest.skip("no Chromium here (make test installs it)")
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
    assert _run(capsys, *args)[0] == 0
    assert json.loads((out / "discoveries.json").read_text()) == document
    # the discovered-failure images are a release like every other: one config per discovery, full metadata
    import datasets

    from builder.release_format.verify import verify_release

    release = out / "release"
    assert verify_release(release) == []
    manifest = json.loads((release / "manifest.json").read_text())
    assert sorted(manifest["configs"]) == sorted(
        ["planted_colour_classifier_goldfish_red", "planted_colour_classifier_tench_red"]
    )
    rows = datasets.load_dataset(str(release), "planted_colour_classifier_tench_red", split="test",
                                 cache_dir=str(tmp_path / "hf"))  # fmt: skip
    assert len(rows) == 30
    for row in rows:
        meta = row["json"]
        assert meta["label_name"] == "tench" and meta["discovery"] == "red" and meta["probe_prediction"] != 0
        assert meta["prompt"].endswith(", red") and meta["failure_rate"] == 1.0
    from croissant_check import assert_croissant_matches_datasets

    assert assert_croissant_matches_datasets(release, tmp_path) == sum(c["total"] for c in manifest["counts"].values())
    code, stdout, _ = _run(capsys, "eval", "--release", str(release), "--model", "resnet18", "--no-pretrained",
                           "--output", str(tmp_path / "eval"), "--no-insights", "--device", "cpu")  # fmt: skip
    assert code == 0 and "planted_colour_classifier_tench_red: acc@1" in stdout


def test_discover_needs_a_model_and_classes_in_one_line(tmp_path, capsys):
    code, _, err = _run(capsys, "discover", "--output", str(tmp_path / "x"))
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
    from lance_pipeline.discovery.method import merge_captions

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
        settings=ClusteringSettings(min_cluster_size=1, images_per_cluster=100),
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


def test_discover_release_mode_through_the_cli(tmp_path, capsys):
    from release_fixture import write_release

    root = write_release(tmp_path / "release", labels=(1, 2), originals_per_class=2, edits_per_original=2)
    out = tmp_path / "disc"
    code, stdout, _ = _run(capsys, "discover", "--release", str(root), "--model", "resnet18", "--no-pretrained",
                           "--clip-model", "demo:tiny-open-clip", "--output", str(out), "--device", "cpu")  # fmt: skip
    assert code == 0 and "failure cluster(s)" in stdout
    document = json.loads((out / "discoveries.json").read_text())
    entries = document["models"]["resnet18"]["classes"]
    assert {e["label"] for e in entries} == {1, 2} and all(e["n"] == 4 for e in entries)
    code, _, err = _run(capsys, "discover", "--release", str(tmp_path), "--model", "x", "--output", str(out))
    assert code == 2 and "not a release directory" in err


@pytest.mark.e2e
def test_discover_runs_on_the_real_components_at_tiny_size(tmp_path, capsys):
    """The real path (Stable Diffusion generator, BLIP-2 captioner, CLIP, a timm model) on tiny random-weight
    components: nothing meaningful can be found, but every step runs, is recorded and names models by reference."""
    out = tmp_path / "real"
    args = ("discover", "--model", "resnet18", "--no-pretrained", "--classes", "tench,goldfish", "--output", str(out),
            "--generator", "demo:tiny-stable-diffusion", "--captioner", "demo:tiny-blip2",
            "--clip-model", "demo:tiny-open-clip", "--steps", "2", "--image-size", "32", "--n-base", "6",
            "--n-test", "4", "--batch-size", "6", "--device", "cpu", "--no-progress", "--no-release")  # fmt: skip
    code, stdout, _ = _run(capsys, *args)
    assert code == 0 and "discovered failure(s)" in stdout
    document = json.loads((out / "discoveries.json").read_text())
    assert document["generator"]["model"] == "demo:tiny-stable-diffusion"
    assert document["captioner"]["model"] == "demo:tiny-blip2"
    for entry in document["models"]["resnet18"]["classes"]:
        assert entry["base"]["n"] == 6 and entry["superclass"] == "cyprinid"
        for cluster in entry["clusters"]:
            assert len(cluster["captions"]) == len(cluster["members"])  # every member captioned by the tiny BLIP-2
    assert str(tmp_path) not in (out / "discoveries.json").read_text()
