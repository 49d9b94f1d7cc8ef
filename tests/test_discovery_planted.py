"""Failure discovery on planted failures, at the DEFAULT settings (``DiscoverySettings()``: 200 base images per
class, 100 per description, level 0.05, the default clustering), with deterministic stand-ins
(``lance_pipeline/tiny/discovery_components.py``): a generator that paints the colour a prompt names, a captioner
that names the colour ("a red photo of a tench in a pond"), and a timm-registered classifier with planted failure
rules. Every count, p-value and q-value is recomputed here from the ledger's predictions, independently of the code.

Cases: a partial failure (half the red images), a target-label shift (tench errors at 20% on every colour, but to
class 2 instead of class 1 on green ones), scattered wrong labels (blue images misclassified as any of 11 labels),
null models over several seeds, and one description from several clusters being one hypothesis.
"""

from __future__ import annotations

import math

import pytest

from builder.discovery.run import Discovery
from lance_pipeline.discovery.descriptions import merge_captions
from lance_pipeline.discovery.search import ClassTarget, DiscoverySettings, derive_seed, description_key, discovered
from lance_pipeline.tiny.discovery_components import (
    DEMO_SCENARIOS,
    DemoScenario,
    PaletteGenerator,
    create_demo_components,
)

# Every test here runs a whole discovery (hundreds of generated images scored and captioned by tiny models).
pytestmark = pytest.mark.slow

CLASSES = [ClassTarget(0, "tench", "fish", "tench"), ClassTarget(1, "goldfish", "fish", "goldfish")]
MODEL = "planted_colour_classifier"
N_BASE, N_TEST = DiscoverySettings().n_base, DiscoverySettings().n_test  # the defaults (200, 100)


def _run(tmp_path, scenario: DemoScenario, seed: int = 0, embedder=None):
    """One discovery at the default settings; returns (document, predictions by key)."""
    components = create_demo_components(scenario, [c.name for c in CLASSES], [c.label for c in CLASSES])
    if embedder is not None:
        components.embedder = embedder
    run = Discovery(tmp_path / f"{scenario.name}-{seed}", CLASSES, components, DiscoverySettings(seed=seed))
    try:
        document = run.run()
        keys = [k for entry in document["models"][MODEL]["classes"] for h in entry["hypotheses"] for k in h["keys"]]
        keys += [f"{c.key}_base_{i:03d}" for c in CLASSES for i in range(N_BASE)]
        for entry in document["models"][MODEL]["classes"]:
            for h in entry["hypotheses"]:
                keys += [k for v in h.get("refinement", []) for k in _variant_keys(entry, v["description"])]
        predictions = run.ledger.predictions(MODEL, keys)
    finally:
        run.close()
    return document, predictions


def _variant_keys(entry, description):
    return [f"{entry['class_name']}_d{description_key(description)}_{i:03d}" for i in range(N_TEST)]


def _fisher_greater(k1, n1, k0, n0) -> float:
    """One-sided Fisher p-value from the hypergeometric tail, by binomial coefficients."""
    total, column = n1 + n0, k1 + k0
    upper = min(n1, column)
    return sum(math.comb(n1, x) * math.comb(n0, column - x) for x in range(k1, upper + 1)) / math.comb(total, column)


def _bh(p_values):
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    q = [0.0] * m
    running = 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, p_values[i] * m / rank)
        q[i] = running
    return q


def _check_statistics(document, predictions):
    """Every test's counts, p-value and q-value, recomputed from the predictions; returns the family's q-values."""
    result = document["models"][MODEL]
    family = []
    for entry in result["classes"]:
        label = entry["label"]
        base = [predictions[f"{entry['class_name']}_base_{i:03d}"] for i in range(N_BASE)]
        assert entry["base"]["failures"] == sum(p != label for p in base)
        for h in entry["hypotheses"]:
            described = [predictions[k] for k in h["keys"]]
            assert len(described) == N_TEST and len(set(h["keys"])) == N_TEST
            # the target label: the most frequent prediction among the failures the hypothesis pools
            pooled = [predictions[k] for k in h["members"]]
            assert all(p != label for p in pooled)
            assert h["target_label"] == min(set(pooled), key=lambda t: (-pooled.count(t), t))
            events = {"target_label": lambda ps, t=h["target_label"]: sum(p == t for p in ps),
                      "total": lambda ps, t=label: sum(p != t for p in ps)}  # fmt: skip
            for kind, count in events.items():
                test = h["tests"][kind]
                assert (test["count"], test["base_count"]) == (count(described), count(base))
                assert test["p_value"] == pytest.approx(
                    _fisher_greater(count(described), N_TEST, count(base), N_BASE), rel=1e-9
                )
                family.append(test)
    assert result["families"]["descriptions"]["tests"] == len(family)
    for test, q in zip(family, _bh([t["p_value"] for t in family]), strict=True):
        assert test["q_value"] == pytest.approx(q, rel=1e-9)
    for entry in result["classes"]:
        for h in entry["hypotheses"]:
            expected = [k for k in ("target_label", "total") if h["tests"][k]["q_value"] < 0.05
                        and h["tests"][k]["rate"] > h["tests"][k]["base_rate"]]  # fmt: skip
            assert h["discovered_by"] == expected and h["discovered"] == bool(expected)


def _found(document):
    return {(r["class_name"], r["description"]): r for r in discovered(document)}


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("partial"), DEMO_SCENARIOS["partial-red"])


def test_a_partial_failure_is_found_by_both_tests_and_refined_to_its_word(partial):
    """Half of the red images fail (5% of the others): 'red pond' found for both classes, refined to 'red'."""
    document, predictions = partial
    _check_statistics(document, predictions)
    found = _found(document)
    assert set(found) == {("tench", "red pond"), ("goldfish", "red pond")}
    for row in found.values():
        assert row["discovered_by"] == ["target_label", "total"]
        assert 0.35 <= row["rate"] <= 0.65 and row["base_rate"] < 0.25  # partial: about half, not all
        assert row["q_value"] < 1e-3 and row["target_q_value"] < 1e-3
    # 'red' is all the failure needs, and at seed 0 the goldfish description is refined to it. For tench, the 100 'red'
    # images happened to fail 42 times against the full description's 57 (both about half by the planted rule):
    # one-sided Fisher p = 0.024, below the refinement family's BH cutoff, so 'red' counts as failing less and the
    # full description stays. The rule errs that way: it keeps a word it cannot show is unneeded.
    assert found["goldfish", "red pond"]["refined_description"] == "red"
    tench = found["tench", "red pond"]
    assert tench["refined_description"] == "red pond" and tench["refined"]["shortened"] is False
    assert tench["refined"]["tests"]["total"]["rate"] == tench["rate"]


def test_refinements_are_their_own_corrected_family(partial):
    """Every variant of every discovery is tested on the test(s) that found it, against base and against the full
    description (is its rate lower?); BH over those alone."""
    document, predictions = partial
    result = document["models"][MODEL]
    family = []
    for entry in result["classes"]:
        base = [predictions[f"{entry['class_name']}_base_{i:03d}"] for i in range(N_BASE)]
        for h in entry["hypotheses"]:
            if not h["discovered"]:
                assert "refinement" not in h
                continue
            assert [v["description"] for v in h["refinement"]] == ["red", "pond"]
            full = [predictions[k] for k in h["keys"]]
            for variant in h["refinement"]:
                assert set(variant["tests"]) == set(variant["versus_full"]) == set(h["discovered_by"])
                described = [predictions[k] for k in _variant_keys(entry, variant["description"])]
                test = variant["tests"]["total"]
                wrong = sum(p != entry["label"] for p in described)
                assert test["count"] == wrong and test["base_count"] == sum(p != entry["label"] for p in base)
                lower = variant["versus_full"]["total"]
                full_wrong = sum(p != entry["label"] for p in full)
                assert (lower["count"], lower["full_count"]) == (wrong, full_wrong)
                # P(variant count <= observed) = P(full count >= its observed), the same one-sided Fisher p-value
                assert lower["p_value"] == pytest.approx(_fisher_greater(full_wrong, N_TEST, wrong, N_TEST), rel=1e-9)
                family += list(variant["tests"].values()) + list(variant["versus_full"].values())
            significant = {v["description"]: v["significant"] for v in h["refinement"]}
            assert significant == {"red": True, "pond": False}
            red, pond = h["refinement"]
            assert pond["lower_than_full"] and not pond["keeps_failure"]
            assert red["keeps_failure"] == (not red["lower_than_full"])
            if red["keeps_failure"]:
                assert h["refined"]["description"] == "red" and h["refined"]["shortened"] is True
                assert h["refined"]["tests"]["total"]["q_value"] == red["tests"]["total"]["q_value"]
                assert h["refined"]["versus_full"]["total"]["q_value"] == red["versus_full"]["total"]["q_value"]
            else:
                assert h["refined"]["description"] == "red pond" and h["refined"]["shortened"] is False
    # 2 classes x 2 variants x 2 tests, each against base and against the full description
    assert result["families"]["refinements"]["tests"] == len(family) == 16
    for test, q in zip(family, _bh([t["p_value"] for t in family]), strict=True):
        assert test["q_value"] == pytest.approx(q, rel=1e-9)


def test_a_target_label_shift_is_found_although_the_failure_rate_does_not_change(tmp_path):
    """Tench (and goldfish) fail 20% of the time on every colour; on green images the error goes to the class after
    next instead of the next one. The total failure rate under 'green' equals base, so only the target-label test
    can see it. (A non-green colour genuinely raises the next-class rate, from 16% at base to 20%, because it
    removes the green images; such a discovery would be true, and it must come from the target-label test.)"""
    document, predictions = _run(tmp_path, DEMO_SCENARIOS["target-shift"])
    _check_statistics(document, predictions)
    found = _found(document)
    assert {("tench", "green pond"), ("goldfish", "green pond")} <= set(found)
    for (_, description), row in found.items():
        assert row["discovered_by"] == ["target_label"]  # no total-rate discovery: the total rate never changed
        label = row["label"]
        if description == "green pond":
            assert row["target_label"] == label + 2 and row["refined_description"] == "green"
            assert row["target_base_rate"] < 0.1 < 0.12 < row["target_rate"]
        else:
            assert "green" not in description and row["target_label"] == label + 1
    entry = next(e for e in document["models"][MODEL]["classes"] if e["class_name"] == "tench")
    green = next(h for h in entry["hypotheses"] if h["description"] == "green pond")
    assert green["tests"]["total"]["q_value"] > 0.05  # the old total-rate test alone would have missed it


def test_scattered_wrong_labels_are_clustered_together_and_found(tmp_path):
    """70% of blue images fail, each to one of 11 labels picked by a hash: no label gathers enough failures to
    stand out, but the blue failures are one cluster and the total-failure test finds 'blue'."""
    document, predictions = _run(tmp_path, DEMO_SCENARIOS["scattered-blue"])
    _check_statistics(document, predictions)
    rows = discovered(document)
    assert sorted((r["class_name"], r["refined_description"]) for r in rows) == [
        ("goldfish", "blue"),
        ("tench", "blue"),
    ]
    generator = PaletteGenerator([c.name for c in CLASSES])
    for entry in document["models"][MODEL]["classes"]:
        (blue,) = [h for h in entry["hypotheses"] if "blue" in h["description"].split()]
        assert blue["discovered_by"] == ["total"] and blue["tests"]["total"]["q_value"] < 1e-6
        assert len({predictions[k] for k in blue["members"]}) >= 5  # the failures it pools scatter over many labels
        # no blue failure of the base is lost: the base images' colours, recomputed from their seeds
        base_keys = [f"{entry['class_name']}_base_{i:03d}" for i in range(N_BASE)]
        blue_failures = {
            k for k in base_keys
            if predictions[k] != entry["label"] and generator.colour_for("", derive_seed(0, k)) == "blue"
        }  # fmt: skip
        assert len(blue_failures) >= 5 and blue_failures <= set(blue["members"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_null_models_give_no_discovery(tmp_path, seed):
    """25% of every colour fails, towards the same label: whatever is tested, nothing is discovered."""
    document, predictions = _run(tmp_path, DEMO_SCENARIOS["null"], seed=seed)
    _check_statistics(document, predictions)
    assert discovered(document) == []
    assert document["models"][MODEL]["families"]["descriptions"]["tests"] >= 10  # hypotheses were tested


def test_the_same_description_from_several_clusters_is_one_hypothesis(tmp_path):
    """An embedder that splits every colour in two far-apart halves: several clusters say 'red pond', and they are
    one hypothesis (members pooled), one family entry per test, one discovery and one release config."""
    import hashlib

    import numpy as np

    from lance_pipeline.tiny.discovery_components import colour_histogram_embedder

    def split_embedder(images):
        colour = colour_histogram_embedder(images)
        half = [hashlib.sha256(np.asarray(im).tobytes()).digest()[0] % 2 for im in images]
        return np.concatenate([colour, 1000.0 * np.array(half, dtype=np.float64)[:, None]], axis=1)

    document, predictions = _run(tmp_path, DEMO_SCENARIOS["planted-red"], embedder=split_embedder)
    _check_statistics(document, predictions)
    for entry in document["models"][MODEL]["classes"]:
        descriptions = [c["description"] for c in entry["clusters"]]
        assert descriptions.count("red pond") >= 2  # several clusters said it
        hypotheses = [h["description"] for h in entry["hypotheses"]]
        assert hypotheses.count("red pond") == 1 and len(hypotheses) == len(set(hypotheses))
        red = next(h for h in entry["hypotheses"] if h["description"] == "red pond")
        pooled = sorted(k for c in entry["clusters"] if c["description"] == "red pond" for k in c["members"])
        assert red["members"] == pooled
        assert red["clusters"] == [i for i, c in enumerate(entry["clusters"]) if c["description"] == "red pond"]
    rows = discovered(document)
    assert sorted((r["class_name"], r["description"]) for r in rows) == [
        ("goldfish", "red pond"),
        ("tench", "red pond"),
    ]


class FourWordMerge:
    """The keyword merge keeping up to four words (the default keeps three), so that the description of a failure
    that needs three attributes still carries a word it does not need."""

    def describe(self):
        return {"kind": "keyword_frequency", "max_words": 4}

    def merge(self, captions, class_name, superclass=None):
        return merge_captions(captions, class_name, superclass, max_words=4)


NEEDS = {
    ("red",): DemoScenario("red-among-attributes", "red=0.8>+1", "", attributes=("pattern", "ripple")),
    ("red", "striped"): DEMO_SCENARIOS["red-and-striped"],
    ("red", "striped", "rippled"): DEMO_SCENARIOS["red-striped-rippled"],
}


def _refinement_case(tmp_path, needed, seed):
    """One discovery of the planted failure that needs ``needed``, on tench; the rows whose full description holds
    every needed word, and the class's entry."""
    target = CLASSES[0]
    components = create_demo_components(NEEDS[needed], [target.name], [target.label])
    components.merger = FourWordMerge()
    run = Discovery(tmp_path / f"run-{seed}", [target], components, DiscoverySettings(seed=seed))
    try:
        document = run.run()
    finally:
        run.close()
    rows = [r for r in discovered(document) if set(needed) <= set(r["description"].split())]
    return rows, document["models"][MODEL]["classes"][0]


@pytest.mark.parametrize("needed", list(NEEDS), ids=["one", "two", "three"])
def test_refinement_keeps_every_word_the_failure_needs_and_drops_the_others(tmp_path, needed):
    """A failure that needs one, two or three attributes together (80% of the images showing all of them fail; the
    stand-in paints stripes and ripples, each on about half the images, besides the colour), seeds 0, 1 and 2. The
    full description is found with words the failure does not need (the scene's 'pond', the other attribute); the
    refined one keeps every needed word, always, and drops the rest. With two needed words one alone is still
    significant against base at about half the pair's rate: the old rule (the shortest significant variant) dropped
    a needed word there.

    Dropping an unneeded word can fail: the variant of exactly the needed words is then held significantly lower
    than the full description by chance (a type I error of that test at the family's level; both rates are about
    80%). Such a case keeps a longer description, never a shorter one; it must be rare: at most one seed in three
    (benchmarks/discovery_refinement.py counts it over more seeds)."""
    exact = 0  # seeds whose every refinement is exactly the needed words
    for seed in (0, 1, 2):
        rows, entry = _refinement_case(tmp_path, needed, seed)
        all_exact = True
        assert rows, f"seed {seed}: the planted failure's full description was not found"
        for row in rows:
            assert len(row["description"].split()) > len(needed)  # there is something to drop
            words = row["refined_description"].split()
            assert set(needed) <= set(words), (seed, row["description"], row["refined_description"])
            refined = row["refined"]
            assert refined["description"] == row["refined_description"]
            if refined["shortened"]:
                for kind in row["discovered_by"]:
                    assert refined["tests"][kind]["q_value"] < 0.05 <= refined["versus_full"][kind]["q_value"]
            else:  # no variant kept the failure: the full description stands
                assert row["refined_description"] == row["description"]
            # a longer refinement only because the exact variant was judged lower than the full description
            if sorted(words) != sorted(needed):
                h = next(h for h in entry["hypotheses"] if h["description"] == row["description"])
                (variant,) = [v for v in h["refinement"] if sorted(v["description"].split()) == sorted(needed)]
                assert variant["significant"] and variant["lower_than_full"], (seed, row["description"])
                all_exact = False
        exact += all_exact
        for h in entry["hypotheses"]:
            for variant in h.get("refinement", []):
                if set(needed) - set(variant["description"].split()):
                    # without a needed word the rate falls: refused, whether or not it is still above base
                    assert variant["lower_than_full"] and not variant["keeps_failure"], (seed, variant["description"])
        if len(needed) == 2:  # the case the old rule got wrong: one needed word alone is significant against base
            h = next(h for h in entry["hypotheses"] if h["discovered"] and set(needed) <= set(h["description"].split()))
            red = next(v for v in h["refinement"] if v["description"] == "red")
            assert red["significant"] and red["lower_than_full"]
            assert 0.25 < red["tests"]["total"]["rate"] < 0.55 < 0.65 < h["tests"]["total"]["rate"]
    assert exact >= 2, f"the needed words alone in only {exact} of the seeds' refinements"
