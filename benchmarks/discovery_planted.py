"""Failure discovery on planted failures over many seeds, at the default settings: what it finds, and how often.

Runs ``lance-cf discover``'s method (``builder.discovery.run.Discovery``) with the deterministic stand-ins of
``lance_pipeline/tiny/discovery_components.py`` (a palette "generator", a colour "captioner", a timm-registered
classifier with planted failure rules; none is a real model) on two classes, tench and goldfish, for every demo
scenario and every seed, and prints per scenario: how often the planted description was found (and by which test), every
other discovery (a false one unless the scenario's rule makes it true), and the p- and q-values of the planted
hypothesis. Statistics, not speed: the numbers do not depend on the machine.

    .venv/bin/python benchmarks/discovery_planted.py [--seeds 20] [--scenarios planted-red,partial-red,...]
    .venv/bin/python benchmarks/discovery_planted.py --power   # only the base-size power table (binomial draws)

Last line: ``planted_found=A/B false_discoveries_null=C/D`` (over every scenario with a planted colour, and over the
null scenario's seeds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builder.discovery.run import Discovery  # noqa: E402
from lance_pipeline.discovery.search import ClassTarget, DiscoverySettings, discovered  # noqa: E402
from lance_pipeline.tiny.discovery_components import DEMO_SCENARIOS, parse_failure_rules  # noqa: E402

CLASSES = [ClassTarget(0, "tench", "fish", "tench"), ClassTarget(1, "goldfish", "fish", "goldfish")]


def planted_colour(scenario) -> str | None:
    """The colour whose rule differs from the others (None for the null model)."""
    rules = parse_failure_rules(scenario.failures)
    named = [rule.colour for rule in rules.values() if rule.colour != "*"]
    return named[0] if named else None


def power_table(reps: int = 200, level: float = 0.0025) -> None:
    """How often a one-sided Fisher test gives p < ``level`` for a rate moving from 4% at base to 20% under a
    description (the target-shift scenario), by base and test size: binomial draws, seeded. ``level`` is about the
    Benjamini-Hochberg threshold of one true hypothesis among 20 tests at 0.05."""
    import numpy as np
    from scipy.stats import fisher_exact

    rng = np.random.default_rng(0)
    for n_base, n_test in ((100, 100), (200, 100), (200, 200)):
        hits = 0
        for _ in range(reps):
            b, t = rng.binomial(n_base, 0.04), rng.binomial(n_test, 0.2)
            hits += fisher_exact([[t, n_test - t], [b, n_base - b]], alternative="greater")[1] < level
        print(f"power n_base={n_base} n_test={n_test}: {hits / reps:.2f} (p < {level}, {reps} draws)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--scenarios", default=",".join(DEMO_SCENARIOS))
    parser.add_argument("--power", action="store_true", help="only the base-size power table")
    args = parser.parse_args()
    if args.power:
        power_table()
        return
    found_total = planted_total = null_false = null_runs = 0
    for name in args.scenarios.split(","):
        scenario = DEMO_SCENARIOS[name]
        colour = planted_colour(scenario)
        found, by, other, p_target, q_target, q_total = 0, {}, [], [], [], []
        for seed in range(args.seeds):
            components = scenario([c.name for c in CLASSES], [c.label for c in CLASSES])
            with tempfile.TemporaryDirectory() as tmp:
                run = Discovery(Path(tmp), CLASSES, components, DiscoverySettings(seed=seed))
                try:
                    document = run.run()
                finally:
                    run.close()
            rows = discovered(document)
            for entry in document["models"]["planted_colour_classifier"]["classes"]:
                for h in entry["hypotheses"]:
                    if colour and colour in h["description"].split():
                        p_target.append(h["tests"]["target_label"]["p_value"])
                        q_target.append(h["tests"]["target_label"]["q_value"])
                        q_total.append(h["tests"]["total"]["q_value"])
            for row in rows:
                if colour and colour in row["description"].split():
                    found += 1
                    key = "+".join(row["discovered_by"])
                    by[key] = by.get(key, 0) + 1
                else:
                    other.append((seed, row["class_name"], row["description"], "+".join(row["discovered_by"])))
            if colour is None:
                null_runs += 1
                null_false += len(rows)
        runs = args.seeds * len(CLASSES)
        print(f"{name} ({scenario.failures}): planted found {found}/{runs} (class x seed) by {by}")
        if p_target:
            print(f"  planted hypothesis: median p(target) {statistics.median(p_target):.2g}, median q(target) "
                  f"{statistics.median(q_target):.2g}, median q(total) {statistics.median(q_total):.2g}; tested in "
                  f"{len(p_target)}/{runs}")  # fmt: skip
        print(f"  other discoveries: {len(other)} {other[:8]}")
        if colour:
            found_total += found
            planted_total += runs
    print(f"planted_found={found_total}/{planted_total} false_discoveries_null={null_false}/{null_runs}")


if __name__ == "__main__":
    main()
