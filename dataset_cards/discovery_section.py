"""The card section of a discovery release (``lance_pipeline.discovery.release_kind``): one row per discovered
failure, from what the discovery source recorded in the manifest (``source.discovery``).

Every text that comes from data (model, class, description) is escaped; rates are percentages, q-values two
significant digits. Empty for a release that recorded none (made before the source recorded them).
"""

from __future__ import annotations

from typing import Any

from dataset_cards.markdown import code_span, md_escape

TESTS = {"target_label": "target label", "total": "total"}


def _pct(value: Any) -> str:
    return f"{100 * float(value):.0f}%"


def discovery_section(manifest: dict[str, Any]) -> str:
    """``## Discovered failures``: per config, the failure, the test(s) that found it and both rates against base."""
    record = (manifest.get("source") or {}).get("discovery") or {}
    rows = record.get("discoveries") or []
    if not rows:
        return ""
    lines = [
        "## Discovered failures\n",
        f"Found by `lance-cf discover` with {md_escape(record.get('n_base'))} base images per class and "
        f"{md_escape(record.get('n_test'))} "
        "per description. Each description was tested twice against the class's base images (one-sided Fisher exact "
        "tests): the rate of its *target label* (the wrong label its failures were given most) and the total failure "
        f"rate; both tests of every description of a model form one Benjamini-Hochberg family at level "
        f"{md_escape(record.get('alpha'))}. *Refined* is the shortest word-dropped variant that is still significant against "
        "base and not significantly less often failed than the full description (one-sided Fisher exact tests, in a "
        "corrected family of their own), with its rate and q-value on the test that found the failure, and the "
        "q-value of its comparison with the full description; the full description when no variant is.",
        "",
        "| config | model | class | description | refined | found by | target label: rate (base), q | "
        "all wrong labels: rate (base), q | images |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = list((manifest.get("label_space") or {}).get("names") or [])

    def label(value: Any) -> str:
        index = int(value)
        return f"{md_escape(names[index])} ({index})" if 0 <= index < len(names) else str(index)

    def refined(row: dict[str, Any]) -> str:
        text = md_escape(row["refined_description"])
        record = row.get("refined") or {}
        kinds = [k for k in ("total", "target_label") if k in (record.get("tests") or {})]
        if not kinds:  # a release recorded before refinements reported their rates
            return text
        test = record["tests"][kinds[0]]
        figures = f"{TESTS[kinds[0]]} {_pct(test['rate'])}, q {float(test['q_value']):.2g}"
        versus = (record.get("versus_full") or {}).get(kinds[0])
        if versus is not None:
            figures += f"; vs full q {float(versus['q_value']):.2g}"
        return f"{text} ({figures})"

    for row in rows:
        found_by = " and ".join(TESTS.get(k, md_escape(k)) for k in row.get("discovered_by") or [])
        lines.append(
            f"| {code_span(row['config'])} | {md_escape(row['model'])} | {md_escape(row['class_name'])} | "
            f"{md_escape(row['description'])} | {refined(row)} | {found_by} | "
            f"{label(row['target_label'])}: {_pct(row['target_rate'])} ({_pct(row['target_base_rate'])}), "
            f"{float(row['target_q_value']):.2g} | {_pct(row['rate'])} ({_pct(row['base_rate'])}), "
            f"{float(row['q_value']):.2g} | {int(row['n'])} |"
        )
    return "\n".join(lines) + "\n"
