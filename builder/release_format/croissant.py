"""``croissant.json``: the release described in Croissant (MLCommons' JSON-LD format for ML datasets), and the
per-config metadata index it reads.

Everything structural is generated here from the manifest and its ``release_spec``: one ``FileObject`` per shard with
its sha256, per config a ``FileSet`` of the images inside that config's shards and the config's metadata index, one
``RecordSet`` per config with a field for the key, the image, the label (referencing a ``classes`` enumeration that
holds the label space's names) and every metadata field the config declares (type and description from
``SampleMetadata`` and the config's ``FieldSpec``), the licence and the version. What describes the release in prose
(description, citations, the Responsible-AI fields) is passed in as ``about``, composed by the builder from the same
manifest; ``verify`` checks the generated part exactly and that the required prose fields are present.

Why an index beside the shards. mlcroissant (1.1) reads a member of a tar archive only as a whole file: it extracts
the archive and lists its files, and a field can take a file's name or its raw bytes, but there is no JSON reading of
a file inside an archive, so the typed fields of ``KEY.json`` cannot be extracted from the shards themselves. The
images are read from the shards (``FileSet`` ``containedIn`` the tars, ``includes: *.png``); the metadata of each
config is read from ``index/<config>.parquet``, one row per sample holding exactly that sample's ``KEY.json`` object
(the same record, typed by the same declaration), joined to the image by key. ``verify`` checks every index row
against the shard it comes from. ``KEY.cls`` is not read: it equals the metadata's ``label`` (``verify`` checks
that too), and mlcroissant joins a record set's sources once, which the image-to-metadata join already uses.
"""

from __future__ import annotations

import hashlib
import io
import os
import typing
from pathlib import Path
from typing import Any

from builder.release_format.layout import METADATA_EXT, SPLIT
from builder.release_format.manifest import Manifest, canonical_json, first_difference
from builder.release_format.metadata import _scalar, _v1_fields
from builder.release_format.spec import ReleaseSpec
from builder.release_format.text_out import md_escape
from lance_pipeline.readers import load_json

CROISSANT_NAME = "croissant.json"
INDEX_DIR = "index"
CONFORMS_TO = ("http://mlcommons.org/croissant/1.1", "http://mlcommons.org/croissant/RAI/1.0")
# The JSON-LD @context of Croissant 1.1 as mlcroissant writes it (a test keeps it equal to mlcroissant's own).
CONTEXT: dict[str, Any] = {
    "@language": "en",
    "@vocab": "https://schema.org/",
    "arrayShape": "cr:arrayShape",
    "citeAs": "cr:citeAs",
    "column": "cr:column",
    "conformsTo": "dct:conformsTo",
    "containedIn": "cr:containedIn",
    "cr": "http://mlcommons.org/croissant/",
    "data": {"@id": "cr:data", "@type": "@json"},
    "dataType": {"@id": "cr:dataType", "@type": "@vocab"},
    "dct": "http://purl.org/dc/terms/",
    "description": {"@container": "@language"},
    "equivalentProperty": "cr:equivalentProperty",
    "examples": {"@id": "cr:examples", "@type": "@json"},
    "extract": "cr:extract",
    "field": "cr:field",
    "fileObject": "cr:fileObject",
    "fileProperty": "cr:fileProperty",
    "fileSet": "cr:fileSet",
    "format": "cr:format",
    "includes": "cr:includes",
    "isArray": "cr:isArray",
    "isLiveDataset": "cr:isLiveDataset",
    "jsonPath": "cr:jsonPath",
    "key": "cr:key",
    "md5": "cr:md5",
    "name": {"@container": "@language"},
    "parentField": "cr:parentField",
    "path": "cr:path",
    "rai": "http://mlcommons.org/croissant/RAI/",
    "recordSet": "cr:recordSet",
    "references": "cr:references",
    "regex": "cr:regex",
    "repeated": "cr:repeated",
    "replace": "cr:replace",
    "samplingRate": "cr:samplingRate",
    "sc": "https://schema.org/",
    "separator": "cr:separator",
    "source": "cr:source",
    "subField": "cr:subField",
    "transform": "cr:transform",
}
IMAGE_MIME = {"png": "image/png", "webp": "image/webp"}
CLASSES = "classes"  # the enumeration record set of the label space

# Prose the builder composes (``about``); publish adds ``url`` and ``datePublished``, which describe the publication.
ABOUT_KEYS = ("description", "citeAs", "keywords", "url", "datePublished")
RAI_KEYS = (
    "rai:dataCollection",
    "rai:dataCollectionType",
    "rai:dataCollectionRawData",
    "rai:dataPreprocessingProtocol",
    "rai:dataManipulationProtocol",
    "rai:dataAnnotationProtocol",
    "rai:machineAnnotationTools",
    "rai:dataUseCases",
    "rai:dataLimitations",
    "rai:dataBiases",
    "rai:personalSensitiveInformation",
    "rai:dataSocialImpact",
    "rai:dataReleaseMaintenancePlan",
)
REQUIRED_ABOUT = ("description", "citeAs", *RAI_KEYS)

_CROISSANT_TYPES = {str: "sc:Text", int: "sc:Integer", float: "sc:Float", bool: "sc:Boolean"}
_SPEC_TYPES = {"string": str, "int64": int, "float64": float, "bool": bool}
# Hub licence ids of the card -> SPDX identifiers (Croissant recommends an SPDX URL).
_SPDX = {
    "apache-2.0": "Apache-2.0",
    "mit": "MIT",
    "cc0-1.0": "CC0-1.0",
    "cc-by-4.0": "CC-BY-4.0",
    "cc-by-sa-4.0": "CC-BY-SA-4.0",
    "cc-by-nc-4.0": "CC-BY-NC-4.0",
    "cc-by-nc-sa-4.0": "CC-BY-NC-SA-4.0",
    "cc-by-nd-4.0": "CC-BY-ND-4.0",
    "cc-by-nc-nd-4.0": "CC-BY-NC-ND-4.0",
    "cc-by-2.0": "CC-BY-2.0",
    "cc-by-3.0": "CC-BY-3.0",
    "odc-by": "ODC-By-1.0",
}


def index_path(config: str) -> str:
    """Path of a config's metadata index relative to the release root, e.g. ``index/counterfactual.parquet``."""
    return f"{INDEX_DIR}/{config}.parquet"


# ------------------------------------------------------------------------------------------------- metadata index
def index_schema(spec: ReleaseSpec, config: str | None):
    """The Arrow schema of a config's index: the fields of ``KEY.json`` in their on-disk order, typed by the
    declaration (``scores`` a struct of the declared score names, extras by their ``FieldSpec``), every field
    nullable where the record allows null."""
    import pyarrow as pa

    arrow = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
    columns = []
    for name, annotation, meta in _v1_fields():
        if typing.get_origin(annotation) is dict:
            names = getattr(spec, meta["vocabulary"])
            columns.append(pa.field(name, pa.struct([pa.field(n, pa.float64()) for n in names])))
            continue
        scalar, nullable = _scalar(annotation)
        columns.append(pa.field(name, arrow[scalar], nullable=nullable))
    for f in spec.config(config).fields if config else ():
        columns.append(pa.field(f.name, arrow[_SPEC_TYPES[f.dtype]]))
    return pa.schema(columns)


def index_bytes(rows: list[dict[str, Any]], spec: ReleaseSpec, config: str | None) -> bytes:
    """A config's index as Parquet bytes: one row per sample (its ``KEY.json`` object), in shard order.

    The writer options are fixed (no timestamp is written), so the same rows give the same bytes with the same
    pyarrow version; ``verify`` compares the rows, not the bytes, so a newer pyarrow still verifies an older release.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=index_schema(spec, config))
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", version="2.6", data_page_version="1.0", use_dictionary=True)
    return buf.getvalue()


def write_indexes(root: Path, manifest: Manifest) -> dict[str, tuple[str, int]]:
    """Write every config's index from its shards (read back, metadata members only) and remove index files of
    configs the release no longer has; return per config the (sha256, bytes) of its index."""
    # lazy: builder.release_format.shards leads back to this module at import time
    from builder.release_format.shards import iter_shard

    root = Path(root)
    spec_config = manifest.format_version >= 2
    out: dict[str, tuple[str, int]] = {}
    for config in manifest.configs:
        rows = []
        for shard in manifest.shards_of(config):
            for _key, members in iter_shard(root / shard.path, wanted={METADATA_EXT}):
                assert members is not None  # no select: every sample is read
                rows.append(load_json(members[METADATA_EXT], f"{shard.path}: {_key}.json"))
        data = index_bytes(rows, manifest.release_spec, config if spec_config else None)
        _atomic_write(root / index_path(config), data)
        out[config] = (hashlib.sha256(data).hexdigest(), len(data))
    keep = {index_path(c) for c in manifest.configs}
    if (root / INDEX_DIR).is_dir():
        for path in sorted((root / INDEX_DIR).iterdir()):
            if path.is_file() and f"{INDEX_DIR}/{path.name}" not in keep:
                path.unlink()
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_croissant(root: Path, manifest: Manifest, about: dict[str, Any]) -> dict[str, Any]:
    """Write the indexes and ``croissant.json`` (canonical JSON) of a release; return the document."""
    document = croissant_document(manifest, write_indexes(root, manifest), about)
    _atomic_write(Path(root) / CROISSANT_NAME, canonical_json(document))
    return document


def read_index_rows(path: Path) -> tuple[Any, list[dict[str, Any]]]:
    """(schema, rows) of an index file (raises ValueError naming the file when it is not Parquet)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - any reader error means a broken index
        raise ValueError(f"{path.name}: not a readable Parquet file ({err})") from err
    return table.schema, table.to_pylist()


# ----------------------------------------------------------------------------------------------------- the document
def croissant_licence(manifest: Manifest) -> str:
    """The licence the document states, from the source's terms (as the card's licence keys are)."""
    source = manifest.source
    if source.get("imagenet_derived"):
        return "https://www.image-net.org/download.php"
    licence = str(source.get("license") or "").strip()
    if licence.lower() in _SPDX:
        return f"https://spdx.org/licenses/{_SPDX[licence.lower()]}.html"
    return licence or "The source data states no terms; see the dataset card."


def _field(config: str, name: str, data_type: Any, description: str, **rest: Any) -> dict[str, Any]:
    return {
        "@type": "cr:Field",
        "@id": f"{config}/{name}",
        "name": f"{config}/{name}",
        "description": description,
        "dataType": data_type,
        **rest,
    }


def _index_source(config: str, column: str, **transform: str) -> dict[str, Any]:
    source: dict[str, Any] = {"fileObject": {"@id": index_path(config)}, "extract": {"column": column}}
    if transform:
        source["transform"] = transform
    return source


def _record_set(manifest: Manifest, config: str) -> dict[str, Any]:
    spec = manifest.release_spec
    ext = manifest.image_ext
    images = _image_set_id(config)
    fields = [
        _field(
            config,
            "key",
            "sc:Text",
            "the sample's key: the name of its members KEY.cls, KEY.json and KEY." + ext + " in the shard",
            # mlcroissant applies this transform once when joining and again when reading the field, so the
            # extension is optional: both the file name and the bare key give the key.
            source={
                "fileSet": {"@id": images},
                "extract": {"fileProperty": "filename"},
                "transform": {"regex": rf"^([A-Za-z0-9_-]+)(?:\.{ext})?$"},
            },
            references={"fileObject": {"@id": index_path(config)}, "extract": {"column": "key"}},
        ),
        _field(
            config,
            "image",
            "sc:ImageObject",
            f"the image ({ext.upper()}, lossless), the member KEY.{ext} of the shard",
            source={"fileSet": {"@id": images}, "extract": {"fileProperty": "content"}},
        ),
        _field(
            config,
            "label",
            ["sc:Integer", "cr:Label"],
            f"the class index in the label space {manifest.label_space['name']} (record set {CLASSES} names it); "
            "the member KEY.cls holds the same number",
            source=_index_source(config, "label"),
            references={"field": {"@id": f"{CLASSES}/index"}},
        ),
    ]
    for name, annotation, meta in _v1_fields():
        if name in ("key", "label"):
            continue
        doc = meta.get("doc", "")
        if typing.get_origin(annotation) is dict:
            names = getattr(spec, meta["vocabulary"])
            fields.append(
                _field(
                    config,
                    name,
                    "sc:StructuredValue",
                    doc,
                    subField=[
                        _field(
                            f"{config}/{name}",
                            n,
                            "sc:Float",
                            f"the {n} score; null where not computed",
                            source=_index_source(config, name, jsonPath=n),
                        )
                        for n in names
                    ],
                )
            )
            continue
        if meta.get("vocabulary"):
            values = getattr(spec, meta["vocabulary"])
            doc = f"{doc}; one of {', '.join(values)}" if values else doc
        scalar, nullable = _scalar(annotation)
        fields.append(
            _field(
                config,
                name,
                _CROISSANT_TYPES[scalar],
                doc + ("; null where not set" if nullable else ""),
                source=_index_source(config, name),
            )  # fmt: skip
        )
    for f in spec.config(config).fields if manifest.format_version >= 2 else ():
        doc = md_escape(f.description) if f.description else f"the {config} config's field {f.name}"
        if f.enum is not None:
            doc = f"{doc}; one of {', '.join(f.enum)}"
        fields.append(
            _field(
                config,
                f.name,
                _CROISSANT_TYPES[_SPEC_TYPES[f.dtype]],
                doc + "; null where not set",
                source=_index_source(config, f.name),
            )  # fmt: skip
        )
    total = manifest.counts[config]["total"]
    return {
        "@type": "cr:RecordSet",
        "@id": config,
        "name": config,
        "description": f"{md_escape(spec.config(config).description)} ({total} samples, the {SPLIT} split of config "
        f"{config})",
        "key": {"@id": f"{config}/key"},
        "field": fields,
    }


def _image_set_id(config: str) -> str:
    return f"images-{config}"


def _classes(manifest: Manifest) -> dict[str, Any]:
    names = manifest.label_names
    return {
        "@type": "cr:RecordSet",
        "@id": CLASSES,
        "name": CLASSES,
        "description": f"the label space {md_escape(manifest.label_space['name'])}: every class index and its readable "
        "name",
        "dataType": "sc:Enumeration",
        "key": {"@id": f"{CLASSES}/index"},
        "field": [
            _field(CLASSES, "index", "sc:Integer", "the class index (the label of a sample)"),
            _field(CLASSES, "name", "sc:Text", "the class's readable name"),
        ],
        "data": [{f"{CLASSES}/index": i, f"{CLASSES}/name": n} for i, n in enumerate(names)],
    }


def croissant_structure(manifest: Manifest, indexes: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """The part of ``croissant.json`` the manifest decides: distribution, record sets, licence, version.

    Args:
        indexes: per config, the (sha256, bytes) of its index file.
    """
    distribution: list[dict[str, Any]] = []
    for config in manifest.configs:
        shards = manifest.shards_of(config)
        for shard in shards:
            distribution.append(
                {
                    "@type": "cr:FileObject",
                    "@id": shard.path,
                    "name": shard.path,
                    "description": f"WebDataset shard of config {config} ({shard.samples} samples)",
                    "contentUrl": shard.path,
                    "contentSize": f"{shard.bytes} B",
                    "encodingFormat": "application/x-tar",
                    "sha256": shard.sha256,
                }
            )
        distribution.append(
            {
                "@type": "cr:FileSet",
                "@id": _image_set_id(config),
                "name": _image_set_id(config),
                "description": f"the images of config {config}, members KEY.{manifest.image_ext} of its shards",
                "containedIn": [{"@id": s.path} for s in shards],
                "encodingFormat": IMAGE_MIME[manifest.image_ext],
                "includes": f"*.{manifest.image_ext}",
            }
        )
        sha256, size = indexes[config]
        distribution.append(
            {
                "@type": "cr:FileObject",
                "@id": index_path(config),
                "name": index_path(config),
                "description": f"the metadata of config {config}: one row per sample, its KEY.json object",
                "contentUrl": index_path(config),
                "contentSize": f"{size} B",
                "encodingFormat": "application/x-parquet",
                "sha256": sha256,
            }
        )
    return {
        "@context": CONTEXT,
        "@type": "sc:Dataset",
        "conformsTo": list(CONFORMS_TO),
        "name": manifest.name,
        "version": manifest.version,
        "license": croissant_licence(manifest),
        "distribution": distribution,
        "recordSet": [_classes(manifest), *(_record_set(manifest, c) for c in manifest.configs)],
    }


def croissant_document(
    manifest: Manifest, indexes: dict[str, tuple[str, int]], about: dict[str, Any]
) -> dict[str, Any]:
    """The whole ``croissant.json``: the structure the manifest decides plus ``about`` (description, ``citeAs``,
    keywords, the ``rai:`` fields; ``url`` and ``datePublished`` once published).

    Raises:
        ValueError: ``about`` holds a key that is not prose (it would override the structure), or misses one of
            ``REQUIRED_ABOUT``.
    """
    unknown = sorted(k for k in about if k not in ABOUT_KEYS and k not in RAI_KEYS)
    if unknown:
        raise ValueError(f"croissant about: {unknown} are not prose fields ({', '.join((*ABOUT_KEYS, *RAI_KEYS))})")
    missing = [k for k in REQUIRED_ABOUT if not about.get(k)]
    if missing:
        raise ValueError(f"croissant about: required field(s) {missing} are missing or empty")
    return {**croissant_structure(manifest, indexes), **about}


def check_croissant(document: Any, manifest: Manifest, indexes: dict[str, tuple[str, int]]) -> list[str]:
    """Problems of a ``croissant.json`` against the manifest: its structure must equal what the manifest implies,
    and every required prose field must be present (``verify`` calls this)."""
    if not isinstance(document, dict):
        return [f"{CROISSANT_NAME}: not a JSON object"]
    problems = []
    expected = croissant_structure(manifest, indexes)
    got = {k: v for k, v in document.items() if k not in ABOUT_KEYS and k not in RAI_KEYS}
    for key in [*expected, *[k for k in got if k not in expected]]:
        if got.get(key) != expected.get(key):
            problems.append(f"{CROISSANT_NAME}: {first_difference(got.get(key), expected.get(key), key)}")
    missing = [k for k in REQUIRED_ABOUT if not document.get(k)]
    if missing:
        problems.append(f"{CROISSANT_NAME}: required field(s) {', '.join(missing)} missing or empty")
    return problems
