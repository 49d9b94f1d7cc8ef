"""The evaluation harness against values computed independently in the test.

A small custom-label release (4 classes) is scored by ``test_vit`` whose classifier is fitted in the test (so that
accuracies, flips and Delta p are not degenerate) and saved as safetensors, then loaded by the harness through
``--checkpoint``. The test decodes every image itself, applies the model's timm data-config transform, runs the
model one image at a time and recomputes every metric with numpy.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from release_fixture import write_release

from builder import release_format as rf
from evaluation.harness import EvalOptions, OOMRetryForward, predict_release
from evaluation.models import ModelSpec, expand_model_names
from evaluation.release_reader import open_release
from lance_pipeline.stage import EDIT_TYPES

NAMES = ["red square", "blue circle", "green square", "yellow circle"]
REL = "lance-fixture"  # the fixture release's name: eval writes its results under OUTPUT/<release>/
BOOT = 200


def read_release_images(root: Path) -> dict[str, list[tuple[dict, object]]]:
    """Every sample of every config, decoded with PIL directly from the tar shards (not through the harness)."""
    from PIL import Image

    out: dict[str, list] = {}
    for config in rf.CONFIG_NAMES:
        for shard in sorted((root / "data" / config).glob("test-*.tar")):
            members: dict[str, dict[str, bytes]] = {}
            with tarfile.open(shard) as tar:
                for m in tar.getmembers():
                    key, ext = m.name.split(".", 1)
                    members.setdefault(key, {})[ext] = tar.extractfile(m).read()
            for sample in members.values():
                meta = json.loads(sample["json"])
                assert int(sample["cls"]) == meta["label"]
                out.setdefault(config, []).append((meta, Image.open(io.BytesIO(sample["png"])).convert("RGB")))
    return out


def independent_probs(model, samples, indices=None) -> dict[str, np.ndarray]:
    from timm.data import create_transform, resolve_data_config

    transform = create_transform(**resolve_data_config({}, model=model, use_test_size=True))
    probs = {}
    with torch.no_grad():
        for items in samples.values():
            for meta, image in items:
                logits = model(transform(image).unsqueeze(0))[0].double().numpy()
                if indices is not None:
                    logits = logits[indices]
                e = np.exp(logits - logits.max())
                probs[meta["key"]] = e / e.sum()
    return probs


@pytest.fixture(scope="module")
def scored(tmp_path_factory, cli):
    """Release, fitted model + checkpoint, the harness output and the independent predictions."""
    import timm
    from safetensors.torch import save_file
    from timm.data import create_transform, resolve_data_config

    root = write_release(
        tmp_path_factory.mktemp("release") / "rel",
        labels=(0, 1, 2, 3),
        label_names=NAMES,
        originals_per_class=3,
        edits_per_original=3,
        shard_size=7,
    )
    samples = read_release_images(root)
    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False, num_classes=4).eval()
    # Fit the classifier on the originals' pooled features so that some originals are right and some wrong.
    transform = create_transform(**resolve_data_config({}, model=model, use_test_size=True))
    originals = samples["original"]
    with torch.no_grad():
        feats = torch.stack(
            [model.forward_head(model.forward_features(transform(im)[None]), True)[0] for _, im in originals]
        )
    targets = torch.tensor([m["label"] if i % 3 else (m["label"] + 1) % 4 for i, (m, _) in enumerate(originals)])
    onehot = torch.nn.functional.one_hot(targets, 4).double() * 6.0 - 3.0
    centred = torch.cat([feats.double(), torch.ones(len(feats), 1, dtype=torch.double)], 1)
    solution = torch.linalg.lstsq(centred, onehot).solution
    with torch.no_grad():
        model.head.weight.copy_(solution[:-1].T.float())
        model.head.bias.copy_(solution[-1].float())
    ckpt = tmp_path_factory.mktemp("ckpt") / "test_vit-4cls.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    out = tmp_path_factory.mktemp("eval")
    args = cli.parse(
        ["eval", "--release", str(root), "--model", "test_vit", "--checkpoint", str(ckpt), "--output", str(out)]
        + ["--batch-size", "5", "--workers", "2", "--bootstrap", str(BOOT), "--no-insights", "--no-report"]
    )
    assert args.func(args) == 0
    slug = ModelSpec("test_vit", checkpoint=ckpt).slug
    results = json.loads((out / REL / slug / "results.json").read_text())
    probs = independent_probs(model, samples)
    return {
        "root": root,
        "samples": samples,
        "probs": probs,
        "results": results,
        "ckpt": ckpt,
        "out": out,
        "model": model,
        "slug": slug,
    }


def expected_rows(samples, probs) -> list[dict]:
    rows = []
    for config, items in samples.items():
        for meta, _ in items:
            p = probs[meta["key"]]
            order = np.argsort(-p)
            rows.append(
                {
                    "config": config,
                    "key": meta["key"],
                    "source_key": meta["source_key"],
                    "label": meta["label"],
                    "edit_type": meta["edit_type"] or "none",
                    "p": p[meta["label"]],
                    "c1": int(order[0] == meta["label"]),
                    "c5": int(meta["label"] in order[:5]),
                }
            )
    return rows


def test_accuracy_and_delta_acc_match(scored):
    rows = expected_rows(scored["samples"], scored["probs"])
    metrics = scored["results"]["metrics"]
    assert set(metrics) == set(rf.CONFIG_NAMES)
    acc = {}
    for config in rf.CONFIG_NAMES:
        sub = [r for r in rows if r["config"] == config]
        acc[config] = (100 * np.mean([r["c1"] for r in sub]), 100 * np.mean([r["c5"] for r in sub]))
        assert metrics[config]["n"] == len(sub)
        assert metrics[config]["acc1"] == pytest.approx(acc[config][0])
        assert metrics[config]["acc5"] == pytest.approx(acc[config][1])
        for label in range(4):
            cls = [r for r in sub if r["label"] == label]
            assert metrics[config]["by_class"][str(label)]["acc1"] == pytest.approx(
                100 * np.mean([r["c1"] for r in cls])
            )
            assert metrics[config]["by_class"][str(label)]["label_name"] == NAMES[label]
    assert 0 < acc["original"][0] < 100, "fixture model should be right on some originals and wrong on others"
    for config in ("reconstructed", "counterfactual", "lance_r"):
        assert metrics[config]["delta_acc1"] == pytest.approx(acc[config][0] - acc["original"][0])
        assert metrics[config]["delta_acc5"] == pytest.approx(acc[config][1] - acc["original"][1])
    # 4 classes: every label is in the top 5
    assert metrics["counterfactual"]["acc5"] == pytest.approx(100.0)


def _pair_stats(pairs):
    dp = np.array([100 * (o["p"] - c["p"]) for c, o in pairs])
    base = [c for c, o in pairs if o["c1"]]
    flips = [c for c, o in pairs if o["c1"] and not c["c1"]]
    return {
        "n": len(pairs),
        "delta_p_gt_mean": dp.mean(),
        "delta_p_gt_abs_mean": np.abs(dp).mean(),
        "flip_rate": 100 * len(flips) / len(base) if base else None,
        "paired_delta_acc1": 100 * np.mean([c["c1"] - o["c1"] for c, o in pairs]),
    }


def test_sensitivity_delta_p_flip_rate_and_breakdowns_match(scored):
    rows = expected_rows(scored["samples"], scored["probs"])
    originals = {r["key"]: r for r in rows if r["config"] == "original"}
    pairs = [(r, originals[r["source_key"]]) for r in rows if r["config"] == "counterfactual"]
    sens = scored["results"]["sensitivity"]
    expected = _pair_stats(pairs)
    assert expected["flip_rate"] not in (None, 0.0), "fixture should produce flips"
    for name, value in expected.items():
        assert sens["overall"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert sens["overall"]["delta_p_gt_abs_mean"] > abs(sens["overall"]["delta_p_gt_mean"]) - 1e-9
    assert set(sens["by_edit_type"]) == set(EDIT_TYPES)  # the fixture's six LANCE types
    for edit_type in EDIT_TYPES:
        group = _pair_stats([(c, o) for c, o in pairs if c["edit_type"] == edit_type])
        for name, value in group.items():
            assert sens["by_edit_type"][edit_type][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (edit_type, name)
    for label in range(4):
        group = _pair_stats([(c, o) for c, o in pairs if c["label"] == label])
        for name, value in group.items():
            assert sens["by_class"][str(label)][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (label, name)
    lance_r = [(r, originals[r["source_key"]]) for r in rows if r["config"] == "lance_r"]
    other = scored["results"]["sensitivity_by_config"]["lance_r"]["overall"]
    assert other["delta_p_gt_mean"] == pytest.approx(_pair_stats(lance_r)["delta_p_gt_mean"], rel=1e-4, abs=1e-6)


def test_bootstrap_intervals_match_a_loop_bootstrap(scored):
    """Same documented draws (clusters = sorted source keys), statistics recomputed with a plain loop."""
    rows = expected_rows(scored["samples"], scored["probs"])
    clusters = sorted({r["source_key"] for r in rows})
    draws = np.random.default_rng(0).integers(0, len(clusters), size=(BOOT, len(clusters)))
    originals = {r["key"]: r for r in rows if r["config"] == "original"}
    acc1_orig, acc1_cf, delta, dp, flip = [], [], [], [], []
    for draw in draws:
        chosen = [clusters[i] for i in draw]
        orig = [originals[k] for k in chosen]
        cf = [r for k in chosen for r in rows if r["config"] == "counterfactual" and r["source_key"] == k]
        a_o, a_c = 100 * np.mean([r["c1"] for r in orig]), 100 * np.mean([r["c1"] for r in cf])
        acc1_orig.append(a_o)
        acc1_cf.append(a_c)
        delta.append(a_c - a_o)
        dp.append(np.mean([100 * (originals[r["source_key"]]["p"] - r["p"]) for r in cf]))
        base = [r for r in cf if originals[r["source_key"]]["c1"]]
        flip.append(100 * np.mean([not r["c1"] for r in base]) if base else np.nan)
    m = scored["results"]["metrics"]
    assert m["original"]["acc1_ci"] == pytest.approx(list(np.percentile(acc1_orig, [2.5, 97.5])))
    assert m["counterfactual"]["acc1_ci"] == pytest.approx(list(np.percentile(acc1_cf, [2.5, 97.5])))
    assert m["counterfactual"]["delta_acc1_ci"] == pytest.approx(list(np.percentile(delta, [2.5, 97.5])))
    overall = scored["results"]["sensitivity"]["overall"]
    assert overall["delta_p_gt_mean_ci"] == pytest.approx(list(np.percentile(dp, [2.5, 97.5])), rel=1e-4)
    flip = np.array(flip)
    assert overall["flip_rate_ci"] == pytest.approx(list(np.percentile(flip[np.isfinite(flip)], [2.5, 97.5])))
    lo, hi = overall["delta_p_gt_mean_ci"]
    assert lo <= overall["delta_p_gt_mean"] <= hi and lo < hi


def test_results_record_release_model_and_packages(scored):
    r = scored["results"]
    manifest = json.loads((scored["root"] / "manifest.json").read_text())
    assert r["schema"] == "lance-cf/eval-results" and r["status"] == "ok"
    assert r["release"]["name"] == manifest["name"] and r["release"]["version"] == manifest["version"]
    assert r["release"]["manifest_sha256"] == manifest["manifest_sha256"]
    assert r["model"]["name"] == "test_vit"
    assert r["model"]["weights"]["source"] == "checkpoint"
    assert (
        r["model"]["weights"]["checkpoint_sha256"]
        == __import__("hashlib").sha256(scored["ckpt"].read_bytes()).hexdigest()
    )
    assert r["model"]["num_classes"] == 4
    assert r["model"]["data_config"]["input_size"] == [3, 160, 160]
    assert {"torch", "timm", "python"} <= set(r["packages"])
    # every sample scored exactly once even though two workers strode over shards of 7 samples
    import pandas as pd

    preds = pd.read_parquet(scored["out"] / REL / scored["slug"] / "predictions.parquet")
    assert sorted(preds["key"]) == sorted(scored["probs"])


def test_rerun_skips_same_weights_and_reruns_new_weights(scored, tmp_path, caplog, cli):
    from safetensors.torch import load_file, save_file

    base = ["eval", "--release", str(scored["root"]), "--model", "test_vit", "--output", str(scored["out"])]
    # same result options as the fixture's run (workers and batch size only change rounding: not part of the key)
    opts = ["--workers", "0", "--batch-size", "3", "--bootstrap", str(BOOT), "--no-insights", "--no-report"]
    results_file = scored["out"] / REL / scored["slug"] / "results.json"
    before = results_file.stat().st_mtime_ns
    args = cli.parse([*base, "--checkpoint", str(scored["ckpt"]), *opts])
    caplog.set_level("INFO")
    assert args.func(args) == 0
    assert results_file.stat().st_mtime_ns == before
    assert "skipping" in caplog.text
    opts = ["--workers", "0", "--bootstrap", "0", "--no-insights", "--no-report"]
    state = load_file(str(scored["ckpt"]))
    state["head.bias"] = state["head.bias"] + 1.0
    other = tmp_path / "other.safetensors"
    save_file(state, str(other))
    args = cli.parse([*base, "--checkpoint", str(other), *opts])
    assert args.func(args) == 0
    new = json.loads((scored["out"] / REL / ModelSpec("test_vit", checkpoint=other).slug / "results.json").read_text())
    assert new["model"]["weights"]["id"] != scored["results"]["model"]["weights"]["id"]


@pytest.mark.slow
def test_label_space_mismatch_errors_and_class_map_scores(scored, tmp_path, cli):
    out = tmp_path / "out"
    common = ["--release", str(scored["root"]), "--output", str(out), "--no-pretrained", "--workers", "0"]
    common += ["--bootstrap", "0", "--no-insights", "--no-report"]
    # test_vit has 1000 outputs, the release 4 labels: an error row, and the run exits 1
    args = cli.parse(["eval", "--model", "test_vit", *common])
    assert args.func(args) == 1
    error = json.loads((out / REL / "test_vit__random" / "results.json").read_text())
    assert error["status"] == "error" and "--class-map" in error["error"] and "1000" in error["error"]
    # with a class map: softmax over the mapped logits, checked independently
    class_map = tmp_path / "map.txt"
    indices = [7, 99, 3, 512]
    class_map.write_text("\n".join(map(str, indices)) + "\n")
    torch.manual_seed(0)
    spec = ModelSpec("test_vit", pretrained=False, class_map=class_map)
    release = open_release(scored["root"])
    from evaluation.models import create_eval_model

    model = create_eval_model(spec)
    from timm.data import resolve_data_config

    rows, timing = predict_release(
        model,
        release,
        resolve_data_config({}, model=model, use_test_size=True),
        EvalOptions(workers=0, batch_size=4),
        indices,
    )
    probs = independent_probs(model, scored["samples"], indices)
    assert timing["images"] == len(probs) == len(rows)
    for row in rows:
        p = probs[row["key"]]
        assert row["p_gt"] == pytest.approx(p[row["label"]], rel=1e-4)
        assert row["top5"][:4] == list(np.argsort(-p)[:4])


def test_an_image_in_two_configs_runs_through_the_model_once_and_scores_as_the_model_scores_it(tmp_path):
    """A release with a strength sweep holds each counterfactual twice (its selected strength row has the same bytes):
    the harness runs every distinct image once, and every row's p(y_GT) and top 3 are the model's for that image."""
    import timm
    from timm.data import resolve_data_config

    from builder.release_format.verify import verify_release

    root = write_release(tmp_path / "rel", originals_per_class=2, edits_per_original=2, strength_levels=(0.4, 0.8))
    assert verify_release(root) == []  # a valid release: the sweep's declared fields and relations hold
    images: dict[str, tuple[bytes, int]] = {}  # every sample's image bytes and label, read from the tars here
    for shard in sorted((root / "data").glob("*/test-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in members.items():
            if name.endswith(".png"):
                key = name[: -len(".png")]
                images[key] = (data, int(members[f"{key}.cls"]))
    distinct = {(data, label) for data, label in images.values()}
    strength_rows = sum(1 for key in images if "-st" in key)
    assert 0 < len(images) - len(distinct) == strength_rows // 2  # the selected half of the sweep repeats an image

    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False).eval()

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.seen = model, 0

        def forward(self, x):
            self.seen += x.shape[0]
            return self.inner(x)

    counting = Counting().eval()
    data_config = resolve_data_config({}, model=model, use_test_size=True)
    rows, timing = predict_release(counting, open_release(root), data_config, EvalOptions(workers=0, batch_size=5))
    assert len(rows) == timing["images"] == len(images)
    assert counting.seen == timing["forwarded"] == len(distinct)

    from PIL import Image
    from timm.data import create_transform

    transform = create_transform(**data_config)
    by_key = {row["key"]: row for row in rows}
    with torch.no_grad():
        for key, (data, label) in images.items():
            logits = model(transform(Image.open(io.BytesIO(data)).convert("RGB")).unsqueeze(0))[0].double().numpy()
            p = np.exp(logits - logits.max())
            p /= p.sum()
            assert by_key[key]["p_gt"] == pytest.approx(p[label], rel=1e-4), key
            assert by_key[key]["top5"][:3] == list(np.argsort(-p)[:3]), key


def test_out_of_memory_retries_with_smaller_batches(scored):
    model = scored["model"]

    class Flaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model
            self.sizes = []

        def forward(self, x):
            self.sizes.append(x.shape[0])
            if x.shape[0] > 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return self.inner(x)

    flaky = Flaky().eval()
    release = open_release(scored["root"])
    from timm.data import resolve_data_config

    rows, timing = predict_release(
        flaky, release, resolve_data_config({}, model=model, use_test_size=True), EvalOptions(workers=0, batch_size=8)
    )
    assert timing["batch_size"] == 2 and timing["oom_retries"] >= 1
    assert max(s for s in flaky.sizes[2:]) <= 3
    for row in rows:
        assert row["p_gt"] == pytest.approx(scored["probs"][row["key"]][row["label"]], rel=1e-4)
    # a non-OOM error is not retried
    forward = OOMRetryForward(lambda x: (_ for _ in ()).throw(ValueError("bad input")), 8)
    with pytest.raises(ValueError, match="bad input"):
        forward(torch.zeros(8, 3, 4, 4))


def test_model_name_expansion(tmp_path):
    assert expand_model_names(["test_vit*"], pretrained=False)[:2] == ["test_vit", "test_vit2"]
    listing = tmp_path / "models.txt"
    listing.write_text("# models\nresnet10t\n\ntest_vit  # tiny\nresnet10t\n")
    assert expand_model_names([str(listing), "hf-hub:org/model"], pretrained=False) == [
        "resnet10t",
        "test_vit",
        "hf-hub:org/model",
    ]
    with pytest.raises(ValueError, match="matches no timm model"):
        expand_model_names(["no_such_arch_*"], pretrained=False)


def test_bad_values_raise_value_error(scored, tmp_path, cli):
    base = ["eval", "--release", str(scored["root"]), "--model", "resnet10t", "--output", str(tmp_path)]
    with pytest.raises(ValueError, match="--batch-size"):
        args = cli.parse([*base, "--batch-size", "0"])
        args.func(args)
    bad = tmp_path / "weights.pt"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError, match="safetensors"):
        args = cli.parse([*base, "--checkpoint", str(bad)])
        args.func(args)
    with pytest.raises(ValueError, match="neither an existing directory"):
        args = cli.parse(
            ["eval", "--release", str(tmp_path / "missing"), "--model", "resnet10t", "--output", str(tmp_path)]
        )
        args.func(args)


def test_hub_release_spec_downloads_the_dataset_revision(scored, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(scored["root"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    release = open_release("lance-org/lance-fixture@v1.0.0")
    assert calls[0]["repo_id"] == "lance-org/lance-fixture"
    assert calls[0]["repo_type"] == "dataset" and calls[0]["revision"] == "v1.0.0"
    assert release.revision == "v1.0.0" and release.configs == list(rf.CONFIG_NAMES)
    assert release.describe()["revision"] == "v1.0.0"


def test_insights_match_independent_clip_kmeans(scored, tmp_path):
    """Per-class K-Means on CLIP text edit directions, recomputed with open_clip + scikit-learn in the test."""
    import open_clip
    import pandas as pd
    from sklearn.cluster import KMeans

    from evaluation.insights import cluster_release_edits, summarize_clusters
    from lance_pipeline.tiny.clip_components import create_tiny_open_clip

    clip_dir = create_tiny_open_clip(tmp_path / "clip")
    options = EvalOptions(clip_model=str(clip_dir), insight_k=2, insight_top=2)
    clustering = cluster_release_edits(open_release(scored["root"]), options)
    assert clustering["clip_model"] == "local-dir:clip"  # the folder's name: results never hold a machine path
    assert options.result_options()["clip_model"] == "local-dir:clip"
    rows = pd.read_parquet(scored["out"] / REL / scored["slug"] / "predictions.parquet").to_dict("records")
    summary = summarize_clusters(clustering, rows, top=2, examples=2)

    clip = open_clip.create_model("local-dir:" + str(clip_dir)).eval()
    tokenizer = open_clip.get_tokenizer("local-dir:" + str(clip_dir))

    def embed(texts):
        with torch.no_grad():
            f = clip.encode_text(tokenizer(texts)).double()
        return (f / f.norm(dim=-1, keepdim=True)).numpy()

    probs = scored["probs"]
    # The harness's p(y_GT) and the independent one are two float32 runs of the same network that differ in rounding
    # only: timm's prefetcher normalisation ((x - 255 mean) / (255 std) on uint8) against ToTensor + Normalize, and a
    # batch of 5 against batches of 1 (another GEMM blocking); measured, the logits differ by ~1e-5 and p by ~4e-6.
    # A cluster's mean Delta p is a difference of such probabilities that can cancel to near 0 (-0.093 points here),
    # so a tolerance relative to it is meaningless; by the triangle inequality it is off by at most twice the largest
    # per-sample p difference (in points), which is what is allowed (and that difference must itself be float noise).
    p_error = max(abs(r["p_gt"] - probs[r["key"]][r["label"]]) for r in rows)
    assert p_error < 1e-5
    tolerance = 2 * 100 * p_error + 1e-9
    for label in range(4):
        edits = [m for m, _ in scored["samples"]["counterfactual"] if m["label"] == label]
        directions = embed([e["edited_caption"] for e in edits]) - embed([e["caption"] for e in edits])
        km = KMeans(n_clusters=2, random_state=0, n_init=10).fit(directions.astype(np.float32))
        expected = []
        for c in range(2):
            members = [e for e, lab in zip(edits, km.labels_, strict=True) if lab == c]
            dp = [100 * (probs[e["source_key"]][label] - probs[e["key"]][label]) for e in members]
            nearest = members[
                int(
                    np.argmin(
                        [
                            np.linalg.norm(d - km.cluster_centers_[c])
                            for d, lab in zip(directions, km.labels_, strict=True)
                            if lab == c
                        ]
                    )
                )
            ]
            expected.append(
                (np.mean(dp), len(members), f"{nearest['original_span']} → {nearest['edited_span']}", max(dp))
            )
        expected.sort(key=lambda t: -t[0])
        got = summary["by_class"][str(label)]["top_clusters"]
        assert len(got) == 2
        for cluster, (mean, size, name, worst) in zip(got, expected, strict=True):
            assert cluster["delta_p_gt_mean"] == pytest.approx(mean, rel=0, abs=tolerance)
            assert cluster["size"] == size
            assert cluster["name"] == name
            assert cluster["examples"][0]["delta_p_gt"] == pytest.approx(worst, rel=0, abs=tolerance)


@pytest.mark.slow
def test_without_the_insight_model_eval_scores_and_ranks_saying_insights_were_skipped(
    scored, tmp_path, caplog, monkeypatch
):
    """The insights' CLIP model cannot be loaded (offline, not cached): ranking does not need it, so the model is
    scored and ranked, one warning says the insights were skipped and how to get them, and the run is recorded as one
    without insights (a later --no-insights run is the same run, skipped)."""
    from builder.cli import main
    from evaluation.leaderboard import leaderboard_markdown
    from evaluation.results import is_complete

    out = tmp_path / "out"
    common = ["eval", "--release", str(scored["root"]), "--model", "test_vit", "--checkpoint", str(scored["ckpt"])]
    common += ["--output", str(out), "--workers", "0", "--bootstrap", "0", "--no-report"]
    caplog.set_level("INFO")
    assert main([*common, "--clip-model", "no-such-clip-model"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("insights skipped: CLIP model 'no-such-clip-model'")
    assert "scored and ranked without them" in warnings[0] and "--clip-model DIR" in warnings[0]
    results = json.loads((out / REL / scored["slug"] / "results.json").read_text())
    assert results["status"] == "ok" and "insights" not in results and results["options"]["insights"] is False
    assert is_complete(results) and "| 1 |" in leaderboard_markdown([results])  # ranked
    assert results["metrics"]["original"]["acc1"] == pytest.approx(scored["results"]["metrics"]["original"]["acc1"])
    caplog.clear()
    assert main([*common, "--no-insights"]) == 0
    assert "skipping" in caplog.text and "insights skipped" not in caplog.text
    # the default CLIP model, offline and not cached: the model check before the command finds it missing, eval says
    # so in one line and does not try to load it
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    caplog.clear()
    assert main([*(str(tmp_path / "default-clip") if a == str(out) else a for a in common)]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("insights skipped: CLIP model 'ViT-L-14' (openai) is not")
    assert "the Hub is switched off" in warnings[0] and "scored and ranked without them" in warnings[0]
    again = json.loads((tmp_path / "default-clip" / REL / scored["slug"] / "results.json").read_text())
    assert again["options"]["insights"] is False and again["metrics"] == results["metrics"]


@pytest.mark.slow
def test_random_weights_are_seeded_and_a_new_class_map_is_rescored(scored, tmp_path, caplog, cli):
    """--no-pretrained draws its weights from --seed (two runs agree, another seed differs); re-running with another
    --class-map scores again instead of keeping results computed with the old map."""
    import pandas as pd

    common = ["--release", str(scored["root"]), "--model", "test_vit", "--no-pretrained", "--workers", "0"]
    common += ["--bootstrap", "0", "--no-insights", "--no-report"]
    map_a, map_b = tmp_path / "a.txt", tmp_path / "b.txt"
    map_a.write_text("7\n99\n3\n512\n")
    map_b.write_text("8\n99\n3\n512\n")

    def run(out: Path, *extra: str) -> tuple[dict, pd.DataFrame]:
        args = cli.parse(["eval", *common, "--output", str(out), *extra])
        assert args.func(args) == 0
        directory = out / REL / "test_vit__random"
        preds = pd.read_parquet(directory / "predictions.parquet").sort_values(["config", "key"])
        return json.loads((directory / "results.json").read_text()), preds.reset_index(drop=True)

    first, p1 = run(tmp_path / "one", "--class-map", str(map_a))
    second, p2 = run(tmp_path / "two", "--class-map", str(map_a))
    third, p3 = run(tmp_path / "three", "--class-map", str(map_a), "--seed", "1")
    assert first["model"]["weights"]["id"] == second["model"]["weights"]["id"] == "random:seed=0"
    assert p1["p_gt"].tolist() == p2["p_gt"].tolist()
    assert third["model"]["weights"]["id"] == "random:seed=1"
    assert not np.allclose(p1["p_gt"], p3["p_gt"])

    caplog.set_level("INFO")
    remapped, p4 = run(tmp_path / "one", "--class-map", str(map_b))
    assert remapped["model"]["class_map_sha256"] != first["model"]["class_map_sha256"]
    assert not np.allclose(p1["p_gt"], p4["p_gt"])  # label 0 is now scored by output 8, not 7


def test_class_map_with_a_non_integer_entry_names_the_file(scored, tmp_path):
    from evaluation.models import load_class_map

    bad = tmp_path / "map.txt"
    bad.write_text("7\nnine\n3\n5\n")
    with pytest.raises(ValueError, match=r"map\.txt.*entry 1 \('nine'\)"):
        load_class_map(bad, 4)
    bad_json = tmp_path / "map.json"
    bad_json.write_text('{"0": 1, "1": "x"}')
    with pytest.raises(ValueError, match=r"map\.json.*integer"):
        load_class_map(bad_json, 2)


def test_unknown_hub_release_or_revision_is_a_clear_error(hub_env):
    """Against the Hub double over HTTP: a missing dataset or tag is a ValueError naming it, not a traceback."""
    hub = hub_env  # HF_ENDPOINT is read when the release is opened
    with pytest.raises(ValueError, match=r"'lance-org/missing'.*does not exist"):
        open_release("lance-org/missing@v1.0.0")
    hub.create("datasets", "lance-org/present")
    with pytest.raises(ValueError, match=r"'lance-org/present'.*no revision 'v9.9.9'"):
        open_release("lance-org/present@v9.9.9")
