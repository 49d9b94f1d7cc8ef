"""Shard writing and reading live in the release format (:mod:`builder.release_format.shards`); these names are
kept for the builder's callers."""

from builder.release_format.shards import (
    ShardSample,
    file_sha256,
    group_into_shards,
    iter_shard,
    read_shard,
    write_shard,
)

__all__ = ["ShardSample", "file_sha256", "group_into_shards", "iter_shard", "read_shard", "write_shard"]
