"""Results as timm's ``results-*.csv`` tables: one CSV per release config, readable by timm's own tooling.

timm (huggingface/pytorch-image-models, ``results/``) publishes one CSV per evaluation set whose first columns are
``model,img_size,top1,top1_err,top5,top5_err,param_count,crop_pct,interpolation`` (accuracies in percent with three
decimals, parameters in millions, rows by descending top-1); the ``timm/leaderboard`` Space reads them with
``pandas.read_csv``. ``lance-cf eval`` and ``lance-cf leaderboard`` write ``results-<release>-<config>.csv`` the same
way, with this project's columns after timm's: the paired Δ acc@1 of the config against its originals, the prompt
template set of a zero-shot model, the weights, the sample count, whether the run was complete, and the release.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from builder.release_format.text_out import write_csv_rows
from evaluation.results import model_label, template_set

TEXT_COLUMNS = ("model", "interpolation", "templates", "weights", "release", "release_version")  # through csv_cell
TIMM_COLUMNS = ["model", "img_size", "top1", "top1_err", "top5", "top5_err", "param_count", "crop_pct", "interpolation"]
OWN_COLUMNS = ["paired_top1_diff", "n", "templates", "templates_digest", "weights", "complete", "release",
               "release_version", "manifest_sha256"]  # fmt: skip
MIN_CLASSES_FOR_TOP5 = 6  # as the leaderboard: with five classes or fewer every label is in the top 5


def _fixed(value: Any, digits: int) -> str:
    return "" if value is None else f"{float(value):.{digits}f}"


def config_rows(results: list[dict[str, Any]], config: str) -> list[dict[str, str]]:
    """The rows of one config, by descending top-1 (as timm's tables), from successful results."""
    from evaluation.results import is_complete

    rows = []
    for r in results:
        entry = (r.get("metrics") or {}).get(config)
        if r.get("status") != "ok" or not entry or entry.get("acc1") is None:
            continue
        model = r.get("model") or {}
        data = model.get("data_config") or {}
        release = r.get("release") or {}
        classes = ((release.get("label_space") or {}).get("num_classes")) or model.get("num_classes")
        top5 = entry.get("acc5") if classes is None or classes >= MIN_CLASSES_FOR_TOP5 else None
        templates = template_set(r)
        rows.append(
            {
                "model": model_label(r)
                if templates or str((model.get("weights") or {}).get("id")) != "pretrained"
                else str(model.get("name")),
                "img_size": str((data.get("input_size") or [None])[-1] or ""),
                "top1": _fixed(entry["acc1"], 3),
                "top1_err": _fixed(100.0 - entry["acc1"], 3),
                "top5": _fixed(top5, 3),
                "top5_err": _fixed(None if top5 is None else 100.0 - top5, 3),
                "param_count": _fixed(model.get("param_count"), 2),
                "crop_pct": _fixed(data.get("crop_pct"), 3),
                "interpolation": str(data.get("interpolation") or ""),
                "paired_top1_diff": _fixed(entry.get("paired_delta_acc1"), 3),
                "n": str(entry.get("n", "")),
                "templates": templates[0] if templates else "",
                "templates_digest": templates[1] if templates else "",
                "weights": str((model.get("weights") or {}).get("id") or ""),
                "complete": str(bool(is_complete(r))),
                "release": str(release.get("name") or ""),
                "release_version": str(release.get("version") or ""),
                "manifest_sha256": str(release.get("manifest_sha256") or ""),
            }
        )
    rows.sort(key=lambda row: (-float(row["top1"]), row["model"]))
    return rows


def write_timm_csvs(results: list[dict[str, Any]], output_dir: Path) -> list[Path]:
    """``results-<release>-<config>.csv`` for every config any successful result scored; returns the paths."""
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return []
    release = re.sub(r"[^A-Za-z0-9_.-]", "_", str((ok[0].get("release") or {}).get("name") or "release"))
    configs = list(dict.fromkeys(c for r in ok for c in (r.get("metrics") or {})))
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for config in configs:
        path = output_dir / f"results-{release}-{re.sub(r'[^A-Za-z0-9_.-]', '_', config)}.csv"
        # numbers as timm writes them; text as no spreadsheet evaluates
        write_csv_rows(path, [*TIMM_COLUMNS, *OWN_COLUMNS], config_rows(ok, config), set(TEXT_COLUMNS))
        written.append(path)
    return written
