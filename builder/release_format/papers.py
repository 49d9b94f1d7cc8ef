"""A release's kind as its declaration says (``lance_pipeline.release_kinds``), and the papers it implements: cited by
``croissant.json``, tagged ``arxiv:<id>`` in the card's YAML (the Hub links such a tag to the paper's page) and listed
in the card's citation section.

A release's kind is the manifest's recorded ``kind`` when it has one; a manifest without it is recognised by
``lance_pipeline.release_kinds.kind_of_manifest``, the one recogniser. The papers are the kind's ``papers``.
"""

from __future__ import annotations

from typing import Any

from builder.release_format.manifest import Manifest
from lance_pipeline.release_kinds import Paper, ReleaseKind, kind_of_manifest

__all__ = ["Paper", "release_kind", "release_papers"]


def release_kind(manifest: Manifest | dict[str, Any]) -> ReleaseKind:
    """The release's kind: recorded in the manifest (``kind``), else recognised from what it holds."""
    return kind_of_manifest(manifest.to_dict() if isinstance(manifest, Manifest) else manifest)


def release_papers(manifest: Manifest | dict[str, Any]) -> tuple[Paper, ...]:
    """The papers the release's kind implements."""
    return release_kind(manifest).papers
