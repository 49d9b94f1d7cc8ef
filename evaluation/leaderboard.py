"""One table over models from their results JSONs: CSV, Parquet and Markdown, plus comparison plots.

Columns start with timm's ``results-*.csv`` columns (``model, img_size, top1, top1_err, top5, top5_err, param_count,
crop_pct, interpolation``, and ``top1_diff, top5_diff, rank_diff`` as timm's generate_csv_results adds for shifted
sets), computed on the ``counterfactual`` config against ``original``; then LANCE columns. Rows are sorted by
counterfactual top-1 (descending, as timm sorts), models that failed last.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from . import RESULTS_SCHEMA

logger = logging.getLogger(__name__)

TIMM_COLUMNS = ["model", "img_size", "top1", "top1_err", "top5", "top5_err", "param_count", "crop_pct", "interpolation"]
COLUMNS = [
    *TIMM_COLUMNS,
    "top1_diff",
    "top5_diff",
    "rank_diff",
    "original_top1",
    "original_top5",
    "paired_top1_diff",
    "delta_p_gt_mean",
    "delta_p_gt_abs_mean",
    "flip_rate",
    "n_counterfactual",
    "n_original",
    "reconstructed_top1",
    "reconstructed_top1_diff",
    "lance_r_top1",
    "lance_r_top1_diff",
    "lance_r_delta_p_gt_mean",
    "weights",
    "release",
    "release_version",
    "manifest_sha256",
    "status",
    "error",
]


def find_results(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Every results JSON (``schema == lance-cf/eval-results``) in the given files or directories (recursively)."""
    found = []
    seen: set[Path] = set()  # overlapping arguments (OUT and OUT/<model>) must not list a model twice
    for path in paths:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"results path {str(path)!r} does not exist")
        files = [path] if path.is_file() else sorted(path.rglob("*.json"))
        for file in files:
            if file.resolve() in seen:
                continue
            seen.add(file.resolve())
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(data, dict) and data.get("schema") == RESULTS_SCHEMA:
                data["_path"] = str(file)
                found.append(data)
    if not found:
        raise ValueError(f"no lance-cf results JSON found under {', '.join(map(str, paths))}")
    return found


def _round(value: Any, digits: int = 3) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def leaderboard_row(results: dict[str, Any]) -> dict[str, Any]:
    """One leaderboard row from one results JSON (error rows keep the model, release and error)."""
    model = results.get("model", {})
    release = results.get("release", {})
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(
        model=model.get("name"),
        weights=(model.get("weights") or {}).get("id"),
        release=release.get("name"),
        release_version=release.get("version"),
        manifest_sha256=release.get("manifest_sha256"),
        status=results.get("status"),
        error=results.get("error"),
    )
    if results.get("status") != "ok":
        return row
    data_config = model.get("data_config") or {}
    metrics = results["metrics"]
    cf = metrics.get("counterfactual") or {}
    orig = metrics.get("original") or {}
    overall = (results.get("sensitivity") or {}).get("overall") or {}
    lance_r = ((results.get("sensitivity_by_config") or {}).get("lance_r") or {}).get("overall") or {}
    input_size = data_config.get("input_size") or [None, None]
    row.update(
        img_size=input_size[-1],
        top1=cf.get("acc1"),
        top1_err=100.0 - cf["acc1"] if cf.get("acc1") is not None else None,
        top5=cf.get("acc5"),
        top5_err=100.0 - cf["acc5"] if cf.get("acc5") is not None else None,
        param_count=model.get("param_count"),
        crop_pct=data_config.get("crop_pct"),
        interpolation=data_config.get("interpolation"),
        top1_diff=cf.get("delta_acc1"),
        top5_diff=cf.get("delta_acc5"),
        original_top1=orig.get("acc1"),
        original_top5=orig.get("acc5"),
        paired_top1_diff=cf.get("paired_delta_acc1"),
        delta_p_gt_mean=overall.get("delta_p_gt_mean"),
        delta_p_gt_abs_mean=overall.get("delta_p_gt_abs_mean"),
        flip_rate=overall.get("flip_rate"),
        n_counterfactual=cf.get("n"),
        n_original=orig.get("n"),
        reconstructed_top1=(metrics.get("reconstructed") or {}).get("acc1"),
        reconstructed_top1_diff=(metrics.get("reconstructed") or {}).get("delta_acc1"),
        lance_r_top1=(metrics.get("lance_r") or {}).get("acc1"),
        lance_r_top1_diff=(metrics.get("lance_r") or {}).get("delta_acc1"),
        lance_r_delta_p_gt_mean=lance_r.get("delta_p_gt_mean"),
    )
    return {k: _round(v) for k, v in row.items()}


def build_leaderboard(results: list[dict[str, Any]]) -> Any:
    """The leaderboard DataFrame: one row per (model, weights, release), sorted by counterfactual top-1."""
    import pandas as pd

    rows = [leaderboard_row(r) for r in results]
    df = pd.DataFrame(rows, columns=COLUMNS)
    ok = df["status"] == "ok"
    if ok.any():
        # rank_diff as in timm: rank on the original set minus rank on the counterfactual set (positive = moved up)
        rank_cf = df.loc[ok, "top1"].rank(ascending=False, method="min")
        rank_orig = df.loc[ok, "original_top1"].rank(ascending=False, method="min")
        df.loc[ok, "rank_diff"] = (rank_orig - rank_cf).astype("Int64")
    df["_failed"] = ~ok
    df = df.sort_values(["_failed", "top1", "model"], ascending=[True, False, True], na_position="last")
    return df.drop(columns="_failed").reset_index(drop=True)


INTEGER_COLUMNS = {"img_size", "rank_diff", "n_counterfactual", "n_original"}


def to_markdown(df: Any) -> str:
    """A GitHub-flavoured Markdown table (no extra dependency)."""
    import pandas as pd

    def cell(column: str, value: Any) -> str:
        if value is None or (not isinstance(value, (list, tuple)) and pd.isna(value)):
            return ""
        if column in INTEGER_COLUMNS:
            return str(int(value))
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(df.columns) + " |", "|" + "|".join("---" for _ in df.columns) + "|"]
    for record in df.astype(object).itertuples(index=False):
        lines.append("| " + " | ".join(cell(c, v) for c, v in zip(df.columns, record, strict=True)) + " |")
    return "\n".join(lines) + "\n"


def write_leaderboard(paths: list[str | Path], output_dir: Path) -> dict[str, Path]:
    """Write ``leaderboard.csv``, ``leaderboard.parquet``, ``leaderboard.md`` and the comparison plots."""
    from .plots import plot_acc_scatter, plot_class_delta_acc, plot_edit_type_sensitivity

    results = find_results(paths)
    df = build_leaderboard(results)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {
        "csv": output_dir / "leaderboard.csv",
        "parquet": output_dir / "leaderboard.parquet",
        "markdown": output_dir / "leaderboard.md",
    }
    df.to_csv(written["csv"], index=False)
    df.to_parquet(written["parquet"], index=False)
    written["markdown"].write_text(to_markdown(df), encoding="utf-8")
    written["edit_type_sensitivity"] = plot_edit_type_sensitivity(results, output_dir / "edit_type_sensitivity.png")
    written["class_delta_acc"] = plot_class_delta_acc(results, output_dir / "class_delta_acc.png")
    written["acc_scatter"] = plot_acc_scatter(results, output_dir / "acc_original_vs_counterfactual.png")
    releases = {(r.get("release") or {}).get("manifest_sha256") for r in results}
    if len(releases) > 1:
        logger.warning("the leaderboard mixes %d releases; compare rows of the same release only", len(releases))
    logger.info("leaderboard of %d rows written to %s", len(df), output_dir)
    return written
