"""Evaluation metrics chosen by name: the contract each metric declares, the registry, and the loop that runs them.

A metric is a class with these declarations (docs/architecture.md, recipe "A metric")::

    class MyMetric(Metric):
        name = "my_metric"
        version = "1"  # bump when the same predictions give different numbers; recorded in results.json
        description = "One paragraph for docs/evaluation.md and cards."
        needs = ("config", "label", "correct1")  # prediction columns read (PREDICTION_COLUMNS)
        produces = ("metrics.*.my_value",)  # results keys written; '*' is any one key (a config, an edit type, a class)
        default = True  # computed by ``lance-cf eval`` without ``--metrics``

        def applies(self, context) -> bool: ...  # optional: False skips it (e.g. no ``original`` config to pair with)
        def compute(self, context) -> dict: ...  # a fragment of the results JSON, merged into it

plus one line in :data:`METRICS`. Metrics run in registration order; each returns a fragment that is merged into the
results (two metrics may write the same key only with the same value, e.g. a pair count), and every key a fragment
holds must be covered by the metric's ``produces`` (:class:`MetricContractError` otherwise: a bug, not data).

This module imports only the standard library and :mod:`lance_pipeline.registry`, so ``lance-cf eval --help`` and
``--metrics`` checking stay light; the built-in metrics live in :mod:`evaluation.metrics` (LANCE's paired metrics) and
:mod:`evaluation.interfaces.shift_results` (the dataset-interfaces per-shift metric) and :mod:`evaluation.insights` (class-level
insights from the run's edit clusters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from lance_pipeline.registry import Registry
from lance_pipeline.release_kinds import kind_of_results, metric_applies_to

# What one prediction row holds (evaluation.harness.predict_release writes them; predictions.parquet keeps them).
PREDICTION_COLUMNS = {
    "config": "release config of the sample",
    "key": "sample key",
    "source_key": "key of the source image (an original and all its counterfactuals share it)",
    "label": "true class index",
    "label_name": "true class name",
    "edit_type": "LANCE edit type (null for originals and reconstructions)",
    "caption": "source caption",
    "edited_caption": "edited caption",
    "original_span": "replaced words",
    "edited_span": "replacing words",
    "p_gt": "model probability of the true class (full softmax)",
    "correct1": "true class is the top-1 prediction",
    "correct5": "true class is among the top-5 predictions",
    "top5": "top-5 predicted class indices",
    "top5_prob": "their probabilities",
    "strength": "edit strength of a strength-config sample, 1 - self_replace (null elsewhere)",
    "counterfactual_key": "key of the selected counterfactual of a strength-config sample's edit (null elsewhere)",
    "judge_class_p": "the label-kept judge's P(yes) that the sample shows its class (null where not judged)",
}

# Every results key the built-in metrics write, and the one a metric registered by a user writes, come from here.
METRICS = Registry(
    "metric",
    {
        "accuracy": "evaluation.metrics:Accuracy",
        "accuracy_drop": "evaluation.metrics:AccuracyDrop",
        "paired_accuracy_drop": "evaluation.metrics:PairedAccuracyDrop",
        "true_class_confidence_drop": "evaluation.metrics:TrueClassConfidenceDrop",
        "flip_rate": "evaluation.metrics:FlipRate",
        "strength_curve": "evaluation.strength:StrengthCurve",
        "shift_accuracy_drop": "evaluation.interfaces.shift_results:ShiftAccuracyDrop",
        "insights": "evaluation.insights:EditClusterInsights",
    },
)

# Always computed: the results format requires ``metrics.<config>.n`` and ``acc1`` (evaluation.results).
REQUIRED_METRICS = ("accuracy",)


class MetricContractError(RuntimeError):
    """A metric wrote a key it did not declare, or a value another metric wrote differently: a bug in the metric."""


@dataclass
class MetricContext:
    """What every metric sees: the scored predictions of one model and the run's options.

    ``cached(key, factory)`` shares an intermediate (a config's rows, the pairs with originals, bootstrap
    replicates) between the metrics of one run, so that selecting several metrics costs what one pass did.
    """

    rows: list[dict[str, Any]]
    predictions: Any  # pandas.DataFrame of ``rows``; ``edit_type`` nulls are ``"none"``
    label_names: list[str]
    configs: list[str]  # ``original`` first, then the release's order
    n_boot: int = 1000
    seed: int = 0
    min_per_class: int = 5
    release_configs: list[str] | None = None  # every config the release declares (scored or not); default: configs
    edit_clusters: dict[str, Any] | None = None  # the release's edit clusters (insights), None when not computed
    manifest: dict[str, Any] | None = None  # the release's manifest (e.g. which of its configs are shifts)
    insight_top: int = 3
    release_kind: str | None = None  # lance_pipeline.release_kinds: which metrics apply (None: no restriction)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.release_configs is None:
            self.release_configs = list(self.configs)

    def cached(self, key: Any, factory: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = factory()
        return self._cache[key]

    def label_name(self, label: int) -> str:
        return self.label_names[label] if 0 <= label < len(self.label_names) else str(label)


class Metric:
    """Base of a registered metric: the declarations (see the module docstring) and the default ``applies``."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    description: ClassVar[str]
    needs: ClassVar[tuple[str, ...]] = ()
    produces: ClassVar[tuple[str, ...]] = ()
    default: ClassVar[bool] = True
    summary: ClassVar[str | None] = None  # optional short form of ``produces`` for the docs table
    # Columns this metric adds to the leaderboard (its tables, the card's table, the published rows and the model's
    # report): column name -> the results key it shows, ``{config}`` standing for the headline config (the release
    # kind's main config, e.g. ``counterfactual``; in the published per-config rows, each row's config).
    leaderboard: ClassVar[dict[str, str]] = {}

    def applies(self, context: MetricContext) -> bool:
        return True

    def compute(self, context: MetricContext) -> dict[str, Any]:
        raise NotImplementedError


def create_metric(name: str) -> Metric:
    """An instance of the metric registered as ``name`` (unknown name: one line with "did you mean")."""
    cls = METRICS.resolve(name)
    check_declarations(cls, name)
    return cls()


def check_declarations(cls: Any, name: str) -> None:
    """Refuse a metric class whose declarations are missing or malformed, naming the metric and the declaration."""
    for attr in ("name", "version", "description"):
        if not isinstance(getattr(cls, attr, None), str) or not getattr(cls, attr):
            raise MetricContractError(f"metric {name!r}: declare a non-empty string {attr!r}")
    if cls.name != name:
        raise MetricContractError(f"metric registered as {name!r} declares name {cls.name!r}; they must agree")
    unknown = [c for c in cls.needs if c not in PREDICTION_COLUMNS]
    if unknown:
        raise MetricContractError(
            f"metric {name!r} needs unknown prediction column(s) {unknown} (columns: {', '.join(PREDICTION_COLUMNS)})"
        )
    if not cls.produces or not all(isinstance(p, str) and p for p in cls.produces):
        raise MetricContractError(f"metric {name!r}: declare 'produces', the results keys it writes")
    for column, key in (getattr(cls, "leaderboard", None) or {}).items():
        covered = not undeclared_keys(_fragment_at(key.format(config="x")), tuple(cls.produces))
        if not (isinstance(column, str) and column.isidentifier()) or not covered:
            raise MetricContractError(
                f"metric {name!r}: leaderboard column {column!r} must be a name showing a results key the metric "
                f"produces, got {key!r}"
            )


def _fragment_at(path: str) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` for ``"a.b"``: a results fragment holding one key, for checking it against ``produces``."""
    fragment: Any = 1
    for part in reversed(path.split(".")):
        fragment = {part: fragment}
    return fragment


def headline_config(results: dict[str, Any]) -> str | None:
    """The config a leaderboard row of ``results`` is about: the release kind's main config when scored, else the
    first scored config."""
    configs = list(results.get("metrics") or {})
    return kind_of_results(results).main_config_of(configs)


def results_value(results: dict[str, Any], path: str) -> Any:
    """The value at a dotted results key, or None where the results do not have it."""
    node: Any = results
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if isinstance(node, (dict, list)) else node


def metric_columns(results: dict[str, Any], config: str | None = None) -> list[dict[str, Any]]:
    """The leaderboard columns of the registered metrics these results computed (``computed_metrics``): one entry per
    column, ``{"metric", "version", "column", "value"}``, ``{config}`` read as ``config`` (default: the headline
    config). Metrics this installation does not have registered are left out."""
    config = config if config is not None else headline_config(results)
    out = []
    for name, version in (results.get("computed_metrics") or {}).items():
        if name not in METRICS:
            continue
        for column, key in (getattr(METRICS.resolve(name), "leaderboard", None) or {}).items():
            value = results_value(results, key.format(config=config)) if config is not None else None
            out.append({"metric": name, "version": version, "column": column, "value": value})
    return out


def default_metric_names() -> list[str]:
    """Registered metrics computed without ``--metrics``, in run order."""
    return [n for n in METRICS.in_order() if n in REQUIRED_METRICS or METRICS.resolve(n).default]


# In a selection, this word stands for every default metric (``--metrics default,my_metric``).
DEFAULT_SELECTION = "default"


def select_metrics(names: list[str] | None) -> list[str]:
    """The metrics to compute, in run (registration) order: ``names`` plus the required ones, or the defaults.

    ``"default"`` among ``names`` stands for every default metric.

    Raises:
        ValueError: an unknown name (one line, with "did you mean").
    """
    if names is None:
        return default_metric_names()
    wanted = set(REQUIRED_METRICS)
    for name in names:
        if name == DEFAULT_SELECTION:
            wanted |= set(default_metric_names())
        else:
            METRICS.target(name)
            wanted.add(name)
    return [n for n in METRICS.in_order() if n in wanted]


def parse_metric_names(text: str) -> list[str]:
    """``--metrics a,b``: the names, each checked against the registry (one-line error with "did you mean")."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(
            f"--metrics {text!r} names no metric; give a comma-separated list of {', '.join(METRICS.in_order())} "
            f"(or {DEFAULT_SELECTION!r} for every default one)"
        )
    for name in names:
        if name == DEFAULT_SELECTION:
            continue
        try:
            METRICS.target(name)
        except ValueError as error:
            raise ValueError(f"--metrics: {error}; {DEFAULT_SELECTION!r} selects every default metric") from None
    return names


def metric_versions(names: list[str]) -> dict[str, str]:
    return {name: METRICS.resolve(name).version for name in names}


_COVERED = object()  # a trie node where a declared pattern ends: everything below it is declared


def _pattern_trie(patterns: tuple[str, ...]) -> dict[str, Any]:
    trie: dict[str, Any] = {}
    for pattern in patterns:
        node = trie
        parts = pattern.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if child is _COVERED:
                break
            node = child
        else:
            node[parts[-1]] = _COVERED
    return trie


def undeclared_keys(fragment: Any, patterns: tuple[str, ...]) -> list[str]:
    """Results keys of ``fragment`` that no declared pattern covers (a pattern covers a key and all below it; ``*``
    stands for any one key). One walk of the fragment, so that a breakdown by 1,000 classes costs little."""
    out: list[str] = []

    def walk(value: Any, nodes: list[dict[str, Any]], prefix: str) -> None:
        if not isinstance(value, dict) or not value:
            out.append(prefix)
            return
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            matches = [n[k] for n in nodes for k in (str(key), "*") if k in n]
            if any(m is _COVERED for m in matches):
                continue
            if not matches:
                out.append(path)
                continue
            walk(item, matches, path)

    walk(fragment, [_pattern_trie(patterns)], "")
    return out


def merge_fragment(results: dict[str, Any], fragment: dict[str, Any], metric: str, path: str = "") -> None:
    """Merge a metric's fragment into ``results``; the same key written twice must hold the same value."""
    for key, value in fragment.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in results:
            results[key] = value
        elif isinstance(results[key], dict) and isinstance(value, dict):
            merge_fragment(results[key], value, metric, where)
        elif results[key] != value:
            raise MetricContractError(
                f"metric {metric!r} writes '{where}' = {value!r:.60}, already {results[key]!r:.60}"
            )


def metric_applies(metric: Metric, context: MetricContext) -> bool:
    """Whether ``metric`` runs on this context: the release's kind must allow it (a metric some kinds list as theirs
    applies to those kinds only, ``lance_pipeline.release_kinds``), and then its own ``applies`` decides."""
    return metric_applies_to(metric.name, context.release_kind) and metric.applies(context)


def run_metrics(context: MetricContext, names: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Run the metrics ``names`` in order on ``context``.

    Returns:
        The merged results fragment and ``{name: version}`` of the metrics that applied (recorded in results.json as
        ``computed_metrics``).
    """
    # Only a metric that applies needs its columns (a strength metric on a release without a strength config).
    metrics = [metric for metric in map(create_metric, names) if metric_applies(metric, context)]
    columns = set(getattr(context.predictions, "columns", ()))
    for metric in metrics:
        missing = [c for c in metric.needs if c not in columns]
        if missing:
            raise ValueError(f"metric {metric.name!r} needs prediction column(s) {missing}, which these rows lack")
    results: dict[str, Any] = {}
    computed: dict[str, str] = {}
    for metric in metrics:
        fragment = metric.compute(context)
        stray = undeclared_keys(fragment, metric.produces)
        if stray:
            raise MetricContractError(
                f"metric {metric.name!r} wrote undeclared results key(s) {stray[:5]}; add them to its 'produces'"
            )
        merge_fragment(results, fragment, metric.name)
        computed[metric.name] = metric.version
    return results, computed


def metrics_markdown() -> str:
    """The table of registered metrics for docs/evaluation.md (tests/test_metric_registry.py keeps the two equal)."""
    lines = ["| Metric | Default | Version | Writes | What it is |", "|---|---|---|---|---|"]
    for name in METRICS.in_order():
        cls = METRICS.resolve(name)
        default = "always" if name in REQUIRED_METRICS else ("yes" if cls.default else "no")
        writes = cls.summary or ", ".join(f"`{p}`" for p in _summarise(cls.produces))
        lines.append(f"| `{name}` | {default} | {cls.version} | {writes} | {' '.join(cls.description.split())} |")
    return "\n".join(lines) + "\n"


def _summarise(patterns: tuple[str, ...]) -> list[str]:
    """Declared keys grouped by their parent for the docs table: ``metrics.*.{acc1, acc5}``."""
    groups: dict[str, list[str]] = {}
    for pattern in patterns:
        parent, _, leaf = pattern.rpartition(".")
        groups.setdefault(parent, []).append(leaf)
    out = []
    for parent, leaves in groups.items():
        inner = leaves[0] if len(leaves) == 1 else "{" + ", ".join(leaves) + "}"
        out.append(f"{parent}.{inner}" if parent else inner)
    return out
