"""Evaluation of a dataset-interfaces release (ImageNet*-style: one generated config per shift plus ``base``).

Such a release has no ``original`` config and no pairing between images: a ``base`` image and an ``in_the_snow``
image of the same class are independent generations. So the paired LANCE metrics (Delta p(y_GT), flip rate, paired
Delta acc) do not apply; what applies is the paper's metric (Vendrow et al., arXiv 2302.07865), computed per shift by
:func:`evaluation.interfaces.shift_metrics.shift_accuracy_drop`: among classes with at least 5 kept images in the shift, the mean
per-class top-1 accuracy, and its drop against ``base`` over the same classes, with a bootstrap over classes.

This module owns the ``interfaces`` section of a results JSON (its layout, its validation, its tables) and the
combined table that puts a LANCE release (drop per edit type) and an interfaces release (drop per shift) side by side.
"""

from __future__ import annotations

from typing import Any

from builder.release_format.text_out import write_csv
from evaluation.interfaces.shift_metrics import MIN_PER_CLASS, per_class_accuracy, shift_accuracy_drop
from evaluation.leaderboard import _with_ci as interval_text
from evaluation.leaderboard import fmt_number
from evaluation.metric_registry import Metric, MetricContext
from evaluation.pages import render_page
from evaluation.results import check_one_release, is_complete, model_label
from lance_pipeline.release_kinds import kind_of_results

KIND = "interfaces"  # the release kind whose results this module reads (lance_pipeline/interfaces/release_kind.py)
BASE_CONFIG = "base"
# Configs an interfaces release may hold that are not shifts: never scored as one, never in a shift table.
NON_SHIFT_CONFIGS = ("rejected",)
SHIFT_FIELDS = ("classes", "classes_excluded", "min_per_class", "accuracy", "base_accuracy", "drop", "drop_ci", "n")


def is_interfaces_results(results: dict[str, Any]) -> bool:
    """True for a results JSON of an interfaces release (it carries the ``interfaces`` section)."""
    return isinstance(results.get("interfaces"), dict)


def release_shift_configs(manifest: dict[str, Any] | None) -> list[str] | None:
    """The shifts an interfaces release declares (``source.shifts`` of its manifest) other than ``base``; None when
    the manifest does not say (then every config but ``base`` and ``NON_SHIFT_CONFIGS`` is taken for a shift)."""
    shifts = ((manifest or {}).get("source") or {}).get("shifts")
    if not isinstance(shifts, list):
        return None
    return [str(s.get("name")) for s in shifts if isinstance(s, dict) and s.get("name") != BASE_CONFIG]


def shift_metrics(
    rows: list[dict[str, Any]],
    label_names: list[str],
    *,
    shift_configs: list[str] | None = None,
    min_per_class: int = MIN_PER_CLASS,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """The ``interfaces`` section of a results JSON from per-sample prediction rows (``config``, ``label``,
    ``correct1``): per shift config, :func:`shift_accuracy_drop` plus ``n`` (scored images).

    Only shifts are scored: ``shift_configs`` (the release's declared shifts) when given, else every config but
    ``base`` and the non-shift configs (``rejected``). Any other scored config is listed under ``not_shifts``."""
    by_config: dict[str, tuple[list[int], list[bool]]] = {}
    for row in rows:
        labels, correct = by_config.setdefault(row["config"], ([], []))
        labels.append(int(row["label"]))
        correct.append(bool(row["correct1"]))
    if BASE_CONFIG not in by_config:
        raise ValueError(f"interfaces release: no scored sample in the '{BASE_CONFIG}' config; the drop needs it")
    base = per_class_accuracy(*by_config[BASE_CONFIG])

    def is_shift(config: str) -> bool:
        if config == BASE_CONFIG or config in NON_SHIFT_CONFIGS:
            return False
        return shift_configs is None or config in shift_configs

    shifts = {}
    for config, (labels, correct) in by_config.items():
        if not is_shift(config):
            continue
        entry = shift_accuracy_drop(
            per_class_accuracy(labels, correct), base, min_per_class=min_per_class, n_boot=n_boot, seed=seed
        )
        shifts[config] = {**entry, "n": len(labels)}
    base_classes = {str(c): {"n": n, "acc1": 100.0 * k / n} for c, (k, n) in base.items()}
    return {
        "metric": "mean per-class top-1 accuracy over classes with >= min_per_class images (Vendrow et al. 2023)",
        "base_config": BASE_CONFIG,
        "min_per_class": min_per_class,
        "base_by_class": base_classes,
        "shifts": shifts,
        "not_shifts": sorted(c for c in by_config if c != BASE_CONFIG and not is_shift(c)),
    }


def scored_shifts(section: dict[str, Any]) -> dict[str, Any]:
    """The shift entries of an ``interfaces`` section, without any non-shift config (results written before only
    shifts were scored may hold a ``rejected`` entry)."""
    return {k: v for k, v in (section.get("shifts") or {}).items() if k not in NON_SHIFT_CONFIGS}


def report_section(results: dict[str, Any]) -> dict[str, Any] | None:
    """The per-shift table of a model's report (the interfaces kind's ``report_section``); None without the section."""
    section = results.get("interfaces")
    if not isinstance(section, dict):
        return None
    rows = [
        [
            shift,
            str(entry["n"]),
            _fmt(entry["accuracy"]),
            _fmt(entry["base_accuracy"]),
            _with_ci(entry["drop"], entry.get("drop_ci")),
            str(entry["classes"]),
            ", ".join(str(c) for c in entry["classes_excluded"]) or "–",
        ]
        for shift, entry in scored_shifts(section).items()
    ]
    note = (
        "Interfaces release (generated images, no pairs): per shift, mean per-class top-1 accuracy over classes with at "
        f"least {int(section['min_per_class'])} images in the shift, and the drop against {section.get('base_config')} "
        "over the same classes; 95% bootstrap interval over classes. The paired metrics below do not apply."
    )
    header = ["shift", "n", "acc@1 (shift)", "acc@1 (base, same classes)", "drop [95% CI]", "classes used"]
    return {"title": "Per shift", "note": note, "header": [*header, "classes excluded"], "rows": rows}


class ShiftAccuracyDrop(Metric):
    """The registered metric of an interfaces release (``METRICS["shift_accuracy_drop"]``): :func:`shift_metrics`."""

    name = "shift_accuracy_drop"
    version = "1"
    description = (
        "Interfaces releases (a base config, no original): per shift, the mean per-class top-1 accuracy over classes "
        "with at least --min-per-class images there, and its drop against base over the same classes, with a 95% "
        "bootstrap interval over classes (Vendrow et al. 2023)."
    )
    needs = ("config", "label", "correct1")
    produces = ("interfaces",)

    def applies(self, context: MetricContext) -> bool:
        # the release kind limits this metric to interfaces releases (their kind lists it); it needs their base config
        return BASE_CONFIG in (context.release_configs or [])

    def compute(self, context: MetricContext) -> dict[str, Any]:
        section = shift_metrics(
            context.rows,
            context.label_names,
            shift_configs=release_shift_configs(context.manifest),
            min_per_class=context.min_per_class,
            n_boot=context.n_boot,
            seed=context.seed,
        )
        return {"interfaces": section}


def validate_interfaces(section: Any) -> None:
    """Check the ``interfaces`` section of a results JSON; raise ``ValueError`` naming the first bad field."""
    if not isinstance(section, dict) or not isinstance(section.get("shifts"), dict):
        raise ValueError("results JSON field 'interfaces' must be an object with a 'shifts' object")
    for shift, entry in section["shifts"].items():
        where = f"interfaces.shifts.{shift}"
        if not isinstance(entry, dict):
            raise ValueError(f"results JSON field '{where}' must be an object")
        for name in ("classes", "n", "min_per_class"):
            if isinstance(entry.get(name), bool) or not isinstance(entry.get(name), int):
                raise ValueError(f"results JSON field '{where}.{name}' must be an integer, got {entry.get(name)!r:.60}")
        for name in ("accuracy", "base_accuracy", "drop"):
            value = entry.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"results JSON field '{where}.{name}' must be a number or null, got {value!r:.60}")
        ci = entry.get("drop_ci")
        if ci is not None and not (isinstance(ci, list) and len(ci) == 2):
            raise ValueError(f"results JSON field '{where}.drop_ci' must be null or [low, high], got {ci!r:.60}")
        if not isinstance(entry.get("classes_excluded"), list):
            raise ValueError(f"results JSON field '{where}.classes_excluded' must be a list of class labels")


def _fmt(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _with_ci(value: Any, ci: Any) -> str:
    text = _fmt(value)
    return f"{text} [{_fmt(ci[0])}, {_fmt(ci[1])}]" if value is not None and ci else text


def shift_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (successful interfaces model, shift): model label, shift, accuracy, base accuracy, drop and its
    interval, classes used and excluded, images scored, complete."""
    rows = []
    for r in results:
        if r.get("status") != "ok" or not is_interfaces_results(r):
            continue
        for shift, entry in scored_shifts(r["interfaces"]).items():
            ci = entry.get("drop_ci") or [None, None]
            rows.append(
                {
                    "model": model_label(r),
                    "release": (r.get("release") or {}).get("name"),
                    "shift": shift,
                    "n": entry["n"],
                    "classes": entry["classes"],
                    "classes_excluded": len(entry["classes_excluded"]),
                    "accuracy": entry["accuracy"],
                    "base_accuracy": entry["base_accuracy"],
                    "drop": entry["drop"],
                    "drop_ci_low": ci[0],
                    "drop_ci_high": ci[1],
                    "complete": is_complete(r),
                }
            )
    return rows


def shift_markdown(results: list[dict[str, Any]]) -> str:
    """The per-shift table (one line per model and shift) as Markdown, "" when no interfaces results succeeded."""
    rows = shift_rows(results)
    if not rows:
        return ""
    min_per_class = next(
        r["interfaces"]["min_per_class"] for r in results if r.get("status") == "ok" and is_interfaces_results(r)
    )
    lines = [
        "| model | shift | acc@1 (shift) | acc@1 (base, same classes) | drop [95% CI] | classes used | excluded | n |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = row["model"] + ("" if row["complete"] else " (incomplete)")
        lines.append(
            f"| {name} | {row['shift']} | {_fmt(row['accuracy'])} | {_fmt(row['base_accuracy'])} | "
            f"{_with_ci(row['drop'], [row['drop_ci_low'], row['drop_ci_high']] if row['drop_ci_low'] is not None else None)}"
            f" | {row['classes']} | {row['classes_excluded']} | {row['n']} |"
        )
    note = (
        f"Per shift: mean per-class top-1 accuracy over classes with at least {min_per_class} kept images in the "
        "shift, and the drop against `base` over the same classes (Vendrow et al. 2023); 95% bootstrap interval "
        "over classes. A shift whose every class has fewer images shows – (no class qualifies)."
    )
    return "\n".join([*lines, "", note]) + "\n"


def lance_edit_type_drops(results: dict[str, Any]) -> dict[str, float | None]:
    """Per edit type of a LANCE results JSON: the accuracy drop in points (original minus counterfactual acc@1 over
    the pairs of that edit type, i.e. minus the paired Delta acc@1), the LANCE counterpart of a shift's drop."""
    by_edit = (results.get("sensitivity") or {}).get("by_edit_type") or {}
    drops = {}
    for edit_type, stats in by_edit.items():
        value = (stats or {}).get("paired_delta_acc1")
        drops[f"edit: {edit_type}"] = None if value is None else 0.0 - float(value) + 0.0  # no "-0.00"
    return drops


def combined_rows(results: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per model over LANCE and interfaces results: columns ``edit: <type>`` (LANCE, drop per edit type) and
    ``shift: <name>`` (interfaces, drop per shift), all in accuracy points lost. Returns (columns, rows)."""
    columns: list[str] = []
    by_model: dict[str, dict[str, Any]] = {}
    for r in results:
        if r.get("status") != "ok":
            continue
        label = model_label(r)
        row = by_model.setdefault(label, {"model": label, "releases": []})
        release = r.get("release") or {}
        row["releases"].append(f"{release.get('name')} {release.get('version')}")
        if is_interfaces_results(r):
            values = {f"shift: {s}": e.get("drop") for s, e in scored_shifts(r["interfaces"]).items()}
        else:
            values = lance_edit_type_drops(r)
        for column, value in values.items():
            if column in row and row[column] != value:
                raise ValueError(
                    f"two results of model {label!r} give '{column}'; pass one result per model and release"
                )
            row[column] = value
            if column not in columns:
                columns.append(column)
    columns = sorted(c for c in columns if c.startswith("edit: ")) + sorted(
        c for c in columns if c.startswith("shift:")
    )
    return columns, list(by_model.values())


def combined_markdown(results: list[dict[str, Any]]) -> str:
    """The combined table (LANCE per edit type vs interfaces per shift) as Markdown."""
    columns, rows = combined_rows(results)
    lines = ["| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for row in rows:
        lines.append(f"| {row['model']} | " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    note = (
        "Top-1 accuracy drop in points, per LANCE edit type (original minus counterfactual over the pairs of that "
        "edit type) and per interfaces shift (base minus shift, mean per-class accuracy over the shift's classes with "
        "enough images). The two kinds are measured differently (paired real edits vs independent generations): "
        "read them side by side, not as one ranking."
    )
    return "\n".join([*lines, "", note]) + "\n"


def plot_combined(results: list[dict[str, Any]], path: Any) -> Any:
    """A grouped bar chart of :func:`combined_rows` (one group per column, one bar per model); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    columns, rows = combined_rows(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(columns) + 2), 4))
    width = 0.8 / max(1, len(rows))
    x = np.arange(len(columns))
    for i, row in enumerate(rows):
        values = [np.nan if row.get(c) is None else row[c] for c in columns]
        ax.bar(x + i * width, values, width, label=row["model"])
    ax.set_xticks(x + width * (len(rows) - 1) / 2, columns, rotation=30, ha="right")
    ax.set_ylabel("top-1 accuracy drop (points)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def release_classes(results: dict[str, Any]) -> list[int]:
    """The class labels a results JSON scored (over every config)."""
    labels = set()
    for entry in (results.get("metrics") or {}).values():
        labels |= {int(label) for label in (entry.get("by_class") or {})}
    return sorted(labels)


def classes_note(results: list[dict[str, Any]]) -> str:
    """One line per release naming the classes it scored, and a warning when the releases' classes differ."""
    by_release: dict[str, list[int]] = {}
    for r in results:
        if r.get("status") == "ok":
            release = r.get("release") or {}
            by_release.setdefault(f"{release.get('name')} {release.get('version')}", release_classes(r))
    lines = [f"- {name}: classes {', '.join(map(str, labels))}" for name, labels in by_release.items()]
    if len({tuple(v) for v in by_release.values()}) > 1:
        lines.append("- **The releases do not cover the same classes**: compare the columns with care.")
    return "\n".join(lines) + "\n"


def write_interfaces_leaderboard(results: list[dict[str, Any]], output_dir: Any, write_lance: Any) -> dict[str, Any]:
    """The leaderboard files when some results come from an interfaces release.

    ``shifts.csv`` / ``shifts.md``: one row per model and shift. With LANCE results as well: the LANCE leaderboard
    (``write_lance(lance_results, output_dir)``, which still refuses several LANCE releases), and the side-by-side
    comparison ``combined.csv`` / ``combined.md`` / ``combined.png`` (drop per edit type vs per shift, per model);
    ``leaderboard.md`` then ends with the per-shift and combined sections. Several interfaces releases are refused.
    """
    from pathlib import Path

    import pandas as pd

    interfaces = [r for r in results if is_interfaces_release(r)]
    lance = [r for r in results if not is_interfaces_release(r)]
    check_one_release(interfaces)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = {}
    if lance:
        written |= write_lance(lance, output_dir)
    written["shifts_csv"] = output_dir / "shifts.csv"
    written["shifts_markdown"] = output_dir / "shifts.md"
    write_csv(pd.DataFrame(shift_rows(interfaces)), written["shifts_csv"])
    release = next((r.get("release") or {} for r in interfaces), {})
    title = f"## Per shift: {release.get('name')} {release.get('version')}\n\n"
    shifts_md = title + (shift_markdown(interfaces) or "No model was evaluated successfully on this release.\n")
    written["shifts_markdown"].write_text(shifts_md, encoding="utf-8")
    markdown = shifts_md
    if lance:
        columns, rows = combined_rows(results)
        written["combined_csv"] = output_dir / "combined.csv"
        written["combined_markdown"] = output_dir / "combined.md"
        write_csv(
            pd.DataFrame(rows, columns=["model", "releases", *columns]).assign(
                releases=lambda df: df["releases"].map("; ".join)
            ),
            written["combined_csv"],
        )
        combined_md = (
            "## LANCE edits vs generated shifts\n\n" + combined_markdown(results) + "\n" + classes_note(results)
        )
        written["combined_markdown"].write_text(combined_md, encoding="utf-8")
        written["combined_plot"] = plot_combined(results, output_dir / "combined.png")
        markdown += "\n" + combined_md
        markdown = written["markdown"].read_text(encoding="utf-8") + "\n" + markdown
    else:
        markdown = f"# Leaderboard: {release.get('name')} {release.get('version')}\n\n" + markdown
        for r in interfaces:
            if r.get("status") != "ok":
                markdown += f"\n- {(r.get('model') or {}).get('name')}: error: {r.get('error')}\n"
    written["markdown"] = output_dir / "leaderboard.md"
    written["markdown"].write_text(markdown, encoding="utf-8")
    written["html"] = _write_html(output_dir, written, interfaces, results if lance else None)
    return written


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "–"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _write_html(output_dir: Any, written: dict[str, Any], interfaces: list[dict[str, Any]], combined: Any) -> Any:
    """``leaderboard.html``: the LANCE page (when there is one) with the per-shift and combined sections added before
    its end, or a page of its own (``templates/leaderboard*.html.jinja``, autoescaped)."""
    release = next((r.get("release") or {} for r in interfaces), {})
    name = f"{release.get('name')} {release.get('version')}"
    shift_columns = list(shift_rows(interfaces)[0]) if shift_rows(interfaces) else ["model", "shift"]
    sections = [
        {
            "title": f"Per shift: {name}",
            "note": None,
            "header": shift_columns,
            "rows": [[_cell(row.get(c)) for c in shift_columns] for row in shift_rows(interfaces)],
            "image": None,
        }
    ]
    if combined is not None:
        columns, rows = combined_rows(combined)
        sections.append(
            {
                "title": "LANCE edits vs generated shifts",
                "note": "Top-1 accuracy drop in points per LANCE edit type (paired) and per interfaces shift "
                "(per-class, unpaired).",
                "header": ["model", *columns],
                "rows": [[row["model"], *(_cell(row.get(c)) for c in columns)] for row in rows],
                "image": "combined.png",
                "image_alt": "combined",
            }
        )
    path = output_dir / "leaderboard.html"
    if "html" in written and path.is_file():
        added = render_page("leaderboard_sections.html.jinja", sections=sections)
        page = path.read_text(encoding="utf-8").replace("</body>", added + "</body>", 1)
    else:
        page = render_page("leaderboard.html.jinja", name=name, manifest="", paired=None, sections=sections)
    path.write_text(page, encoding="utf-8")
    return path


def is_interfaces_release(results: dict[str, Any]) -> bool:
    """True for a results JSON (successful or not) of an interfaces release, by its release kind."""
    return kind_of_results(results).name == KIND


class ShiftLeaderboard:
    """The leaderboard of the interfaces kind (its ``leaderboard`` target): the per-shift table, in the card and in
    ``lance-cf leaderboard``'s files, beside the paired table of LANCE results given with it."""

    @staticmethod
    def markdown(results: list[dict[str, Any]]) -> str:
        return shift_markdown(results)

    @staticmethod
    def write(results: list[dict[str, Any]], output_dir: Any, write_paired: Any) -> dict[str, Any]:
        return write_interfaces_leaderboard(results, output_dir, write_paired)


SHIFT_LEADERBOARD = ShiftLeaderboard()


def summary_lines(results: dict[str, Any], name: str) -> list[str]:
    """The per-shift lines ``lance-cf eval`` prints for an interfaces release (``ReleaseKind.summary_lines``)."""
    lines = []
    for shift, entry in ((results.get(KIND) or {}).get("shifts") or {}).items():
        lo, hi = (entry.get("drop_ci") or [None, None])[:2]
        lines.append(
            f"{name} shift {shift}: acc@1 {fmt_number(entry.get('accuracy'))} vs base "
            f"{fmt_number(entry.get('base_accuracy'))}, drop {interval_text(entry.get('drop'), lo, hi)} "
            f"({entry.get('classes')} classes, {len(entry.get('classes_excluded') or [])} excluded)"
        )
    return lines
