"""The HTML report of a failure discovery: a plot of failure rates against base, the tested descriptions, galleries.

Self-contained HTML with images beside it in ``assets/`` (no script, no remote resource), rendered from
``templates/report.html.jinja`` with Jinja2's autoescape, so every text that comes from a model, a caption or a class
name is HTML-escaped; plot text is never parsed as mathtext.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

GALLERY_IMAGES = 6


def _safe_name(text: str, limit: int = 60) -> str:
    """A bounded file-name fragment (class names can be long or hostile)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text)[:limit] or "x"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def rates_figure(rows: list[dict[str, Any]]):
    """The figure of ``plot_rates``: failure rate of each tested description (with its interval) against its class's
    base rate, sized so that no label is cut off (the width grows with the longest row label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        fig, ax = plt.subplots(figsize=(7, 0.45 * max(len(rows), 2) + 1.2))
        for i, row in enumerate(rows):
            low, high = row["interval"]
            colour = "tab:red" if row["discovered"] else "tab:gray"
            ax.errorbar(row["rate"], i, xerr=[[row["rate"] - low], [high - row["rate"]]], fmt="o", color=colour)
            blow, bhigh = row["base_interval"]
            ax.plot([blow, bhigh], [i, i], color="tab:blue", alpha=0.35, linewidth=6)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{r['model'][:24]} | {r['class_name'][:24]} | {r['description'][:30]}" for r in rows])
        ax.set_xlim(0, 1)
        ax.set_xlabel("failure rate (dot: description, 95% CI; band: class base rate, 95% CI)")
        ax.invert_yaxis()
        fit_labels(fig)
    return fig


def fit_labels(fig: Any, axes_width_in: float = 4.5, pad_in: float = 0.15) -> None:
    """Widen ``fig`` so that its longest tick label and its axis labels fit, then lay it out.

    ``tight_layout`` alone only shrinks the axes inside a fixed figure: with long row labels it gives up (a warning)
    and the labels run off the left edge. Here the figure's width is the widest text plus a fixed plot width.
    """
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    dpi = fig.dpi
    label_width = 0.0
    for ax in fig.axes:
        texts = [*ax.get_yticklabels(), ax.yaxis.label]
        widths = [t.get_window_extent(renderer).width / dpi for t in texts if t.get_text()]
        label_width += max(widths, default=0.0)
    xlabel_width = max(
        (ax.xaxis.label.get_window_extent(renderer).width / dpi for ax in fig.axes if ax.get_xlabel()), default=0.0
    )
    width = max(label_width + axes_width_in * len(fig.axes) + 4 * pad_in, xlabel_width + label_width + 4 * pad_in)
    fig.set_size_inches(width, fig.get_size_inches()[1])
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
    for model, result in document["models"].items():
        for entry in result["classes"]:
            for cluster in entry["clusters"]:
                test = cluster.get("test")
                if not test:
                    continue
                rows.append({
                    "model": model, "class_name": entry["class_name"], "description": cluster["description"],
                    "rate": test["rate"], "interval": test["interval"], "base_rate": test["base_rate"],
                    "base_interval": entry["base"]["interval"], "p": test["p_value"], "q": test.get("q_value"),
                    "n": test["n"], "discovered": bool(cluster.get("discovered")),
                    "refined": cluster.get("refined_description"), "keys": test["keys"], "label": entry["label"],
                    "base_keys": cluster["members"], "predicted_label": cluster["predicted_label"],
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
            ("base images that failed", "b", r["base_keys"]),
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
        found.append({"row": r, "predicted_name": label_name(r["predicted_label"]), "galleries": galleries})
    page = _template().render(
        generator=str(document["generator"].get("model")),
        captioner=str(document["captioner"].get("model")),
        stand_in=bool(document["generator"].get("stand_in") or document["captioner"].get("stand_in")),
        settings=document["settings"],
        plot=plot,
        rows=rows,
        found=found,
    )
    path = output / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def _template() -> Any:
    """The page template beside this module, rendered with autoescape: every model, caption and class name is
    escaped by Jinja2, none by hand."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("builder.discovery", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["pct"] = _pct
    return env.get_template("report.html.jinja")
