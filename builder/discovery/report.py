"""The HTML report of a failure discovery: a plot of failure rates against base, the tested descriptions, galleries.

Self-contained HTML with images beside it in ``assets/`` (no script, no remote resource); every text that comes from a
model, a caption or a class name is HTML-escaped, and plot text is never parsed as mathtext.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

GALLERY_IMAGES = 6


def _safe_name(text: str, limit: int = 60) -> str:
    """A bounded file-name fragment (class names can be long or hostile)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text)[:limit] or "x"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def plot_rates(rows: list[dict[str, Any]], path: Path) -> None:
    """Failure rate of each tested description (with its interval) against its class's base rate."""
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
        fig.tight_layout()
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
    e = html.escape
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
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Failure discovery</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px} table{border-collapse:collapse}"
        " td,th{border:1px solid #ccc;padding:3px 8px} .found{background:#fde2e2} figure{display:inline-block;"
        "margin:4px;text-align:center;font-size:12px} img{image-rendering:pixelated}</style></head><body>",
        "<h1>Failure discovery</h1>",
        f"<p>Generator: <code>{e(str(document['generator'].get('model')))}</code>; captioner: "
        f"<code>{e(str(document['captioner'].get('model')))}</code>.",
    ]
    if document["generator"].get("stand_in") or document["captioner"].get("stand_in"):
        parts.append(
            " <strong>This run used deterministic stand-ins with a planted failure (the offline demo): it says "
            "nothing about any real model.</strong>"
        )
    s = document["settings"]
    parts.append(
        f"</p><p>{s['n_base']} base images per class, {s['n_test']} per description; one-sided Fisher exact test, "
        f"Benjamini-Hochberg over the descriptions of each model, level {s['alpha']}.</p>"
    )
    if rows:
        plot_rates(rows, assets / "rates.png")
        parts.append("<h2>Failure rates</h2><img src='assets/rates.png' alt='failure rates against base'>")
    parts.append(
        "<h2>Descriptions tested</h2><table><tr><th>model</th><th>class</th><th>description</th><th>refined</th>"
        "<th>n</th><th>failure rate [95% CI]</th><th>base rate</th><th>p</th><th>q</th></tr>"
    )
    for r in rows:
        low, high = r["interval"]
        parts.append(
            f"<tr class='{'found' if r['discovered'] else ''}'><td>{e(r['model'])}</td><td>{e(r['class_name'])}</td>"
            f"<td>{e(r['description'])}</td><td>{e(r['refined'] or '')}</td><td>{r['n']}</td>"
            f"<td>{_pct(r['rate'])} [{_pct(low)}, {_pct(high)}]</td><td>{_pct(r['base_rate'])}</td>"
            f"<td>{r['p']:.2g}</td><td>{'' if r['q'] is None else format(r['q'], '.2g')}</td></tr>"
        )
    parts.append("</table>")
    found = [r for r in rows if r["discovered"]]
    parts.append(f"<h2>Discovered failures ({len(found)})</h2>")
    for index, r in enumerate(found):
        tag = f"{index:03d}_{_safe_name(r['class_name'])}"
        parts.append(
            f"<h3>{e(r['model'])}: {e(r['class_name'])} + “{e(r['refined'] or r['description'])}”</h3>"
            f"<p>{_pct(r['rate'])} of {r['n']} images fail, against {_pct(r['base_rate'])} at base; most often "
            f"predicted: {e(label_name(r['predicted_label']))}.</p>"
        )
        for title, keys in (("base images that failed", r["base_keys"]), ("description images", r["keys"])):
            shown = keys[:GALLERY_IMAGES]
            labels = predicted(r["model"], shown)
            parts.append(f"<div><em>{title}</em><br>")
            for j, image in enumerate(images(shown)):
                name = f"{tag}_{'b' if title.startswith('base') else 'd'}{j}.png"
                image.resize((96, 96)).save(assets / name)
                parts.append(
                    f"<figure><img src='assets/{name}' width='96' height='96' alt='{e(shown[j])}'>"
                    f"<figcaption>{e(label_name(labels[shown[j]]))}</figcaption></figure>"
                )
            parts.append("</div>")
    parts.append("</body></html>")
    path = output / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
