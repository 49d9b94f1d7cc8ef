"""Release versions: semantic versions (``MAJOR.MINOR.PATCH`` with an optional pre-release), parsed and ordered by
``packaging.version`` everywhere (build config, manifest, publish tags)."""

from __future__ import annotations

from typing import Any


def parse_release_version(text: Any) -> Any:
    """``text`` as a ``packaging.version.Version``; a ValueError naming it unless it is ``MAJOR.MINOR.PATCH``
    (optionally with a pre-release such as ``1.0.0-rc1`` or ``1.0.0rc1``)."""
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(str(text))
    except InvalidVersion:
        version = None
    plain = isinstance(text, str) and text[:1].isdigit() and text == text.strip()  # packaging also takes "v1.0.0"
    if not plain or version is None or len(version.release) != 3 or version.epoch or version.local:
        raise ValueError(f"version {text!r}: expected a semantic version such as 1.0.0 (or 1.0.0-rc1)")
    return version


def is_release_version(text: Any) -> bool:
    try:
        parse_release_version(text)
    except ValueError:
        return False
    return True
