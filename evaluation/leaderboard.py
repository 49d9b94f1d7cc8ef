"""The one leaderboard over models, from their results JSONs: tables (CSV, Parquet, Markdown), plots, HTML.

Ranking leads with paired metrics (each counterfactual against its own original, LANCE eq. 3 restricted to pairs):
rows are sorted by paired Delta acc@1 (higher = more robust), then counterfactual top-1. The unpaired difference of
the two sets is kept, labelled ``unpaired_*``: it is confounded by how many edits each class kept.

The full table's first columns are timm's ``results-*.csv`` columns (``model, img_size, top1, top1_err, top5,
top5_err, param_count, crop_pct, interpolation``, top-k on the ``counterfactual`` config), then LANCE columns.
Only complete runs (no ``--limit``, no failed sample) are ranked; others are listed unranked. A leaderboard never mixes
releases: results of different releases (manifest hashes) are refused.

This module owns the Markdown the dataset card embeds (:func:`leaderboard_markdown`) and the rows published to the
Hub (:func:`build_leaderboard_by_config`).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from pathlib import Path
from typing import Any

from builder.release_format.text_out import md_escape, write_csv
from evaluation.metric_registry import MetricContractError, metric_columns
from evaluation.pages import render_page
from evaluation.plots import (
    plot_acc_scatter,
    plot_class_delta_acc,
    plot_edit_type_sensitivity,
    plot_effective_robustness,
    plot_shift_correlation,
    plot_strength_models,
)
from evaluation.results import (
    check_one_release,
    display_name,
    is_complete,
    is_results,
    missing_default_metrics,
    model_label,
    template_set,
    validate_results,
)
from evaluation.robustness import effective_robustness, shift_correlations, timm_model_name
from evaluation.strength import rank_stability
from evaluation.timm_format import write_timm_csvs
from evaluation.timm_results import SHIFTS, load_shift_table
from evaluation.zero_shot import (
    plot_template_sensitivity,
    template_note,
    template_sensitivity,
    template_sensitivity_markdown,
    template_sensitivity_section,
    template_sensitivity_table,
)
from lance_pipeline.readers import read_json
from lance_pipeline.release_kinds import kind_of_results, resolve_target

logger = logging.getLogger(__name__)

TIMM_COLUMNS = ["model", "img_size", "top1", "top1_err", "top5", "top5_err", "param_count", "crop_pct", "interpolation"]
COLUMNS = [
    *TIMM_COLUMNS,
    "rank",
    "paired_top1_diff",
    "paired_top1_diff_ci_low",
    "paired_top1_diff_ci_high",
    "delta_p_gt_mean",
    "delta_p_gt_mean_ci_low",
    "delta_p_gt_mean_ci_high",
    "delta_p_gt_abs_mean",
    "flip_rate",
    "flip_rate_ci_low",
    "flip_rate_ci_high",
    "paired_original_top1",
    "paired_counterfactual_top1",
    "n_pairs",
    "effective_robustness",
    "effective_robustness_probit",
    "original_top1",
    "original_top5",
    "unpaired_top1_diff",
    "unpaired_top5_diff",
    "rank_diff",
    "n_counterfactual",
    "n_original",
    "reconstructed_top1",
    "reconstructed_paired_top1_diff",
    "lance_r_top1",
    "lance_r_paired_top1_diff",
    "lance_r_delta_p_gt_mean",
    "strength_auc",
    "strength_auc_ci_low",
    "strength_auc_ci_high",
    "strength_never_fail_share",
    "num_classes",
    "complete",
    "limit",
    "failed_samples",
    "weights",
    "templates",
    "templates_digest",
    "release",
    "release_version",
    "manifest_sha256",
    "status",
    "error",
    "run_key",
]
INTEGER_COLUMNS = [
    "img_size",
    "rank",
    "n_pairs",
    "rank_diff",
    "n_counterfactual",
    "n_original",
    "num_classes",
    "limit",
    "failed_samples",
]
TOP5_COLUMNS = ["top5", "top5_err", "original_top5", "unpaired_top5_diff"]
# acc@5 says nothing when the label space has five classes or fewer: every label is in the top 5
MIN_CLASSES_FOR_TOP5 = 6


def find_results(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Every results JSON in the given files or directories (recursively), each checked by
    :func:`evaluation.results.validate_results`; other JSON files are skipped, a malformed results file is an error."""
    found = []
    seen: set[Path] = set()  # overlapping arguments (OUT and OUT/<release>/<model>) must not list a model twice
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
                data = read_json(file)
            except ValueError as error:
                if file.name == "results.json" or path.is_file():  # results the reader refused: named, not skipped
                    raise ValueError(str(error)) from None
                continue
            if not is_results(data):
                continue
            try:
                validate_results(data)
            except ValueError as error:
                raise ValueError(f"{file}: {error}") from None
            data["_path"] = str(file)
            found.append(data)
    if not found:
        raise ValueError(f"no lance-cf results JSON found under {', '.join(map(str, paths))}")
    return found


def _ci(entry: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    ci = entry.get(f"{name}_ci")
    return (ci[0], ci[1]) if isinstance(ci, list) and len(ci) == 2 else (None, None)


def _num_classes(results: dict[str, Any]) -> int | None:
    value = ((results.get("release") or {}).get("label_space") or {}).get("num_classes")
    return int(value) if isinstance(value, int) else None


def _row_label(row: dict[str, Any]) -> str:
    """A row's model as tables name it (:func:`evaluation.results.model_label`): a zero-shot model with its templates."""
    label = display_name(row["model"], row["weights"])
    return label if _missing(row.get("templates")) else f"{label} [{row['templates']} templates]"


def leaderboard_row(results: dict[str, Any]) -> dict[str, Any]:
    """One leaderboard row from one results JSON (error rows keep the model, release and error)."""
    model = results.get("model") or {}
    release = results.get("release") or {}
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row.update(
        model=model.get("name"),
        weights=(model.get("weights") or {}).get("id"),
        templates=(template_set(results) or (None, None))[0],
        templates_digest=(template_set(results) or (None, None))[1],
        release=release.get("name"),
        release_version=release.get("version"),
        manifest_sha256=release.get("manifest_sha256"),
        num_classes=_num_classes(results),
        complete=is_complete(results),
        limit=results.get("limit"),
        status=results.get("status"),
        error=results.get("error"),
        run_key=(results.get("run") or {}).get("key"),
    )
    if results.get("status") != "ok":
        return row
    data_config = model.get("data_config") or {}
    metrics = results["metrics"]
    cf = metrics.get("counterfactual") or {}
    orig = metrics.get("original") or {}
    overall = (results.get("sensitivity") or {}).get("overall") or {}
    by_config = results.get("sensitivity_by_config") or {}
    lance_r = (by_config.get("lance_r") or {}).get("overall") or {}
    input_size = data_config.get("input_size") or [None, None]
    dp_lo, dp_hi = _ci(overall, "delta_p_gt_mean")
    fl_lo, fl_hi = _ci(overall, "flip_rate")
    pd_lo, pd_hi = _ci(overall, "paired_delta_acc1")
    row.update(
        img_size=input_size[-1],
        top1=cf.get("acc1"),
        top1_err=100.0 - cf["acc1"] if cf.get("acc1") is not None else None,
        top5=cf.get("acc5"),
        top5_err=100.0 - cf["acc5"] if cf.get("acc5") is not None else None,
        param_count=model.get("param_count"),
        crop_pct=data_config.get("crop_pct"),
        interpolation=data_config.get("interpolation"),
        paired_top1_diff=overall.get("paired_delta_acc1"),
        paired_top1_diff_ci_low=pd_lo,
        paired_top1_diff_ci_high=pd_hi,
        delta_p_gt_mean=overall.get("delta_p_gt_mean"),
        delta_p_gt_mean_ci_low=dp_lo,
        delta_p_gt_mean_ci_high=dp_hi,
        delta_p_gt_abs_mean=overall.get("delta_p_gt_abs_mean"),
        flip_rate=overall.get("flip_rate"),
        flip_rate_ci_low=fl_lo,
        flip_rate_ci_high=fl_hi,
        paired_original_top1=overall.get("orig_acc1"),
        paired_counterfactual_top1=overall.get("acc1"),
        n_pairs=overall.get("n"),
        original_top1=orig.get("acc1"),
        original_top5=orig.get("acc5"),
        unpaired_top1_diff=cf.get("delta_acc1"),
        unpaired_top5_diff=cf.get("delta_acc5"),
        n_counterfactual=cf.get("n"),
        n_original=orig.get("n"),
        reconstructed_top1=(metrics.get("reconstructed") or {}).get("acc1"),
        reconstructed_paired_top1_diff=(metrics.get("reconstructed") or {}).get("paired_delta_acc1"),
        lance_r_top1=(metrics.get("lance_r") or {}).get("acc1"),
        lance_r_paired_top1_diff=(metrics.get("lance_r") or {}).get("paired_delta_acc1"),
        lance_r_delta_p_gt_mean=lance_r.get("delta_p_gt_mean"),
        failed_samples=len(results.get("failures") or []),
    )
    # edit strength (evaluation.strength): the area under acc@1 against strength, and the share never failing
    strength = (results.get("strength") or {}).get("overall") or {}
    if strength:
        st_lo, st_hi = _ci(strength, "auc_acc1")
        row.update(
            strength_auc=strength.get("auc_acc1"),
            strength_auc_ci_low=st_lo,
            strength_auc_ci_high=st_hi,
            strength_never_fail_share=(strength.get("failure") or {}).get("never_share"),
        )
    if row["num_classes"] is not None and row["num_classes"] < MIN_CLASSES_FOR_TOP5:
        for column in TOP5_COLUMNS:
            row[column] = None
    row.update(_metric_columns(results))
    return row


def _metric_columns(results: dict[str, Any], config: str | None = None) -> dict[str, Any]:
    """The columns registered metrics declare (``Metric.leaderboard``), read from ``results``; a column that would
    replace a built-in one is a bug in the metric."""
    columns = {}
    for entry in metric_columns(results, config):
        if entry["column"] in COLUMNS or entry["column"] in RECORD_COLUMNS:
            raise MetricContractError(
                f"metric {entry['metric']!r} declares leaderboard column {entry['column']!r}, a built-in column"
            )
        columns[entry["column"]] = entry["value"]
    return columns


def extra_columns(df: Any) -> list[str]:
    """The columns of a leaderboard DataFrame that registered metrics added."""
    return [c for c in df.columns if c not in COLUMNS]


def build_leaderboard(results: list[dict[str, Any]]) -> Any:
    """The leaderboard DataFrame: one row per (model, weights), ranked by paired Delta acc@1.

    Raises:
        ValueError: when the results come from different releases.
    """
    import pandas as pd

    check_one_release(results)
    rows = [leaderboard_row(r) for r in results]
    fit = effective_robustness(results)
    for index, values in fit["by_model"].items():
        rows[index].update(values)
    extra = list(dict.fromkeys(c for row in rows for c in row if c not in COLUMNS))
    df = pd.DataFrame(rows, columns=[*COLUMNS, *extra])
    ranked = (df["status"] == "ok") & df["complete"].astype(bool)
    df["_group"] = 0
    df.loc[~ranked, "_group"] = 1
    df.loc[df["status"] != "ok", "_group"] = 2
    df = df.sort_values(
        ["_group", "paired_top1_diff", "top1", "model"], ascending=[True, False, False, True], na_position="last"
    ).reset_index(drop=True)
    ranked = df["_group"] == 0
    df.loc[ranked, "rank"] = range(1, int(ranked.sum()) + 1)
    if ranked.any():
        # rank_diff as in timm: rank on the original set minus rank on the counterfactual set (positive = moved up)
        rank_cf = df.loc[ranked, "top1"].rank(ascending=False, method="min")
        rank_orig = df.loc[ranked, "original_top1"].rank(ascending=False, method="min")
        df.loc[ranked, "rank_diff"] = rank_orig - rank_cf
    df = df.drop(columns="_group")
    for column in INTEGER_COLUMNS:
        df[column] = pd.array([None if _missing(v) else int(v) for v in df[column]], dtype="Int64")
    for column in [*COLUMNS, *extra]:
        if column not in INTEGER_COLUMNS and df[column].dtype == object:
            values = [v for v in df[column] if not _missing(v)]
            if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                df[column] = pd.to_numeric(df[column])
    df["complete"] = df["complete"].astype(bool)
    return df


def _missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN and pandas.NA
    except TypeError:
        return False


def fmt_number(value: Any, digits: int = 2) -> str:
    """A table cell: ``—`` for missing, integers as integers, floats rounded without a ``-0.00``."""
    if _missing(value):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            return "—"
        rounded = round(value, digits)
        if rounded == 0:
            rounded = 0.0  # no "-0.00"
        return f"{rounded:.{digits}f}"
    return str(value)


def _pct(value: Any) -> str:
    text = fmt_number(value)
    return text if text == "—" else f"{text}%"


def _with_ci(value: Any, low: Any, high: Any) -> str:
    text = fmt_number(value)
    if _missing(low) or _missing(high) or text == "—":
        return text
    return f"{text} [{fmt_number(low)}, {fmt_number(high)}]"


COMPACT_HEADER = [
    "rank",
    "model",
    "original acc@1",
    "counterfactual acc@1",
    "paired Δ acc@1 [95% CI]",
    "Δp(y_GT) [95% CI]",
    "flip rate % [95% CI]",
]
COMPACT_NOTE = (
    "Ranked by paired Δ acc@1: each counterfactual against its own original (higher = more robust). Accuracies are "
    "over those pairs. Δp(y_GT): mean drop of the true class's probability (points; + = the edits hurt). Flip rate: "
    "% of correctly classified originals whose counterfactual is misclassified. Brackets: 95% bootstrap intervals "
    "over source images."
)


STRENGTH_HEADER = "strength area acc@1 [95% CI]"
STRENGTH_NOTE = (
    "Strength area: the mean acc@1 over the edit strengths of the release's strength config (area under acc@1 against "
    "strength = 1 − self_replace, divided by the strengths' span; higher = more robust), over the edits that have a "
    'candidate at every strength, so that each strength scores the same images (docs/evaluation.md, "Edit strength").'
)


STABILITY_NOTE = (
    "Kendall's τ-b between the models' acc@1 at adjacent strengths, per edit type, over the edits with a candidate at "
    "every strength (1 = the same order at both strengths); 95% bootstrap interval over source images."
)
STABILITY_HEADER = ["edit type", "strengths", "Kendall τ [95% CI]", "images (edits)"]


def _stability_rows(stability: dict[str, Any]) -> list[list[str]]:
    """The rank-stability table's cells (plain text: the caller escapes for its format)."""
    rows = []
    for group, entry in stability["groups"].items():
        name = "all edits" if group == "overall" else str(group)
        if entry["reason"]:
            rows.append([name, "—", f"not computed: {entry['reason']}", "—"])
            continue
        for pair in entry["pairs"]:
            ci = pair["ci"] or [None, None]
            rows.append(
                [
                    name,
                    f"{fmt_number(pair['from'])} → {fmt_number(pair['to'])}",
                    _with_ci(pair["tau"], ci[0], ci[1]),
                    f"{entry['n_images']} ({entry['n_series']})",
                ]
            )
    return rows


def strength_stability_markdown(results: list[dict[str, Any]], n_boot: int = 1000, seed: int = 0) -> str:
    """Rank stability of the models across edit strength (``evaluation.strength.rank_stability``) as a paragraph and
    a table, "" when no result has a strength section. No heading: the card embeds it inside its leaderboard section."""
    if not any(r.get("status") == "ok" and r.get("strength") for r in results):
        return ""
    stability = rank_stability(results, n_boot=n_boot, seed=seed)
    lines = [f"**Rank stability across edit strength.** {STABILITY_NOTE}", ""]
    if stability["reason"]:
        return "\n".join([*lines, f"Not computed: {stability['reason']}.", ""])
    lines += ["| " + " | ".join(STABILITY_HEADER) + " |", "|:---|:---|---:|---:|"]
    # the edit type is data; the other cells are numbers and our own words (brackets of intervals kept)
    lines += ["| " + " | ".join([md_escape(row[0]), *row[1:]]) + " |" for row in _stability_rows(stability)]
    return "\n".join([*lines, ""])


def strength_stability_section(results: list[dict[str, Any]], n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The rank-stability table as a section of ``leaderboard.html`` (``leaderboard_sections.html.jinja``)."""
    stability = rank_stability(results, n_boot=n_boot, seed=seed)
    note = STABILITY_NOTE + (f" Not computed: {stability['reason']}." if stability["reason"] else "")
    return {
        "title": "Rank stability across edit strength",
        "note": note,
        "header": STABILITY_HEADER,
        "rows": [] if stability["reason"] else _stability_rows(stability),
        "image": None,
        "image_alt": None,
    }


def strength_stability_table(results: list[dict[str, Any]], n_boot: int = 1000, seed: int = 0) -> Any:
    """``strength_rank_stability.csv``: one row per edit type and pair of adjacent strengths."""
    import pandas as pd

    stability = rank_stability(results, n_boot=n_boot, seed=seed)
    rows = [
        {
            "edit_type": group,
            "from_strength": pair["from"],
            "to_strength": pair["to"],
            "kendall_tau": pair["tau"],
            "ci_low": pair["ci"][0] if pair["ci"] else None,
            "ci_high": pair["ci"][1] if pair["ci"] else None,
            "n_models": stability["n_models"],
            "n_images": entry["n_images"],
            "n_series": entry["n_series"],
        }
        for group, entry in stability["groups"].items()
        for pair in entry["pairs"]
    ]
    columns = ["edit_type", "from_strength", "to_strength", "kendall_tau", "ci_low", "ci_high", "n_models"]
    return pd.DataFrame(rows, columns=[*columns, "n_images", "n_series"])


def compact_markdown(df: Any) -> str:
    """The compact ranked table of a leaderboard DataFrame (ranked rows, then unranked incomplete ones); with a column
    for the strength area when some result has one (a release with a strength config)."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return ""
    with_strength = bool(ok["strength_auc"].notna().any())
    extra = extra_columns(df)  # what registered metrics add, after the built-in columns
    header = [*COMPACT_HEADER, *([STRENGTH_HEADER] if with_strength else []), *map(md_escape, extra)]
    align = ["---:", ":---", *["---:"] * (len(header) - 2)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    unranked = 0
    for row in ok.astype(object).to_dict("records"):
        rank = fmt_number(row["rank"]) if not _missing(row["rank"]) else "—"
        name = md_escape(_row_label(row))
        if not row["complete"]:
            unranked += 1
            if not _missing(row["limit"]):
                why = f"--limit {row['limit']}"
            else:
                why = f"{row['failed_samples']} failed samples" if row["failed_samples"] else "--metrics left some out"
            name += f" (incomplete: {why})"
        cells = [
            rank,
            name,
            fmt_number(row["paired_original_top1"]),
            fmt_number(row["paired_counterfactual_top1"]),
            _with_ci(row["paired_top1_diff"], row["paired_top1_diff_ci_low"], row["paired_top1_diff_ci_high"]),
            _with_ci(row["delta_p_gt_mean"], row["delta_p_gt_mean_ci_low"], row["delta_p_gt_mean_ci_high"]),
            _with_ci(row["flip_rate"], row["flip_rate_ci_low"], row["flip_rate_ci_high"]),
        ]
        if with_strength:
            cells.append(_with_ci(row["strength_auc"], row["strength_auc_ci_low"], row["strength_auc_ci_high"]))
        cells += [md_escape(v) if isinstance(v := row[c], str) else fmt_number(v) for c in extra]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", COMPACT_NOTE + (" " + STRENGTH_NOTE if with_strength else "")]
    if unranked:
        lines.append(
            "Incomplete runs (a `--limit` run, samples that failed to decode, or a `--metrics` selection that left out "
            "a default metric) are shown but not ranked."
        )
    return "\n".join(lines) + "\n"


def metric_versions_note(results: list[dict[str, Any]]) -> str:
    """One line naming the registered metrics (and versions) behind a table of results, "" for results before schema 3.

    Results that disagree on a metric's version show every version (``flip_rate 1/2``): their numbers may differ in
    definition, not only in the models.
    """
    versions: dict[str, list[str]] = {}
    for r in results:
        if r.get("status") == "ok":
            for name, version in (r.get("computed_metrics") or {}).items():
                if version not in versions.setdefault(name, []):
                    versions[name].append(version)
    if not versions:
        return ""
    listed = ", ".join(f"`{name}` {'/'.join(v)}" for name, v in versions.items())
    return f"Metrics (lance-cf eval, docs/evaluation.md, name and version): {listed}.\n"


def leaderboard_markdown(results: list[dict[str, Any]]) -> str:
    """THE compact ranked Markdown table for a list of results JSONs of one release ("" when none succeeded).

    The dataset card embeds this table; ``lance-cf leaderboard`` writes it at the top of ``leaderboard.md``.
    """
    results = [r for r in results if is_results(r)]
    if not any(r.get("status") == "ok" for r in results):
        return ""
    kinds = {kind_of_results(r).name: kind_of_results(r) for r in results}
    if len(kinds) == 1:
        (kind,) = kinds.values()
        if kind.leaderboard is not None:  # a kind with a table of its own (interfaces: per shift, not paired)
            return resolve_target(kind.leaderboard).markdown(results) + metric_versions_note(results)
    stability = strength_stability_markdown(results)
    table = compact_markdown(build_leaderboard(results))
    return table + (f"\n{stability}\n" if stability else "") + metric_versions_note(results)


def to_markdown(df: Any) -> str:
    """The full table as GitHub-flavoured Markdown (no extra dependency); acc@5 marked when not meaningful."""
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "|".join("---" for _ in df.columns) + "|"]
    for row in df.astype(object).to_dict("records"):
        few_classes = not _missing(row.get("num_classes")) and row["num_classes"] < MIN_CLASSES_FOR_TOP5
        cells = []
        for column in df.columns:
            value = row[column]
            if column in TOP5_COLUMNS and few_classes and row["status"] == "ok":
                cells.append(f"n/a (<{MIN_CLASSES_FOR_TOP5} classes)")
            elif isinstance(value, str):
                cells.append(md_escape(value))
            else:
                cells.append(fmt_number(value, 3 if column.startswith("effective_robustness") else 2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One line per config for a results JSON, in the spirit of timm validate.py's ``* Acc@1 ... Acc@5 ...``, then
    the strength curve's, the release kind's own (``ReleaseKind.summary_lines``) and what the run left out."""
    name = model_label(results)
    metrics = results.get("metrics") or {}
    few = (_num_classes(results) or MIN_CLASSES_FOR_TOP5) < MIN_CLASSES_FOR_TOP5
    pairs = {"counterfactual": (results.get("sensitivity") or {}).get("overall") or {}}
    pairs |= {c: (s or {}).get("overall") or {} for c, s in (results.get("sensitivity_by_config") or {}).items()}
    lines = []
    for config, entry in metrics.items():
        acc5 = "n/a" if few else f"{fmt_number(entry.get('acc5'), 3)}"
        line = f"{name} {config}: acc@1 {fmt_number(entry.get('acc1'), 3)} acc@5 {acc5} (n={entry.get('n')})"
        stats = pairs.get(config) or {}
        if stats:
            dlo, dhi = _ci(stats, "paired_delta_acc1")
            line += (
                f" | paired Δacc@1 {_with_ci(stats.get('paired_delta_acc1'), dlo, dhi)}"
                f" Δp {fmt_number(stats.get('delta_p_gt_mean'))} flip {_pct(stats.get('flip_rate'))}"
                f" ({stats.get('n')} pairs)"
            )
        lines.append(line)
    strength = (results.get("strength") or {}).get("overall")
    if strength:
        lo, hi = _ci(strength, "auc_acc1")
        failure = strength.get("failure") or {}
        headline = strength.get("headline") or {}
        pooled = strength.get("pooled") or {}
        lines.append(
            f"{name} strength: acc@1 area {_with_ci(strength.get('auc_acc1'), lo, hi)} over strengths "
            f"{fmt_number(min(strength['levels']))}-{fmt_number(max(strength['levels']))} "
            f"(the {headline.get('n_series')} of {strength.get('n_series')} edits seen at every strength; "
            f"all {strength.get('n')} samples pooled: {fmt_number(pooled.get('auc_acc1'))}); "
            f"{failure.get('n_never')} of {failure.get('n_images')} images never fail"
        )
    kind = kind_of_results(results)
    if kind.summary_lines is not None:  # lines of the release kind's own (the interfaces' per-shift drops)
        lines += resolve_target(kind.summary_lines)(results, name)
    if results.get("limit") is not None:
        lines.append(f"{name}: --limit {results['limit']} run (first samples of each config only; not complete)")
    if results.get("failures"):
        lines.append(f"{name}: {len(results['failures'])} sample(s) could not be read; see 'failures' in results.json")
    missing = missing_default_metrics(results)
    if missing:
        lines.append(f"{name}: --metrics left out {', '.join(missing)} (not complete)")
    return lines


PUBLISHED_CONFIGS = ("counterfactual", "lance_r", "reconstructed")
# The columns of a published row (leaderboard_records), which a registered metric's column may not replace.
RECORD_COLUMNS = frozenset(
    {"model", "weights", "config", "rank", "n_pairs", "original_acc1", "acc1", "acc5", "complete", "limit"}
    | {"paired_delta_acc1", "paired_delta_acc1_ci_low", "paired_delta_acc1_ci_high", "delta_p_gt_mean"}
    | {"delta_p_gt_mean_ci_low", "delta_p_gt_mean_ci_high", "flip_rate", "flip_rate_ci_low", "flip_rate_ci_high"}
    | {"effective_robustness", "effective_robustness_probit", "timm_results_name", "release", "release_version"}
    | {"manifest_sha256", "tool_version", "metric_versions", "release_id"}
)


def leaderboard_records(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the published leaderboard: one per successful model and release config other than ``original``.

    Columns: ``model, weights, config, rank`` (on counterfactual, complete runs), ``n_pairs, original_acc1, acc1,
    paired_delta_acc1`` (+ ``_ci_low/_ci_high``), ``delta_p_gt_mean`` (+ CI), ``flip_rate`` (+ CI), ``acc5``
    (null when the label space has fewer than 6 classes), ``effective_robustness``, ``effective_robustness_probit``
    (counterfactual only), ``timm_results_name`` and ``imagenetv2_drop, imagenet_r_drop, sketch_drop,
    imagenet_a_drop`` (timm's published top-1 drops of those weights, counterfactual rows of published timm weights
    only), ``complete, limit, release, release_version, manifest_sha256, tool_version`` and ``metric_versions`` (the
    JSON ``{metric: version}`` of the registered metrics behind the row).

    Raises:
        ValueError: when the results come from different releases.
    """
    results = [r for r in results if is_results(r)]
    if not results:
        return []
    board = build_leaderboard(results)
    board_rows = board.astype(object).to_dict("records")
    by_key = {row["run_key"]: row for row in board_rows if not _missing(row["run_key"])}
    by_label = {_row_label(row): row for row in board_rows}
    records = []
    for r in results:
        if r.get("status") != "ok":
            continue
        label = model_label(r)
        few = (_num_classes(r) or MIN_CLASSES_FOR_TOP5) < MIN_CLASSES_FOR_TOP5
        sections = {"counterfactual": r.get("sensitivity") or {}} | (r.get("sensitivity_by_config") or {})
        for config in PUBLISHED_CONFIGS:
            overall = (sections.get(config) or {}).get("overall")
            if not overall:
                continue
            key = (r.get("run") or {}).get("key")
            board_row = by_key.get(key) if key in by_key else by_label.get(label, {})
            pd_lo, pd_hi = _ci(overall, "paired_delta_acc1")
            dp_lo, dp_hi = _ci(overall, "delta_p_gt_mean")
            fl_lo, fl_hi = _ci(overall, "flip_rate")
            cf = config == "counterfactual"
            records.append(
                {
                    "model": (r.get("model") or {}).get("name"),
                    "weights": ((r.get("model") or {}).get("weights") or {}).get("id"),
                    "config": config,
                    "rank": None if not cf or _missing(board_row.get("rank")) else int(board_row["rank"]),
                    "n_pairs": overall.get("n"),
                    "original_acc1": overall.get("orig_acc1"),
                    "acc1": overall.get("acc1"),
                    "paired_delta_acc1": overall.get("paired_delta_acc1"),
                    "paired_delta_acc1_ci_low": pd_lo,
                    "paired_delta_acc1_ci_high": pd_hi,
                    "delta_p_gt_mean": overall.get("delta_p_gt_mean"),
                    "delta_p_gt_mean_ci_low": dp_lo,
                    "delta_p_gt_mean_ci_high": dp_hi,
                    "flip_rate": overall.get("flip_rate"),
                    "flip_rate_ci_low": fl_lo,
                    "flip_rate_ci_high": fl_hi,
                    "acc5": None if few else ((r.get("metrics") or {}).get(config) or {}).get("acc5"),
                    "effective_robustness": _none(board_row.get("effective_robustness")) if cf else None,
                    "effective_robustness_probit": _none(board_row.get("effective_robustness_probit")) if cf else None,
                    **_published_drops(r if cf else None),
                    "complete": is_complete(r),
                    "limit": r.get("limit"),
                    "release": (r.get("release") or {}).get("name"),
                    "release_version": (r.get("release") or {}).get("version"),
                    "manifest_sha256": (r.get("release") or {}).get("manifest_sha256"),
                    "tool_version": (r.get("tool") or {}).get("version"),
                    # provenance: which registered metrics (and versions) computed these numbers; "{}" before
                    # results recorded them (schema 3)
                    "metric_versions": json.dumps(r.get("computed_metrics") or {}, sort_keys=True),
                    **_metric_columns(r, config),
                }
            )
    return records


def _published_drops(results: dict[str, Any] | None) -> dict[str, Any]:
    """The timm-published top-1 drop (shift minus ImageNet) of the model's weights on each real shift, so that the
    published table carries what the shift correlation is computed from (null for other weights or configs)."""
    name = timm_model_name(results) if results is not None else None
    published = load_shift_table().get(name) if name else None
    drops = {f"{shift}_drop": (published[shift] - published["imagenet"]) if published else None for shift in SHIFTS}
    return {"timm_results_name": name if published else None, **drops}


def robustness_markdown(results: list[dict[str, Any]], n_boot: int = 1000, seed: int = 0) -> str:
    """The effective-robustness fit and the agreement with real shifts as Markdown sections (for the card too)."""
    results = [r for r in results if is_results(r)]
    check_one_release(results)
    fit = effective_robustness(results)
    return _er_markdown(fit) + "\n" + _shift_markdown(shift_correlations(results, n_boot=n_boot, seed=seed))


def _none(value: Any) -> Any:
    return None if _missing(value) else value


def build_leaderboard_by_config(results: list[dict[str, Any]]) -> Any:
    """:func:`leaderboard_records` as a DataFrame (integer columns as nullable integers), for Parquet publishing."""
    import pandas as pd

    df = pd.DataFrame(leaderboard_records(results))
    for column in ("rank", "n_pairs", "limit"):
        if column in df:
            df[column] = pd.array([None if _missing(v) else int(v) for v in df[column]], dtype="Int64")
    return df


def shift_correlation_table(correlations: dict[str, Any]) -> Any:
    import pandas as pd

    rows = [
        {
            "shift": entry["name"],
            "spearman": entry["spearman"],
            "ci_low": entry["ci"][0] if entry["ci"] else None,
            "ci_high": entry["ci"][1] if entry["ci"] else None,
            "n_models": entry["n_models"],
        }
        for entry in correlations["by_shift"].values()
    ]
    return pd.DataFrame(rows, columns=["shift", "spearman", "ci_low", "ci_high", "n_models"])


def _shift_markdown(correlations: dict[str, Any]) -> str:
    lines = [
        "## Agreement with real distribution shifts",
        "",
        "Spearman rank correlation, over models with published timm figures, between each model's paired Δ acc@1 "
        "here and its top-1 drop (shift − ImageNet) on each real shift; 95% bootstrap interval over models. "
        f"Published figures: {correlations['source']}.",
        "",
    ]
    if correlations["reason"]:
        return "\n".join([*lines, f"Not computed: {correlations['reason']}.", ""])
    lines += ["| shift | Spearman ρ [95% CI] | models |", "|---|---:|---:|"]
    for entry in correlations["by_shift"].values():
        ci = entry["ci"] or [None, None]
        lines.append(f"| {entry['name']} | {_with_ci(entry['spearman'], ci[0], ci[1])} | {entry['n_models']} |")
    return "\n".join([*lines, ""])


def _er_markdown(fit: dict[str, Any]) -> str:
    lines = ["## Effective robustness", ""]
    if fit["slope"] is None:
        return "\n".join([*lines, f"Not computed: {fit['reason']}.", ""])
    lines.append(
        f"Linear fit in probit space over {fit['n_models']} complete models: probit(counterfactual acc@1) = "
        f"{fit['slope']:.3f} · probit(original acc@1) {'−' if fit['intercept'] < 0 else '+'} "
        f"{abs(fit['intercept']):.3f} (paired accuracies). "
        "`effective_robustness`: points above the fit (Taori et al. 2020); see the full table and "
        "`effective_robustness.png`."
    )
    return "\n".join([*lines, ""])


def release_groups(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Results grouped by release (manifest hash), keyed by a folder name ``<name>-v<version>-<hash prefix>``."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        release = r.get("release") or {}
        raw = f"{release.get('name')}-v{release.get('version')}-{str(release.get('manifest_sha256'))[:12]}"
        folder = "".join(c if c.isalnum() or c in "._-" else "_" for c in raw)[:120]
        groups.setdefault(folder, []).append(r)
    return groups


def write_leaderboard(
    paths: list[str | Path], output_dir: Path, n_boot: int = 1000, seed: int = 0, split_releases: bool = False
) -> dict[str, Path]:
    """Write the leaderboard tables, plots and HTML page for the results found under ``paths``.

    Files: ``leaderboard.csv``, ``leaderboard.parquet``, ``leaderboard.md`` (compact ranked table, effective
    robustness, shift agreement, then the full table), ``leaderboard.html``, ``leaderboard_by_config.parquet`` (the
    published rows), ``shift_correlation.csv`` and the plots.

    Results of different releases are refused, or with ``split_releases`` written as one leaderboard per release in
    ``OUTPUT/<name>-v<version>-<hash>/`` (the returned paths are then those of the first release's leaderboard, and
    ``OUTPUT/index.md`` lists them all).
    """
    results = find_results(paths)
    own = {k.name: k for k in map(kind_of_results, results) if k.leaderboard is not None}
    if len(own) > 1:
        raise ValueError(
            f"the results come from releases of kinds {', '.join(sorted(own))}, each with a leaderboard of its own; "
            "pass each kind's results separately"
        )
    if own:
        # a kind with a table of its own (interfaces: per shift), given the paired writer for the other results
        (kind,) = own.values()
        return resolve_target(kind.leaderboard).write(
            results, output_dir, lambda paired, out: _write_one(paired, out, n_boot, seed)
        )
    groups = release_groups(results)
    if len(groups) > 1 and split_releases:
        output_dir = Path(output_dir)
        written_all = {folder: _write_one(group, output_dir / folder, n_boot, seed) for folder, group in groups.items()}
        lines = ["# Leaderboards, one per release", ""]
        lines += [f"- [{folder}]({folder}/leaderboard.md): {len(group)} results" for folder, group in groups.items()]
        (output_dir / "index.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        first = next(iter(written_all.values()))
        return first | {"index": output_dir / "index.md"}
    return _write_one(results, Path(output_dir), n_boot, seed)


def _write_one(results: list[dict[str, Any]], output_dir: Path, n_boot: int, seed: int) -> dict[str, Path]:
    df = build_leaderboard(results)  # refuses mixed releases before anything is written
    fit = effective_robustness(results)
    correlations = shift_correlations(results, n_boot=n_boot, seed=seed)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = {
        "csv": output_dir / "leaderboard.csv",
        "parquet": output_dir / "leaderboard.parquet",
        "markdown": output_dir / "leaderboard.md",
        "by_config": output_dir / "leaderboard_by_config.parquet",
        "shift_correlation": output_dir / "shift_correlation.csv",
        "html": output_dir / "leaderboard.html",
    }
    with_strength = any(r.get("status") == "ok" and r.get("strength") for r in results)
    if with_strength:
        written["strength_rank_stability"] = output_dir / "strength_rank_stability.csv"
        write_csv(strength_stability_table(results, n_boot, seed), written["strength_rank_stability"])
    write_csv(df, written["csv"])
    df.to_parquet(written["parquet"], index=False)
    build_leaderboard_by_config(results).to_parquet(written["by_config"], index=False)
    write_csv(shift_correlation_table(correlations), written["shift_correlation"])
    written.update({f"timm_csv_{p.stem}": p for p in write_timm_csvs(results, output_dir)})
    sensitivity = template_sensitivity(results, n_boot, seed)
    if sensitivity:
        written["template_sensitivity"] = output_dir / "template_sensitivity.csv"
        write_csv(template_sensitivity_table(sensitivity), written["template_sensitivity"])
        written["template_sensitivity_plot"] = plot_template_sensitivity(
            sensitivity, output_dir / "template_sensitivity.png"
        )
    note = template_note(results)
    release = results[0].get("release") or {}
    title = f"# Leaderboard: {md_escape(release.get('name'))} {md_escape(release.get('version'))}\n\n"
    markdown = (
        title
        + (compact_markdown(df) or "No model was evaluated successfully; the full table below lists the errors.\n")
        + (f"\n{note}\n" if note else "")
        + (template_sensitivity_markdown(sensitivity) if sensitivity else "")
        + "\n"
        + _er_markdown(fit)
        + "\n"
        + _shift_markdown(correlations)
        + (
            "\n## Rank stability across edit strength\n\n" + strength_stability_markdown(results, n_boot, seed)
            if with_strength
            else ""
        )
        + "\n## Full table\n\n"
        + to_markdown(df)
    )
    written["markdown"].write_text(markdown, encoding="utf-8")
    written["edit_type_sensitivity"] = plot_edit_type_sensitivity(results, output_dir / "edit_type_sensitivity.png")
    written["class_delta_acc"] = plot_class_delta_acc(results, output_dir / "class_delta_acc.png")
    written["acc_scatter"] = plot_acc_scatter(results, output_dir / "acc_original_vs_counterfactual.png")
    written["effective_robustness_plot"] = plot_effective_robustness(
        results, fit, output_dir / "effective_robustness.png"
    )
    written["shift_correlation_plot"] = plot_shift_correlation(correlations, output_dir / "shift_correlation.png")
    if with_strength:
        written["strength_plot"] = plot_strength_models(results, output_dir / "strength.png")
    sections = [strength_stability_section(results, n_boot, seed)] if with_strength else []
    if sensitivity or note:
        sections.append(template_sensitivity_section(sensitivity, note))
    written["html"].write_text(_html_page(release, df, fit, correlations, written, sections), encoding="utf-8")
    logger.debug("leaderboard of %d rows written to %s", len(df), output_dir)
    return written


def _html_page(
    release: dict[str, Any],
    df: Any,
    fit: dict[str, Any],
    correlations: dict[str, Any],
    written,
    sections: list[dict[str, Any]] | None = None,
) -> str:
    """``leaderboard.html`` (``templates/leaderboard.html.jinja``, autoescaped): the compact table, the fits, the plots."""
    extra = extra_columns(df)
    rows = []
    for row in df[df["status"] == "ok"].astype(object).to_dict("records"):
        rows.append(
            [
                fmt_number(row["rank"]),
                _row_label(row) + ("" if row["complete"] else " (incomplete)"),
                fmt_number(row["paired_original_top1"]),
                fmt_number(row["paired_counterfactual_top1"]),
                _with_ci(row["paired_top1_diff"], row["paired_top1_diff_ci_low"], row["paired_top1_diff_ci_high"]),
                _with_ci(row["delta_p_gt_mean"], row["delta_p_gt_mean_ci_low"], row["delta_p_gt_mean_ci_high"]),
                _with_ci(row["flip_rate"], row["flip_rate_ci_low"], row["flip_rate_ci_high"]),
                fmt_number(row["effective_robustness"]),
                *(v if isinstance(v := row[c], str) else fmt_number(v) for c in extra),
            ]
        )
    er_note = (
        fit["reason"]
        if fit["slope"] is None
        else f"probit(cf) = {fit['slope']:.3f} · probit(orig) {'−' if fit['intercept'] < 0 else '+'} "
        f"{abs(fit['intercept']):.3f} over {fit['n_models']} models"
    )
    plots = ["effective_robustness_plot", "shift_correlation_plot", "acc_scatter", "edit_type_sensitivity"]
    plots = [k for k in [*plots, "class_delta_acc", "strength_plot"] if k in written]
    paired = {
        "header": [*COMPACT_HEADER, "effective robustness", *extra],
        "rows": rows,
        "note": COMPACT_NOTE,
        "er_note": er_note,
        "shift_source": correlations["source"],
        "shift_note": correlations["reason"] or "",
        "shifts": [
            {"name": e["name"], "rho": _with_ci(e["spearman"], *(e["ci"] or [None, None])), "n_models": e["n_models"]}
            for e in correlations["by_shift"].values()
        ],
        "plots": [{"src": written[k].name, "alt": k} for k in plots],
    }
    return render_page(
        "leaderboard.html.jinja",
        name=f"{release.get('name')} {release.get('version')}",
        manifest=str(release.get("manifest_sha256"))[:16],
        paired=paired,
        sections=sections or [],
    )


# The card's ``## Leaderboard`` section: this table under its heading, or refreshed in an already rendered card (the
# card renders it at build time; publishing results refreshes it on the Hub).
LEADERBOARD_HEADING = "## Leaderboard\n"
LEADERBOARD_ANCHOR = "## How it was built\n"


def leaderboard_section(results: list[dict]) -> str:
    """The card's ``## Leaderboard`` section (heading, table, trailing blank line), or ``""`` without results."""
    table = leaderboard_markdown(results) if results else ""
    return f"{LEADERBOARD_HEADING}\n{table}\n" if table else ""


def replace_leaderboard_section(card_text: str, results: list[dict]) -> str:
    """Refresh the leaderboard of an already rendered card (no shards needed), keeping everything else."""
    return replace_card_section(card_text, LEADERBOARD_HEADING, leaderboard_section(results), LEADERBOARD_ANCHOR)


def replace_card_section(card_text: str, heading: str, section: str, anchor: str) -> str:
    """``card_text`` with its section under ``heading`` (up to the next ``## `` heading) replaced by ``section`` ("":
    removed); a card without one gets it before the ``anchor`` heading, else at its end. Everything else is kept."""
    start = card_text.find("\n" + heading)
    if start >= 0:
        start += 1
        end = card_text.find("\n## ", start + len(heading))
        end = len(card_text) if end < 0 else end + 1
        return card_text[:start] + section + card_text[end:]
    if not section:
        return card_text
    at = card_text.find("\n" + anchor)
    if at < 0:
        return card_text.rstrip("\n") + "\n\n" + section
    return card_text[: at + 1] + section + card_text[at + 1 :]
