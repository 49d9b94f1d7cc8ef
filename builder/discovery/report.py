"""The HTML report of a failure discovery: rates against base, the hypotheses tested, refinements, galleries.

Self-contained HTML with images beside it in ``assets/`` (no script, no remote resource), rendered from
``templates/report.html.jinja`` with Jinja2's autoescape, so every text that comes from a model, a caption or a class
name is HTML-escaped; plot text is never parsed as mathtext.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2

from builder.release_format.text_out import html_environment
from lance_pipeline.discovery.search import TARGET_LABEL_TEST, TOTAL_TEST
from lance_pipeline.discovery.statistics import clopper_pearson

GALLERY_IMAGES = 6
PANELS = ((TARGET_LABEL_TEST, "rate of the target label"), (TOTAL_TEST, "total failure rate"))


def _safe_name(text: str, limit: int = 60) -> str:
    """A bounded file-name fragment (class names can be long or hostile)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text)[:limit] or "x"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def rates_figure(rows: list[dict[str, Any]]):
    """Each hypothesis's two rates (dot: under its description, 95% CI; band: at base, 95% CI) in two panels: the rate
    of its target label and the total failure rate. The figure is sized so that no label is cut off.

    Each row needs ``model, class_name, description, target_name, discovered`` and, per test kind, ``tests[kind]``
    with ``rate, interval, base_count, base_n``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        fig, axes = plt.subplots(1, len(PANELS), sharey=True, figsize=(9, 0.45 * max(len(rows), 2) + 1.4))
        for ax, (kind, title) in zip(axes, PANELS, strict=True):
            for i, row in enumerate(rows):
                test = row["tests"][kind]
                low, high = test["interval"]
                colour = "tab:red" if kind in row["discovered_by"] else "tab:gray"
                ax.errorbar(test["rate"], i, xerr=[[test["rate"] - low], [high - test["rate"]]], fmt="o", color=colour)
                blow, bhigh = clopper_pearson(test["base_count"], test["base_n"])
                ax.plot([blow, bhigh], [i, i], color="tab:blue", alpha=0.35, linewidth=6)
            ax.set_xlim(0, 1)
            ax.set_title(title)
            ax.set_xlabel("rate (dot: description; band: base; 95% CI)")
        axes[0].set_yticks(range(len(rows)))
        axes[0].set_yticklabels([
            f"{_short(r['model'], 24)} | {_short(r['class_name'], 24)} + {_short(r['description'], 30)}"
            f" → {_short(r['target_name'], 20)}"
            for r in rows
        ])  # fmt: skip
        axes[0].invert_yaxis()
        fit_labels(fig)
    return fig


def fit_labels(fig: Any, axes_width_in: float = 3.2, pad_in: float = 0.2) -> None:
    """Widen ``fig`` so that its tick labels, titles and axis labels fit beside plots of a fixed width; lay it out.

    ``tight_layout`` alone only shrinks the axes inside a fixed figure: with long row labels it gives up (a warning)
    and the labels run off the edge. Here the figure's width is the widest text plus a fixed width per plot.
    """
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()

    def width(texts) -> float:
        return max((t.get_window_extent(renderer).width / fig.dpi for t in texts if t.get_text()), default=0.0)

    labels = width([t for ax in fig.axes for t in ax.get_yticklabels()])
    per_axes = max(axes_width_in, *(width([ax.xaxis.label, ax.title]) for ax in fig.axes))
    fig.set_size_inches(labels + (per_axes + pad_in) * len(fig.axes) + 2 * pad_in, fig.get_size_inches()[1])
    fig.tight_layout(pad=0.4)


def plot_rates(rows: list[dict[str, Any]], path: Path) -> None:
    """Save ``rates_figure(rows)`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = rates_figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_discovery_report(
    document: dict[str, Any], images: Any, predicted: Any, label_name: Any, output: Path
) -> Path:
    """Write ``report.html`` (and ``assets/``) for a discoveries document.

    Args:
        document: The discoveries document (``builder.discovery.run``).
        images: callable(keys) -> PIL images (from the discovery ledger).
        predicted: callable(model, keys) -> {key: predicted label}.
        label_name: callable(label) -> class name.
        output: Directory of the report.
    """
    output = Path(output)
    assets = output / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    families = []
    for model, result in document["models"].items():
        families.append({"model": model, **result["families"]})
        for entry in result["classes"]:
            for hypothesis in entry["hypotheses"]:
                rows.append({
                    **hypothesis, "model": model, "class_name": entry["class_name"], "label": entry["label"],
                    "target_name": label_name(hypothesis["target_label"]),
                    "refined": hypothesis.get("refined_description"),
                })  # fmt: skip
    plot = None
    if rows:
        plot_rates(rows, assets / "rates.png")
        plot = "assets/rates.png"
    found = []
    for index, r in enumerate(row for row in rows if row["discovered"]):
        tag = f"{index:03d}_{_safe_name(r['class_name'])}"
        galleries = []
        for title, letter, keys in (
            ("base images that failed", "b", r["members"]),
            ("description images", "d", r["keys"]),
        ):
            shown = keys[:GALLERY_IMAGES]
            labels = predicted(r["model"], shown)
            gallery = {"title": title, "images": []}
            for j, image in enumerate(images(shown)):
                name = f"{tag}_{letter}{j}.png"
                image.resize((96, 96)).save(assets / name)
                gallery["images"].append(
                    {"src": f"assets/{name}", "key": shown[j], "prediction": label_name(labels[shown[j]])}
                )
            galleries.append(gallery)
        found.append({"row": r, "galleries": galleries})
    page = _template().render(
        generator=str(document["generator"].get("model")),
        captioner=str(document["captioner"].get("model")),
        stand_in=bool(document["generator"].get("stand_in") or document["captioner"].get("stand_in")),
        settings=document["settings"],
        families=families,
        plot=plot,
        rows=rows,
        found=found,
        kinds=PANELS,
    )
    path = output / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def _template() -> Any:
    """The page template beside this module, rendered with autoescape: every model, caption and class name is
    escaped by Jinja2, none by hand."""
    env = html_environment(
        jinja2.PackageLoader("builder.discovery", "templates"),
        pct=_pct,
        g2=lambda value: "" if value is None else format(value, ".2g"),
    )
    return env.get_template("report.html.jinja")
