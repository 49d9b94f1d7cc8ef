"""Leaderboard tables and plots, and the per-model HTML report opened in a real headless browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from release_fixture import write_release

from evaluation.leaderboard import TIMM_COLUMNS
from lance_pipeline.tiny.clip_components import create_tiny_open_clip

pytestmark = pytest.mark.e2e  # CLI runs, leaderboards and a headless browser

MODELS = ["test_vit", "test_efficientnet"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, cli):
    base = tmp_path_factory.mktemp("outputs")
    root = write_release(base / "release", originals_per_class=1, edits_per_original=3)
    clip = create_tiny_open_clip(base / "clip")
    out = base / "eval"
    argv = ["eval", "--release", str(root), "--output", str(out), "--no-pretrained", "--workers", "1"]
    argv += ["--bootstrap", "100", "--clip-model", str(clip), "--clusters", "2", "--gallery-size", "4"]
    for model in [*MODELS, "definitely_not_a_model"]:
        argv += ["--model", model]
    args = cli.parse(argv)
    assert args.func(args) == 1  # one model failed; the others were still evaluated
    lb_out = base / "leaderboard"
    args = cli.parse(["leaderboard", str(out), "--output", str(lb_out)])
    assert args.func(args) == 0
    return {"root": root, "out": out / "lance-fixture", "lb": lb_out}  # eval writes under OUTPUT/<release>/


def test_leaderboard_tables_match_results(evaluated):
    results = {
        m: json.loads((evaluated["out"] / f"{m}__random" / "results.json").read_text())
        for m in [*MODELS, "definitely_not_a_model"]
    }
    df = pd.read_csv(evaluated["lb"] / "leaderboard.csv")
    assert list(df.columns[: len(TIMM_COLUMNS)]) == TIMM_COLUMNS
    assert len(df) == 3
    assert df.iloc[-1]["model"] == "definitely_not_a_model" and df.iloc[-1]["status"] == "error"
    assert "Unknown model" in df.iloc[-1]["error"] and pd.isna(df.iloc[-1]["rank"])
    ok = df[df["status"] == "ok"]
    # ranked on the paired Delta (higher = more robust), then counterfactual top-1
    keys = list(zip(ok["paired_top1_diff"], ok["top1"], strict=True))
    assert keys == sorted(keys, key=lambda k: (-k[0], -k[1]))
    assert list(ok["rank"]) == [1, 2]
    for _, row in ok.iterrows():
        r = results[row["model"]]
        cf, orig = r["metrics"]["counterfactual"], r["metrics"]["original"]
        overall = r["sensitivity"]["overall"]
        assert row["top1"] == pytest.approx(cf["acc1"], abs=1e-3)
        assert row["top5_err"] == pytest.approx(100 - cf["acc5"], abs=1e-3)
        assert row["original_top1"] == pytest.approx(orig["acc1"], abs=1e-3)
        assert row["unpaired_top1_diff"] == pytest.approx(cf["acc1"] - orig["acc1"], abs=2e-3)
        assert row["paired_top1_diff"] == pytest.approx(overall["paired_delta_acc1"], abs=1e-6)
        assert row["paired_counterfactual_top1"] - row["paired_original_top1"] == pytest.approx(
            row["paired_top1_diff"], abs=1e-6
        )
        assert row["delta_p_gt_mean"] == pytest.approx(overall["delta_p_gt_mean"], abs=1e-6)
        assert row["img_size"] == r["model"]["data_config"]["input_size"][-1]
        assert row["param_count"] == pytest.approx(r["model"]["param_count"])
        assert row["n_counterfactual"] == cf["n"] == 9
        assert row["complete"]
    # integers stay integers even with a failed row (no 288.0), and no "-0.00" anywhere
    raw = (evaluated["lb"] / "leaderboard.csv").read_text().splitlines()
    img_size_at = raw[0].split(",").index("img_size")
    assert all("." not in line.split(",")[img_size_at] for line in raw[1:])
    parquet = pd.read_parquet(evaluated["lb"] / "leaderboard.parquet")
    assert list(parquet["model"]) == list(df["model"])
    assert str(parquet["img_size"].dtype) == "Int64"
    text = (evaluated["lb"] / "leaderboard.md").read_text()
    assert "-0.00" not in text
    compact, full = text.split("## Full table")
    compact_rows = [ln for ln in compact.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert compact_rows[0].startswith("| rank | model | original acc@1 | counterfactual acc@1 | paired Δ acc@1")
    top = ok.iloc[0]
    assert compact_rows[1].startswith(f"| 1 | {top['model'].replace('_', chr(92) + '_')} (random weights) |")
    full_rows = [ln for ln in full.splitlines() if ln.startswith("| ")]
    assert full_rows[0].startswith("| model | img_size | top1 |") and len(full_rows) == 1 + len(df)
    assert full_rows[1].startswith(f"| {top['model'].replace('_', chr(92) + '_')} | {int(top['img_size'])} |")
    for name in (
        "edit_type_sensitivity",
        "class_delta_acc",
        "acc_original_vs_counterfactual",
        "effective_robustness",
        "shift_correlation",
    ):
        with Image.open(evaluated["lb"] / f"{name}.png") as image:
            assert image.width > 100 and np.asarray(image.convert("L")).std() > 0


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def test_report_renders_its_images_in_a_headless_browser(evaluated, tmp_path):
    report_dir = evaluated["out"] / "test_vit__random"
    page = (report_dir / "report.html").read_text()
    # gallery: the 4 most damaging counterfactuals, spans highlighted, top-5 predictions on both sides
    assert page.count("class='pair'") == 4
    assert len(re.findall(r"<mark>[^<]+</mark>", page)) >= 8
    assert page.count("<ol class='top5'>") == 8
    assert "Class-level insights" in page and "→" in page
    browser = _browser()
    if browser is None:
        if os.environ.get("LANCE_CF_ALLOW_NO_BROWSER") == "1":
            pytest.skip("no Chromium and LANCE_CF_ALLOW_NO_BROWSER=1")
        pytest.fail(
            "Chromium is required for this test: apt-get install -y chromium (or set LANCE_CF_ALLOW_NO_BROWSER=1)"
        )
    # The report itself has no script; a copy beside it (same relative asset paths) reports each image's state.
    probe = report_dir / "_probe.html"
    probe.write_text(
        page.replace(
            "</body>",
            "<script>window.addEventListener('load', () => { const pre = document.createElement('pre');"
            " pre.id = 'probe'; pre.textContent = JSON.stringify(Array.from(document.images).map("
            "i => [i.getAttribute('src'), i.complete, i.naturalWidth])); document.body.appendChild(pre); });"
            "</script></body>",
        )
    )
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chrome-profile'}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        probe.as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    match = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert match, f"browser printed no probe result: {done.stderr[-2000:]}"
    images = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    srcs = [src for src, _, _ in images]
    assert len(images) == 3 + 2 * 4, srcs  # three plots, and original + counterfactual per gallery pair
    broken = [src for src, complete, width in images if not complete or width <= 0]
    assert not broken, f"images that did not render: {broken}"


def test_leaderboard_of_overlapping_directories_lists_each_model_once(evaluated, tmp_path, cli):
    model_dir = evaluated["out"] / f"{MODELS[0]}__random"
    paths = [str(evaluated["out"]), str(model_dir), str(model_dir / "results.json")]
    args = cli.parse(["leaderboard", *paths, "--output", str(tmp_path)])
    assert args.func(args) == 0
    df = pd.read_csv(tmp_path / "leaderboard.csv")
    assert sorted(df["model"]) == sorted([*MODELS, "definitely_not_a_model"])
