"""Refinement on planted failures that need one, two and three attributes together, over many seeds.

Runs ``lance-cf discover``'s method (``builder.discovery.run.Discovery``) at the default settings with the
deterministic stand-ins of ``lance_pipeline/tiny/discovery_components.py`` painting two attributes besides the colour
(column stripes, row ripples; each drawn per image) and a classifier that fails on 80% of the images showing
``red`` (one attribute), ``red`` + ``striped`` (two) or ``red`` + ``striped`` + ``rippled`` (three). The merge keeps up
to four words, so descriptions carry words the failure does not need (the scene's ``pond``, the other attribute).
For every discovered description that holds every needed word it counts: the refined description keeps every needed
word, and it is exactly the needed words (every other word dropped). Statistics, not speed.

    .venv/bin/python benchmarks/discovery_refinement.py [--seeds 10] [--classes 1]

Last line: ``kept_needed=A/B exactly_needed=C/B`` over every scenario, seed and discovered description.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builder.discovery.run import Discovery  # noqa: E402
from lance_pipeline.discovery.descriptions import merge_captions  # noqa: E402
from lance_pipeline.discovery.search import ClassTarget, DiscoverySettings, discovered  # noqa: E402
from lance_pipeline.tiny.discovery_components import DEMO_SCENARIOS, DemoScenario  # noqa: E402

CLASSES = [ClassTarget(0, "tench", "fish", "tench"), ClassTarget(1, "goldfish", "fish", "goldfish")]
SCENARIOS = {
    ("red",): DemoScenario("red-among-attributes", "red=0.8>+1", "", attributes=("pattern", "ripple")),
    ("red", "striped"): DEMO_SCENARIOS["red-and-striped"],
    ("red", "striped", "rippled"): DEMO_SCENARIOS["red-striped-rippled"],
}


class FourWordMerge:
    """The keyword merge keeping up to four words, so that a three-word failure's description has a word to drop."""

    def describe(self):
        return {"kind": "keyword_frequency", "max_words": 4, "min_document_fraction": 0.5}

    def merge(self, captions, class_name, superclass=None):
        return merge_captions(captions, class_name, superclass, max_words=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--classes", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()
    classes = CLASSES[: args.classes]
    kept_total = exact_total = rows_total = 0
    for needed, scenario in SCENARIOS.items():
        kept = exact = total = missed = 0
        wrong = []
        for seed in range(args.seeds):
            components = scenario([c.name for c in classes], [c.label for c in classes])
            components.merger = FourWordMerge()
            with tempfile.TemporaryDirectory() as tmp:
                run = Discovery(Path(tmp), classes, components, DiscoverySettings(seed=seed))
                try:
                    document = run.run()
                finally:
                    run.close()
            rows = [r for r in discovered(document) if set(needed) <= set(r["description"].split())]
            missed += len({r["class_name"] for r in rows}) < len(classes)
            for row in rows:
                words = row["refined_description"].split()
                total += 1
                kept += set(needed) <= set(words)
                exact += sorted(words) == sorted(needed)
                if sorted(words) != sorted(needed):
                    wrong.append((seed, row["class_name"], row["description"], row["refined_description"]))
        print(f"{'+'.join(needed)} ({scenario.failures}): {total} discovered descriptions with every needed word; "
              f"refined keeps them {kept}/{total}, exactly them {exact}/{total}; runs without such a discovery "
              f"{missed}/{args.seeds}; not exact: {wrong[:6]}")  # fmt: skip
        kept_total, exact_total, rows_total = kept_total + kept, exact_total + exact, rows_total + total
    print(f"kept_needed={kept_total}/{rows_total} exactly_needed={exact_total}/{rows_total}")


if __name__ == "__main__":
    main()
