"""The release format: the single source of truth for what a release directory holds.

The builder writes this format, ``lance-cf verify`` checks it, ``dataset_cards`` declares it in the card's YAML and
``evaluation`` reads it. This package imports nothing from the rest of the project and nothing heavy at import
(``jsonschema``, ``PIL`` and ``yaml`` are imported by ``verify_release`` only), so readers of a release do not depend
on the build machinery. Human-readable description: docs/release-format.md.

- ``layout``: file names, shard paths, keys.
- ``spec``: what a release declares (``ReleaseSpec``: configs, their extra metadata fields, the method's vocabulary).
- ``metadata``: the per-sample record ``SampleMetadata``; its JSON schema and ``datasets`` features are generated.
- ``manifest``: the typed ``Manifest``, canonical JSON, digest, the one ``Tally`` of counts.
- ``shards``: the one shard writer and the one shard reader.
- ``hub``: the card's YAML blocks, timm's ``_info.json`` and what the Hub's viewer will show, from the manifest.
- ``papers``: the papers each kind of release implements (citations, ``arxiv:`` tags).
- ``croissant``: ``croissant.json`` and the per-config metadata index it reads.
- ``verify``: ``verify_release``.
"""

from builder.release_format.croissant import (
    CROISSANT_NAME,
    INDEX_DIR,
    check_croissant,
    croissant_document,
    croissant_structure,
    index_path,
    write_croissant,
    write_indexes,
)
from builder.release_format.hub import (
    IMAGENET_TERMS,
    KNOWN_LICENSES,
    VIEWER_MAX_PARQUET_BYTES,
    card_configs,
    card_creators,
    card_dataset_info,
    card_licence,
    card_metadata,
    card_yaml_expected,
    pretty_name,
    size_category,
    source_datasets,
    timm_info,
    viewer_partial_configs,
    viewer_statement,
)
from builder.release_format.layout import (
    ASSETS_DIR,
    CARD_NAME,
    DATA_DIR,
    DEFAULT_IMAGE_FORMAT,
    IMAGE_FORMATS,
    KEY_PATTERN,
    LABEL_EXT,
    MANIFEST_NAME,
    METADATA_EXT,
    SPLIT,
    TIMM_INFO_NAME,
    WORK_DIR,
    is_valid_config_name,
    is_valid_key,
    listed_path_problem,
    sanitize_key,
    shard_glob,
    shard_path,
)
from builder.release_format.manifest import (
    FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
    AssetRecord,
    Manifest,
    ManifestError,
    ShardRecord,
    Tally,
    canonical_json,
    load_manifest,
    manifest_digest,
    read_manifest_dict,
    seal_manifest,
)
from builder.release_format.metadata import (
    METADATA_FIELDS,
    V1_FIELD_NAMES,
    SampleMetadata,
    class_label_names,
    decode_metadata,
    empty_metadata,
    encode_metadata,
    hf_features,
    metadata_json_schema,
    normalize_metadata,
)
from builder.release_format.papers import KIND_PAPERS, Paper, release_kind_name, release_papers
from builder.release_format.shards import (
    ShardIntegrityError,
    ShardSample,
    file_sha256,
    group_into_shards,
    iter_shard,
    read_samples,
    read_shard,
    write_shard,
)
from builder.release_format.spec import (
    CONFIG_NAMES,
    FIELD_DTYPES,
    LANCE_EDIT_TYPES,
    V1_CONFIGS,
    V1_EDIT_TYPES,
    V1_SCORE_NAMES,
    V1_SPEC,
    ConfigSpec,
    FieldSpec,
    ReleaseSpec,
    lance_release_spec,
)
from builder.release_format.verify import read_card_yaml, verify_release
from builder.release_format.versioning import is_release_version, parse_release_version

# Former names: the v1 vocabulary (LANCE's six edit types and DILLEMA's "multi", the score names); readers of a v2
# release use its release_spec instead.
EDIT_TYPES = V1_EDIT_TYPES
SCORE_NAMES = V1_SCORE_NAMES

__all__ = [
    "ASSETS_DIR",
    "CARD_NAME",
    "CONFIG_NAMES",
    "CROISSANT_NAME",
    "DATA_DIR",
    "DEFAULT_IMAGE_FORMAT",
    "EDIT_TYPES",
    "FIELD_DTYPES",
    "FORMAT_VERSION",
    "IMAGENET_TERMS",
    "IMAGE_FORMATS",
    "INDEX_DIR",
    "KEY_PATTERN",
    "KIND_PAPERS",
    "KNOWN_LICENSES",
    "LABEL_EXT",
    "LANCE_EDIT_TYPES",
    "MANIFEST_NAME",
    "METADATA_EXT",
    "METADATA_FIELDS",
    "READABLE_FORMAT_VERSIONS",
    "SCORE_NAMES",
    "SPLIT",
    "TIMM_INFO_NAME",
    "V1_CONFIGS",
    "V1_EDIT_TYPES",
    "V1_FIELD_NAMES",
    "V1_SCORE_NAMES",
    "V1_SPEC",
    "VIEWER_MAX_PARQUET_BYTES",
    "WORK_DIR",
    "AssetRecord",
    "ConfigSpec",
    "FieldSpec",
    "Manifest",
    "ManifestError",
    "Paper",
    "ReleaseSpec",
    "SampleMetadata",
    "ShardIntegrityError",
    "ShardRecord",
    "ShardSample",
    "Tally",
    "canonical_json",
    "card_configs",
    "card_creators",
    "card_dataset_info",
    "card_licence",
    "card_metadata",
    "card_yaml_expected",
    "check_croissant",
    "class_label_names",
    "croissant_document",
    "croissant_structure",
    "decode_metadata",
    "empty_metadata",
    "encode_metadata",
    "file_sha256",
    "group_into_shards",
    "hf_features",
    "index_path",
    "is_release_version",
    "is_valid_config_name",
    "is_valid_key",
    "iter_shard",
    "lance_release_spec",
    "load_manifest",
    "manifest_digest",
    "metadata_json_schema",
    "normalize_metadata",
    "parse_release_version",
    "pretty_name",
    "read_card_yaml",
    "read_manifest_dict",
    "read_samples",
    "read_shard",
    "release_kind_name",
    "release_papers",
    "listed_path_problem",
    "sanitize_key",
    "seal_manifest",
    "shard_glob",
    "shard_path",
    "size_category",
    "source_datasets",
    "timm_info",
    "verify_release",
    "viewer_partial_configs",
    "viewer_statement",
    "write_croissant",
    "write_indexes",
    "write_shard",
]
