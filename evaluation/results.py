"""The results JSON of ``lance-cf eval``: its schema tag, its one validation, and what it says about a run.

This module is the owner of the results format (docs/evaluation.md, "results.json schema"); the leaderboard, the card
and ``publish-results`` read results through it. It imports nothing heavy, so publishing and card rendering can use it
without torch.
"""

from __future__ import annotations

import math
from typing import Any

from evaluation.judge_kept import SECTION as JUDGE_KEPT_SECTION
from evaluation.judge_kept import validate_judge_kept
from lance_pipeline.release_kinds import kind_of_results, list_kinds, resolve_target

RESULTS_SCHEMA = "lance-cf/eval-results"
RESULTS_SCHEMA_VERSION = 3
"""2: ``tool``, ``options`` (every option that changes results), ``limit``, ``run.key``, ``failures``, release source
without machine paths. 3: ``computed_metrics`` (``{name: version}`` of the registered metrics that were computed,
:mod:`evaluation.metric_registry`) in a successful run, and ``metrics_left_out`` (default metrics that apply but a
``--metrics`` selection left out; absent when none). Versions 1 and 2 are still read."""

READABLE_SCHEMA_VERSIONS = (1, 2, 3)
# What the numbers of the metric sections may be (every value of these keys, wherever it sits in ``metrics``,
# ``sensitivity``, ``sensitivity_by_config``, ``insights``): percentages, signed differences of percentages (points),
# and counts. Keys of a registered metric not listed here are checked for finiteness only.
PERCENT_KEYS = frozenset(
    {"acc1", "acc5", "orig_acc1", "orig_acc5", "flip_rate", "delta_p_gt_abs_mean", "accuracy", "base_accuracy"}
)
POINTS_KEYS = frozenset(
    {"delta_acc1", "delta_acc5", "paired_delta_acc1", "paired_delta_acc5", "delta_p_gt_mean", "delta_p_gt", "drop"}
)
COUNT_KEYS = frozenset({"n", "n_paired", "n_unpaired", "flips", "n_flip_base", "size", "classes", "min_per_class"})
# the sections every results JSON may hold, then each release kind's own (``ReleaseKind.results_sections``)
METRIC_SECTIONS = (
    "metrics",
    "sensitivity",
    "sensitivity_by_config",
    "insights",
    JUDGE_KEPT_SECTION,  # every metric again on the judge-kept samples (evaluation.judge_kept)
    *(section for kind in list_kinds() for section in kind.results_sections),
)
MAX_COUNT = 10**9  # samples of one release: far above any release this tool builds, far below a typo's 10^12
MAX_TEXT = 1000  # characters of any text in a results JSON (a label name, a model name) but an error message
AMP_DTYPES = ("bfloat16", "float16")  # --amp-dtype
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # --model-dtype
STATUSES = ("ok", "error")


def is_results(obj: Any) -> bool:
    """True when ``obj`` claims to be an evaluation results JSON (it carries the schema tag).

    A file that claims to be results but fails :func:`validate_results` is an error, not something to skip.
    """
    return isinstance(obj, dict) and obj.get("schema") == RESULTS_SCHEMA


def _require(obj: dict[str, Any], path: str, kind: type | tuple[type, ...]) -> Any:
    value: Any = obj
    walked = []
    for part in path.split("."):
        walked.append(part)
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"results JSON has no '{'.'.join(walked)}' (expected the output of `lance-cf eval`)")
        value = value[part]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # True is an int to Python
        names = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"results JSON field '{path}' must be {names}, got {type(value).__name__} {value!r:.60}")
    return value


def validate_results(obj: Any) -> None:
    """Check that ``obj`` is a well-formed results JSON; raise ``ValueError`` naming the first bad field.

    Checked: the schema tag and a readable schema version; ``status``; ``model.name``; ``release.name``,
    ``release.version`` and ``release.manifest_sha256``; for ``status == "ok"``: ``metrics`` with, per config, integer
    ``n`` and numeric (or null) ``acc1``; the sections of the release's kind (``results_sections`` of
    ``lance_pipeline.release_kinds``, e.g. the per-shift ``interfaces`` section of an interfaces release); a ``strength`` section
    (``validate_strength``, with the panel the leaderboard's rank stability resamples); from schema version 2 also ``tool.version``,
    ``options`` and ``limit``; from version 3, in a successful run, ``computed_metrics`` (metric name -> version) and,
    when present, ``metrics_left_out`` (a list of names). A zero-shot model's ``model.zero_shot`` carries ``templates.name``,
    ``templates.digest`` (``sha256:...``) and ``class_names.source``.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"results JSON must be an object, got {type(obj).__name__}")
    if obj.get("schema") != RESULTS_SCHEMA:
        raise ValueError(f"results JSON has schema {obj.get('schema')!r}; expected {RESULTS_SCHEMA!r}")
    version = _require(obj, "schema_version", int)
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(
            f"results JSON has schema_version {version}; this version of lance-cf reads {READABLE_SCHEMA_VERSIONS}"
        )
    _check_values(obj, "")
    status = _require(obj, "status", str)
    if status not in STATUSES:
        raise ValueError(f"results JSON field 'status' must be one of {STATUSES}, got {status!r}")
    _require(obj, "model.name", str)
    if (obj.get("model") or {}).get("zero_shot") is not None:  # a zero-shot classifier: its prompts are its head
        _require(obj, "model.zero_shot.templates.name", str)
        digest = _require(obj, "model.zero_shot.templates.digest", str)
        if not digest.startswith("sha256:"):
            raise ValueError(
                f"results JSON field 'model.zero_shot.templates.digest' must be 'sha256:...', got {digest!r:.60}"
            )
        _require(obj, "model.zero_shot.class_names.source", str)
    for field in ("release.name", "release.version", "release.manifest_sha256"):
        _require(obj, field, str)
    if status == "error":
        _require(obj, "error", str)
        return
    metrics = _require(obj, "metrics", dict)
    if not metrics:
        raise ValueError("results JSON field 'metrics' is empty (a successful run scores at least one config)")
    for config, entry in metrics.items():
        if not isinstance(entry, dict):
            raise ValueError(f"results JSON field 'metrics.{config}' must be an object")
        _require(obj, f"metrics.{config}.n", int)
        acc1 = entry.get("acc1")
        if acc1 is not None and (isinstance(acc1, bool) or not isinstance(acc1, (int, float))):
            raise ValueError(f"results JSON field 'metrics.{config}.acc1' must be a number or null, got {acc1!r:.60}")
    for section in METRIC_SECTIONS:
        if section in obj:
            _check_ranges(obj[section], section)
    _check_accuracies_are_counts(metrics)
    if obj.get("strength") is not None:
        validate_strength(obj["strength"])
    if obj.get(JUDGE_KEPT_SECTION) is not None:
        validate_judge_kept(obj[JUDGE_KEPT_SECTION])
    _validate_kind_sections(obj)
    if version >= 2:
        _require(obj, "tool.version", str)
        _require(obj, "options", dict)
        if "limit" not in obj:
            raise ValueError("results JSON has no 'limit' (null for a full run, N for a --limit N run)")
        limit = obj["limit"]
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"results JSON field 'limit' must be null or a positive integer, got {limit!r}")
    if version >= 3:
        computed = _require(obj, "computed_metrics", dict)
        for name, metric_version in computed.items():
            if not isinstance(metric_version, str):
                raise ValueError(
                    f"results JSON field 'computed_metrics.{name}' must be a version string, got {metric_version!r:.60}"
                )
        left_out = obj.get("metrics_left_out", [])
        if not isinstance(left_out, list) or not all(isinstance(n, str) for n in left_out):
            raise ValueError(
                f"results JSON field 'metrics_left_out' must be a list of metric names, got {left_out!r:.60}"
            )


def _check_values(node: Any, path: str) -> None:
    """Every number finite (a NaN or infinity is not JSON and not a score), every text bounded (but error text)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str) or len(key) > MAX_TEXT:
                raise ValueError(
                    f"results JSON has a key of {len(str(key))} characters under '{path}' (at most {MAX_TEXT})"
                )
            _check_values(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_values(value, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ValueError(f"results JSON field '{path}' is {node}, not a finite number")
    elif isinstance(node, str) and len(node) > MAX_TEXT and path != "error":
        raise ValueError(f"results JSON field '{path}' is a text of {len(node)} characters (at most {MAX_TEXT})")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_ranges(node: Any, path: str) -> None:
    """Percentages in [0, 100], differences of percentages in [-100, 100] points, counts whole numbers in [0, 10^9],
    intervals (``<key>_ci``) inside their statistic's range; by key, at any depth of a metric section."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}.{key}"
        base = key[: -len("_ci")] if key.endswith("_ci") else key
        values = value if key.endswith("_ci") and isinstance(value, list) else [value]
        for item in values:
            if item is None or isinstance(item, (dict, list)):
                continue
            if base in COUNT_KEYS and (
                isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_COUNT
            ):
                raise ValueError(f"results JSON field '{where}' must be a count in [0, {MAX_COUNT}], got {item!r:.60}")
            if base in PERCENT_KEYS | POINTS_KEYS:
                low = 0.0 if base in PERCENT_KEYS else -100.0
                if not _number(item) or not low <= item <= 100.0:
                    unit = "a percentage in [0, 100]" if low == 0.0 else "a difference in [-100, 100] points"
                    raise ValueError(f"results JSON field '{where}' must be {unit}, got {item!r:.60}")
        if isinstance(value, dict):
            _check_ranges(value, where)


def _check_accuracies_are_counts(metrics: dict[str, Any]) -> None:
    """``acc@k`` of a config is 100 * correct / n for a whole number of correct samples (an accuracy of 7.5 on 12
    samples was not computed, it was typed)."""
    for config, entry in metrics.items():
        n = entry.get("n")
        for name in ("acc1", "acc5"):
            value = entry.get(name)
            if value is None or not n:
                continue
            correct = value * n / 100.0
            if abs(correct - round(correct)) > 1e-6 * max(1, n):
                raise ValueError(
                    f"results JSON field 'metrics.{config}.{name}' = {value!r:.60} is not a whole number of correct "
                    f"samples out of n = {n}"
                )


def validate_strength(section: Any) -> None:
    """Check a results JSON's ``strength`` section; raise ``ValueError`` naming the first bad field."""

    def fail(path: str, expected: str) -> None:
        raise ValueError(f"results JSON field 'strength.{path}' must be {expected}")

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(section, dict):
        fail("", "an object")
    groups = {"overall": section.get("overall")}
    if not isinstance(section.get("by_edit_type"), dict):
        fail("by_edit_type", "an object")
    groups.update({f"by_edit_type.{t}": g for t, g in section["by_edit_type"].items()})
    for path, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("curve"), list):
            fail(f"{path}.curve", "a list")
        # results of metric version 1 have no pooled view: their curve was the pooled one and is never empty
        views = [(path, group)] + ([(f"{path}.pooled", group["pooled"])] if "pooled" in group else [])
        for where, view in views:
            if not isinstance(view, dict) or not isinstance(view.get("curve"), list):
                fail(f"{where}.curve", "a list")
            for i, point in enumerate(view["curve"]):
                if not isinstance(point, dict) or not number(point.get("strength")) or not number(point.get("acc1")):
                    fail(f"{where}.curve[{i}]", "an object with numeric strength and acc1")
            if view["curve"] and not number(view.get("auc_acc1")):
                fail(f"{where}.auc_acc1", "a number")
            if not view["curve"] and view.get("auc_acc1") is not None:
                fail(f"{where}.auc_acc1", "null when the curve is empty")
        if "pooled" in group and not group["pooled"]["curve"]:
            fail(f"{path}.pooled.curve", "a non-empty list")
        if "pooled" not in group and not group["curve"]:
            fail(f"{path}.curve", "a non-empty list")
        if not isinstance(group.get("failure"), dict):
            fail(f"{path}.failure", "an object")
        if "panel" in group:  # metric version 2: what rank_stability resamples
            panel = group["panel"]
            levels = panel.get("levels") if isinstance(panel, dict) else None
            if not isinstance(levels, list) or not all(number(v) for v in levels):
                fail(f"{path}.panel.levels", "a list of numbers")
            if not isinstance(panel.get("images"), dict):
                fail(f"{path}.panel.images", "an object")
            for key, image in panel["images"].items():
                n_series = image.get("n_series") if isinstance(image, dict) else None
                if not isinstance(n_series, int) or isinstance(n_series, bool) or n_series < 1:
                    fail(f"{path}.panel.images.{key}.n_series", "a positive integer")
                correct = image.get("correct")
                if not isinstance(correct, list) or len(correct) != len(levels):
                    fail(f"{path}.panel.images.{key}.correct", f"a list of {len(levels)} numbers (one per level)")
                if not all(number(v) and 0 <= v <= n_series for v in correct):
                    fail(f"{path}.panel.images.{key}.correct", f"counts between 0 and n_series ({n_series})")
    if not isinstance(section.get("images"), dict):
        fail("images", "an object")


def _validate_kind_sections(obj: dict[str, Any]) -> None:
    """The sections that belong to the release's kind (``lance_pipeline.release_kinds``: ``results_sections``), each
    checked by the validator the kind names; a section of another kind is refused (results of a LANCE release with an
    ``interfaces`` section were not written by ``lance-cf eval``)."""
    kind = kind_of_results(obj)
    for section, validator in kind.results_sections.items():
        if section in obj:
            resolve_target(validator)(obj[section])
    for other in list_kinds():
        for section in other.results_sections:
            if other.name != kind.name and section in obj and section not in kind.results_sections:
                raise ValueError(
                    f"results JSON of a {kind.name} release has a {section!r} section, which belongs to {other.name} "
                    "releases (expected the output of `lance-cf eval`)"
                )


def check_one_release(results: list[dict[str, Any]]) -> None:
    """Refuse results of different releases: their numbers are not comparable."""
    releases: dict[str, str] = {}
    for r in results:
        release = r.get("release") or {}
        releases.setdefault(
            str(release.get("manifest_sha256")),
            f"{release.get('name')} {release.get('version')} ({str(release.get('manifest_sha256'))[:12]})",
        )
    if len(releases) > 1:
        raise ValueError(
            f"the results come from {len(releases)} different releases ({'; '.join(sorted(releases.values()))}); "
            "a leaderboard compares models on one release: pass each release's results separately, or use "
            "--split-releases for one leaderboard per release"
        )


def is_complete(obj: dict[str, Any]) -> bool:
    """True when the run scored every sample of the release (no ``--limit``, no sample that failed to decode) with
    every default metric (no ``--metrics`` selection that leaves one out).

    A run that is not complete may be shown, but never ranked or published as a leaderboard entry.
    """
    return (
        obj.get("status") == "ok"
        and obj.get("limit") is None
        and not obj.get("failures")
        and not missing_default_metrics(obj)
    )


def missing_default_metrics(obj: dict[str, Any]) -> list[str]:
    """The default metrics that apply to the release but that a ``--metrics`` selection left out of this run."""
    return list(obj.get("metrics_left_out") or [])


def model_label(obj: dict[str, Any]) -> str:
    """How a model is named in tables and plots: its timm name, plus how its weights differ from the pretrained ones.

    Never the results folder's slug (which may carry a hash).
    """
    model = obj.get("model") or {}
    label = display_name(str(model.get("name") or "?"), (model.get("weights") or {}).get("id"))
    templates = template_set(obj)
    return f"{label} [{templates[0]} templates]" if templates else label


def template_set(obj: dict[str, Any]) -> tuple[str, str] | None:
    """``(name, digest)`` of a zero-shot model's prompt templates; ``None`` for a classifier with a trained head."""
    templates = ((obj.get("model") or {}).get("zero_shot") or {}).get("templates") or {}
    return (str(templates.get("name")), str(templates.get("digest"))) if templates else None


def display_name(name: str, weights_id: str | None) -> str:
    """``name``, or ``name (random weights)`` / ``name (checkpoint <sha256 prefix>)`` for non-pretrained weights."""
    weights = str(weights_id or "")
    if weights.startswith("random"):
        return f"{name} (random weights)"
    if weights.startswith("checkpoint:"):
        return f"{name} (checkpoint {weights.rsplit(':', 1)[-1][:12]})"
    if weights.startswith("local-dir:"):
        return f"{name} ({weights.rsplit(':', 1)[-1][:12]})"
    return name
