"""Evaluation options and failure modes: precision (AMP, model dtype), torch.compile, --limit, the skip key, the batch
size search, several devices, the streaming sha256 check, broken samples, and what results may not contain.

Tolerances (stated, and checked): bf16 autocast and bf16 weights on CPU give p(y_GT) within 0.03 of float32 for every
sample (mean difference under 0.01); torch.compile (aot_eager backend: dynamo + AOTAutograd, no C compiler needed)
within 1e-5.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from release_fixture import write_manifest, write_release

from builder import release_format as rf
from builder.cli import main
from evaluation.harness import EvalOptions, find_batch_size, predict_release
from evaluation.models import ModelSpec, create_eval_model
from evaluation.release_reader import open_release
from evaluation.results import validate_results

NAMES = ["red square", "blue circle", "green square", "yellow circle"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, single_thread_torch):
    import timm
    from safetensors.torch import save_file

    base = tmp_path_factory.mktemp("options")
    root = write_release(
        base / "rel", labels=(0, 1, 2, 3), label_names=NAMES, originals_per_class=2, edits_per_original=2, shard_size=4
    )
    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False, num_classes=4).eval()
    with torch.no_grad():
        model.head.weight.mul_(20.0)  # confident, varied probabilities: a precision change shows in p(y_GT)
    ckpt = base / "vit4.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    return {"root": root, "ckpt": ckpt, "base": base}


REL = "lance-fixture"  # the fixture release's name: eval writes its results under OUTPUT/<release>/


def eval_args(setup, out: Path, *extra: str) -> list[str]:
    return [
        "eval", "--release", str(setup["root"]), "--model", "test_vit", "--checkpoint", str(setup["ckpt"]),
        "--output", str(out), "--workers", "0", "--bootstrap", "0", "--no-insights", "--no-report", *extra,
    ]  # fmt: skip


def run(setup, out: Path, *extra: str) -> tuple[dict, pd.DataFrame]:
    assert main(eval_args(setup, out, *extra)) == 0
    slug = ModelSpec("test_vit", checkpoint=setup["ckpt"]).slug
    results = json.loads((out / REL / slug / "results.json").read_text())
    preds = pd.read_parquet(out / REL / slug / "predictions.parquet").sort_values("key").reset_index(drop=True)
    return results, preds


@pytest.fixture(scope="module")
def fp32(setup):
    return run(setup, setup["base"] / "fp32")


@pytest.mark.slow
def test_amp_and_model_dtype_within_tolerance_of_float32(setup, fp32):
    base_results, base = fp32
    for extra, recorded in (
        (["--amp", "--amp-dtype", "bfloat16"], {"amp": True, "amp_dtype": "bfloat16", "model_dtype": "float32"}),
        (["--model-dtype", "bfloat16"], {"amp": False, "amp_dtype": None, "model_dtype": "bfloat16"}),
    ):
        results, preds = run(setup, setup["base"] / "-".join(extra).strip("-"), *extra)
        assert {k: results["options"][k] for k in recorded} == recorded
        assert list(preds["key"]) == list(base["key"])
        diff = np.abs(preds["p_gt"].to_numpy() - base["p_gt"].to_numpy())
        assert diff.max() <= 0.03 and diff.mean() <= 0.01, (extra, diff.max(), diff.mean())
        assert diff.max() > 0, "a lower precision that changes nothing was not applied"
        validate_results(results)
    assert base_results["options"]["amp"] is False and base_results["options"]["model_dtype"] == "float32"


@pytest.mark.slow
def test_torchcompile_matches_eager(setup, fp32):
    _, base = fp32
    results, preds = run(setup, setup["base"] / "compiled", "--torchcompile", "aot_eager")
    assert results["options"]["torchcompile"] == "aot_eager"
    np.testing.assert_allclose(preds["p_gt"].to_numpy(), base["p_gt"].to_numpy(), atol=1e-5)


def test_limit_scores_the_first_samples_of_each_config_and_is_never_complete(setup, fp32):
    from evaluation.leaderboard import build_leaderboard

    results, preds = run(setup, setup["base"] / "limited", "--limit", "3")
    assert results["limit"] == 3 and results["options"]["limit"] == 3
    assert {c: results["metrics"][c]["n"] for c in results["metrics"]} == dict.fromkeys(rf.CONFIG_NAMES, 3)
    # the first 3 samples of each config in shard order, scored as in the full run
    full = fp32[1].set_index("key")
    release = open_release(setup["root"])
    for config in rf.CONFIG_NAMES:
        first = []
        for shard in release.shards[config]:
            with tarfile.open(shard) as tar:
                first += list(dict.fromkeys(m.name.split(".")[0] for m in tar.getmembers()))
        assert sorted(preds[preds["config"] == config]["key"]) == sorted(first[:3])
    for _, row in preds.iterrows():
        assert row["p_gt"] == pytest.approx(full.loc[row["key"], "p_gt"], abs=1e-6)
    df = build_leaderboard([fp32[0], results | {"model": dict(results["model"], name="other")}])
    assert list(df["complete"]) == [True, False] and df["rank"].isna().iloc[1]


@pytest.mark.slow
def test_skip_key_includes_every_result_option(setup, caplog):
    out = setup["base"] / "skip"
    slug = ModelSpec("test_vit", checkpoint=setup["ckpt"]).slug
    run(setup, out)
    path = out / REL / slug / "results.json"
    for extra in ([], ["--workers", "1", "--batch-size", "5"]):  # the same options: skipped
        before = path.stat().st_mtime_ns
        run(setup, out, *extra)
        assert path.stat().st_mtime_ns == before, extra
    for extra in (["--bootstrap", "10"], ["--seed", "3"], ["--limit", "2"], ["--no-channels-last"], ["--amp"]):
        before = path.stat().st_mtime_ns
        results, _ = run(setup, out, *extra)
        assert path.stat().st_mtime_ns != before, f"{extra} did not re-run"
    key = results["run"]["key"]
    # insights options are in the key too (checked on the key itself: no CLIP model is loaded here)
    import dataclasses

    from evaluation.harness import run_key

    release = open_release(setup["root"])
    spec = ModelSpec("test_vit", checkpoint=setup["ckpt"])
    options = EvalOptions(insights=True, clip_model="A", insight_k=5)
    keys = {
        run_key(release, spec, o)
        for o in (options, dataclasses.replace(options, clip_model="B"), dataclasses.replace(options, insight_k=6))
    }
    assert len(keys) == 3 and key not in keys
    # and the model itself: two architectures with the same (random) weights id never share a key
    random_a, random_b = ModelSpec("test_vit", pretrained=False), ModelSpec("test_resnet", pretrained=False)
    assert run_key(release, random_a, options) != run_key(release, random_b, options)


def test_results_carry_no_machine_paths(setup, fp32, tmp_path):
    results, _ = fp32
    text = json.dumps(results)
    for private in (str(setup["root"]), str(setup["ckpt"]), str(setup["base"])):
        assert private not in text
    assert results["release"]["source"] == setup["root"].name
    assert results["model"]["weights"]["checkpoint"] == setup["ckpt"].name
    assert results["tool"]["name"] == "lance-counterfactuals" and results["tool"]["version"]
    class_map = tmp_path / "map.txt"
    class_map.write_text("0\n1\n2\n3\n")
    with_map, _ = run(setup, tmp_path / "mapped", "--class-map", str(class_map))
    assert with_map["model"]["class_map"] == "map.txt" and str(tmp_path) not in json.dumps(with_map)


def test_auto_batch_size_grows_until_out_of_memory_and_catches_nothing_else():
    calls = []

    def forward(batch):
        calls.append(batch.shape[0])
        if batch.shape[0] > 24:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return batch

    def make(n):
        return torch.zeros(n, 1)

    assert find_batch_size(forward, make, 4, 1024) == 16 and calls == [4, 8, 16, 32]
    calls.clear()
    assert find_batch_size(forward, make, 64, 1024) == 16 and calls == [64, 32, 16]
    assert find_batch_size(forward, make, 2, 8) == 8

    def broken(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        find_batch_size(broken, make, 4, 64)


def test_auto_batch_size_in_a_run(setup, fp32):
    model = create_eval_model(ModelSpec("test_vit", checkpoint=setup["ckpt"]))

    class Limited(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            if x.shape[0] > 6:
                raise torch.OutOfMemoryError("CUDA out of memory.")
            return self.inner(x)

    from timm.data import resolve_data_config

    release = open_release(setup["root"])
    options = EvalOptions(workers=0, batch_size=2, auto_batch_size=True, max_batch_size=64)
    rows, timing = predict_release(Limited().eval(), release, resolve_data_config({}, model=model), options)
    assert timing["batch_size"] == 4 and timing["oom_retries"] == 0
    base = fp32[1].set_index("key")
    for row in rows:
        assert row["p_gt"] == pytest.approx(base.loc[row["key"], "p_gt"], abs=1e-6)


@pytest.mark.e2e  # starts DataLoader worker processes
def test_two_cpu_workers_give_the_same_results_as_one(setup, tmp_path):
    """--devices cpu,cpu evaluates two models in parallel worker processes; every number equals a one-device run."""
    common = ["--release", str(setup["root"]), "--no-pretrained", "--workers", "0", "--bootstrap", "20"]
    common += ["--no-insights", "--no-report", "--model", "test_vit", "--model", "test_efficientnet"]
    common += ["--class-map", str(tmp_path / "map.txt")]
    (tmp_path / "map.txt").write_text("5\n50\n500\n999\n")
    assert main(["eval", *common, "--output", str(tmp_path / "one")]) == 0
    assert main(["eval", *common, "--output", str(tmp_path / "two"), "--devices", "cpu,cpu"]) == 0
    for slug in ("test_vit__random", "test_efficientnet__random"):
        one = json.loads((tmp_path / "one" / REL / slug / "results.json").read_text())
        two = json.loads((tmp_path / "two" / REL / slug / "results.json").read_text())
        for key in ("metrics", "sensitivity", "sensitivity_by_config", "options", "model", "release", "limit"):
            assert one[key] == two[key], (slug, key)
        assert one["run"]["key"] == two["run"]["key"]
        p1 = pd.read_parquet(tmp_path / "one" / REL / slug / "predictions.parquet")
        p2 = pd.read_parquet(tmp_path / "two" / REL / slug / "predictions.parquet")
        assert p1.sort_values("key").reset_index(drop=True).equals(p2.sort_values("key").reset_index(drop=True))


def _rewrite_shard(root: Path, rel: str, change) -> None:
    """Rewrite one shard with ``change(members)`` applied and reseal the manifest (as a build would have written it)."""
    path = root / rel
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    members = change(members)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    manifest = json.loads((root / rf.MANIFEST_NAME).read_text())
    data = path.read_bytes()
    for entry in manifest["shards"]:
        if entry["path"] == rel:
            entry["sha256"], entry["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    del manifest["manifest_sha256"]
    write_manifest(root, manifest)


def test_modified_shard_is_refused_with_one_line_and_no_output(setup, tmp_path, capsys):
    root = write_release(tmp_path / "rel", labels=(0, 1, 2, 3), label_names=NAMES, originals_per_class=1,
                         edits_per_original=1, shard_size=4)  # fmt: skip
    rel = rf.load_manifest(root).shards_of("original")[0].path
    data = bytearray((root / rel).read_bytes())
    data[1000] ^= 0xFF  # same length, other bytes: edited after the build
    (root / rel).write_bytes(bytes(data))
    out = tmp_path / "out"
    argv = ["eval", "--release", str(root), "--model", "test_vit", "--checkpoint", str(setup["ckpt"])]
    argv += ["--output", str(out), "--workers", "1", "--bootstrap", "0", "--no-insights", "--no-report"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and rel in err[0] and "--no-verify" in err[0] and "modified" in err[0], err
    assert not list(out.rglob("results.json"))
    assert main([*argv, "--no-verify"]) == 0
    results = json.loads(next(out.rglob("results.json")).read_text())
    assert results["options"]["verify"] is False and results["status"] == "ok"


def test_corrupt_image_fails_that_sample_not_the_model(setup, tmp_path):
    root = write_release(tmp_path / "rel", labels=(0, 1, 2, 3), label_names=NAMES, originals_per_class=2,
                         edits_per_original=1, shard_size=4)  # fmt: skip
    rel = rf.load_manifest(root).shards_of("counterfactual")[0].path
    broken = {}

    def corrupt(members):
        name, _ = next(m for m in members if m[0].endswith(".png"))
        broken["key"] = name.split(".")[0]
        return [(n, b"\x89PNG\r\n\x1a\n broken" if n == name else d) for n, d in members]

    _rewrite_shard(root, rel, corrupt)
    results, preds = run(setup | {"root": root}, tmp_path / "out")
    assert results["status"] == "ok"
    assert len(results["failures"]) == 1
    failure = results["failures"][0]
    assert failure["key"] == broken["key"] and failure["shard"] == rel and failure["config"] == "counterfactual"
    assert rel in failure["reason"] and broken["key"] in failure["reason"]
    assert (
        broken["key"] not in set(preds["key"])
        and len(preds)
        == sum(json.loads((root / "manifest.json").read_text())["counts"][c]["total"] for c in rf.CONFIG_NAMES) - 1
    )
    from evaluation.results import is_complete

    assert not is_complete(results)


def test_truncated_shard_names_shard_and_key_and_fails_those_samples(setup, tmp_path):
    root = write_release(tmp_path / "rel", labels=(0, 1, 2, 3), label_names=NAMES, originals_per_class=2,
                         edits_per_original=1, shard_size=4)  # fmt: skip
    rel = rf.load_manifest(root).shards_of("original")[1].path
    data = (root / rel).read_bytes()
    (root / rel).write_bytes(data[: len(data) // 2])
    results, preds = run(setup | {"root": root}, tmp_path / "out", "--no-verify", "--workers", "1")
    assert results["status"] == "ok" and results["failures"]
    assert all(f["shard"] == rel for f in results["failures"])
    assert "truncated" in results["failures"][0]["reason"] and results["failures"][0]["key"].startswith("src-")
    manifest = json.loads((root / rf.MANIFEST_NAME).read_text())
    in_shard = next(e["samples"] for e in manifest["shards"] if e["path"] == rel)
    scored = int((preds["config"] == "original").sum())
    # every sample of the shard is either scored or accounted for in the failure (no silent loss)
    lost = (
        int(results["failures"][0]["reason"].split("the ")[-1].split(" sample")[0])
        if "after this" in (results["failures"][0]["reason"])
        else 0
    )
    assert scored + len(results["failures"]) + lost == manifest["counts"]["original"]["total"]
    assert in_shard == 4
    assert results["metrics"]["counterfactual"]["n"] == 8  # the other configs are whole


def test_hostile_class_names_in_plots_and_report(tmp_path):
    from evaluation.plots import plot_class_delta_acc
    from evaluation.report import asset_name

    long_name = "x" * 245
    results = {
        "status": "ok",
        "model": {"name": "m$\\frac{1}$", "weights": {"id": "pretrained"}},
        "metrics": {},
        "sensitivity": {"by_class": {"0": {"label_name": "$\\frac{1}$", "paired_delta_acc1": 0.0},
                                     "1": {"label_name": long_name, "paired_delta_acc1": 0.0}}},
    }  # fmt: skip
    path = plot_class_delta_acc([results], tmp_path / "p.png")  # mathtext would raise on $\frac{1}$
    from PIL import Image

    with Image.open(path) as image:  # every Delta is 0: the plot still shows markers, not a blank axis
        assert np.asarray(image.convert("L")).std() > 0
    name = asset_name("counterfactual", f"{long_name}-src-cf00", "png")
    assert len(name.encode()) <= 120 and name.endswith(".png")
    assert asset_name("counterfactual", f"{long_name}-src-cf01", "png") != name
    (tmp_path / name).write_bytes(b"ok")  # a legal file name
    assert ModelSpec("resnet50.a1_in1k").slug == "resnet50.a1_in1k"  # result folders named as the model
    assert ModelSpec("hf-hub:timm/resnet18.a1_in1k").slug == "hf-hub--timm--resnet18.a1_in1k"
    assert ModelSpec("a b").slug != ModelSpec("a_b").slug and ModelSpec("..").slug not in (".", "..")
    spec = ModelSpec("a" * 300, pretrained=False)
    assert len(spec.slug) <= 150 and spec.slug != ModelSpec("a" * 301, pretrained=False).slug


def test_offline_release_and_missing_device_are_one_line_errors_with_nothing_written(setup, tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        (["--release", "lance-org/not-cached@v1.0.0"], ["not in the local cache", "HF_HUB_OFFLINE", "local release"]),
        (["--release", str(setup["root"]), "--device", "cuda:7"], ["cuda:7"]),
    ]
    if torch.cuda.is_available():
        cases.pop()
    for release_args, expected in cases:
        capsys.readouterr()
        argv = ["eval", *release_args, "--model", "test_vit", "--no-pretrained", "--output", str(out), "--no-insights"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(word in err[0] for word in expected), err
        assert not out.exists()


def test_a_local_directory_model_is_named_by_its_folder_and_digest_never_its_path(setup, fp32, tmp_path):
    """``--model local-dir:DIR`` (timm's schema; what works without the Hub): the results, their folder and the report
    name the folder and the digest of its files, not where it lies; the same weights score as the checkpoint does."""
    import timm
    from safetensors.torch import load_file

    folder = tmp_path / "private" / "machine" / "path" / "my-vit"
    model = timm.create_model("test_vit", pretrained=False, num_classes=4)
    model.load_state_dict(load_file(str(setup["ckpt"])))
    timm.models.save_for_hf(model, str(folder), safe_serialization=True)
    out = tmp_path / "out"
    argv = eval_args(setup, out)
    argv[argv.index("--model") + 1 : argv.index("--checkpoint") + 2] = ["local-dir:" + str(folder)]
    assert main(argv) == 0
    (written,) = (out / REL).glob("*/results.json")
    results = json.loads(written.read_text())
    digest = results["model"]["weights"]["local_dir_sha256"]
    assert written.parent.name == f"local-dir--my-vit__sha-{digest[:12]}"
    assert results["model"]["name"] == "local-dir:my-vit" and results["model"]["weights"]["local_dir"] == "my-vit"
    assert results["model"]["weights"]["id"] == f"local-dir:sha256:{digest}"
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".html", ".md", ".csv"):
            assert str(tmp_path / "private") not in path.read_text(errors="replace"), path
    local = pd.read_parquet(written.parent / "predictions.parquet").sort_values("key").reset_index(drop=True)
    assert np.array_equal(local["p_gt"].to_numpy(), fp32[1]["p_gt"].to_numpy())  # the checkpoint's weights, as said

    pickled = tmp_path / "pickled"  # timm's default save: pytorch_model.bin, a pickle, is never loaded
    timm.models.save_for_hf(model, str(pickled))
    argv[argv.index("--model") + 1] = "local-dir:" + str(pickled)
    with pytest.raises(
        ValueError, match=r"has no model.safetensors \(its weights are pickle files.*safe_serialization"
    ):
        ModelSpec(name="local-dir:" + str(pickled))
    assert main(argv) == 2


def test_offline_eval_names_what_works_without_the_hub_and_a_choose_line_comes_first(setup, tmp_path, capsys):
    """Offline, a Hub model's failure names local-dir:DIR, --checkpoint and --no-pretrained (each works here); an
    unfinished class map is said before any model is looked up."""
    argv = ["eval", "--release", str(setup["root"]), "--model", "resnet50.a1_in1k", "--output", str(tmp_path / "o"),
            "--no-insights"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "neither cached nor reachable" in err and "each key also takes" not in err
    for way in ("--model local-dir:DIR", "--checkpoint FILE.safetensors", "--no-pretrained"):
        assert way in err, err
    class_map = tmp_path / "map.txt"
    class_map.write_text("# cat\nCHOOSE\n1\n2\n3\n")
    assert main([*argv, "--class-map", str(class_map)]) == 2
    err = capsys.readouterr().err.strip()
    assert "entry 0 ('CHOOSE') is not a model output index" in err and "neither cached" not in err
    assert not (tmp_path / "o").exists()
