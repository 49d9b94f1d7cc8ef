"""Evaluation of timm image classifiers against a LANCE counterfactual release.

The harness reads a release (local directory or Hub dataset) through the release format only
(:mod:`builder.release_format`), scores any number of timm models on every config of the release, and writes a
results JSON per model, a leaderboard over models and an HTML report per model. Command line: ``lance-cf eval`` and
``lance-cf leaderboard`` (:mod:`evaluation.cli`). Metric definitions: docs/evaluation.md. The results format and its
validation: :mod:`evaluation.results`.
"""

from evaluation.results import RESULTS_SCHEMA, RESULTS_SCHEMA_VERSION

__all__ = ["RESULTS_SCHEMA", "RESULTS_SCHEMA_VERSION"]
