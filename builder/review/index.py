"""The release's samples for the review page, looked up by (config, key) in an index built once at start.

Built with the release format's reader (``rf.index_shard``): every shard is streamed once, checked against the
manifest's sha256, its metadata kept in memory and the byte span of each image noted, so an image is later read by
seeking into a shard the manifest lists. No part of a request ever becomes a file-system path: the page names samples
by item numbers of the study, which map to (config, key) here.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import release_format as rf
from lance_pipeline.readers import load_json

logger = logging.getLogger(__name__)

IMAGE_TYPES = {"png": "image/png", "webp": "image/webp"}


@dataclass(frozen=True)
class ReviewSample:
    config: str
    key: str
    label: int
    meta: dict[str, Any]
    shard: Path
    image_span: tuple[int, int]


class ReleaseIndex:
    """Every sample of a release by (config, key), with its metadata; images read on demand."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.manifest = rf.load_manifest(self.root)
        self.manifest_sha = self.manifest.manifest_sha256
        self.samples: dict[tuple[str, str], ReviewSample] = {}
        ext = self.manifest.image_ext
        listed = {s.path for s in self.manifest.shards}
        for shard in self.manifest.shards:
            if shard.config not in self.manifest.configs:
                continue
            path = self.root / shard.path
            if shard.path not in listed or not path.is_file():
                raise ValueError(f"{shard.path}: missing; run lance-cf verify {self.root}")
            for sample in rf.index_shard(path, read={rf.METADATA_EXT}, expected_sha256=shard.sha256):
                if ext not in sample.spans or rf.METADATA_EXT not in sample.members:
                    raise ValueError(f"{shard.path}:{sample.key}: no {ext} image or metadata")
                meta = load_json(sample.members[rf.METADATA_EXT], f"{shard.path}:{sample.key}.json")
                self.samples[(shard.config, sample.key)] = ReviewSample(
                    shard.config, sample.key, int(meta["label"]), meta, path, sample.spans[ext]
                )
        self.image_type = IMAGE_TYPES[ext]
        logger.info("indexed %d samples of %s", len(self.samples), self.root)

    @property
    def kind(self) -> str:
        return rf.release_kind(self.manifest).name

    def configs(self) -> list[str]:
        return list(self.manifest.configs)

    def keys(self, config: str) -> list[str]:
        return sorted(k for c, k in self.samples if c == config)

    def get(self, config: str, key: str) -> ReviewSample:
        return self.samples[(config, key)]

    def original_of(self, sample: ReviewSample) -> ReviewSample | None:
        """The ``original`` sample a derived one was made from (none for generated releases)."""
        source = sample.meta.get("source_key")
        if sample.config == "original" or not source:
            return None
        return self.samples.get(("original", source))

    def image(self, sample: ReviewSample) -> bytes:
        return rf.read_member(sample.shard, sample.image_span)

    def extra_fields(self, config: str) -> list[str]:
        return [f.name for f in self.manifest.release_spec.config(config).fields]


def marked_words(text: str | None, other: str | None) -> list[dict[str, Any]]:
    """``text`` as segments ``{"text", "changed"}``: the words that differ from ``other`` (a word diff) are marked.

    The page shows the caption and the edited caption so, with the changed span highlighted in each.
    """
    if not text:
        return []
    words, others = text.split(), (other or "").split()
    segments: list[dict[str, Any]] = []
    matcher = difflib.SequenceMatcher(a=words, b=others, autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if i2 > i1:
            segments.append({"text": " ".join(words[i1:i2]), "changed": tag != "equal"})
    return segments
