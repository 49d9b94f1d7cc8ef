"""Reading the perturber's instruction data: streamed, checked row by row, bounded in memory whatever a row's size.

The data is what ``lance-cf perturber collect`` writes (``data/{train,test}-*.parquet``) or JSON Lines in the same
shape, one row per (caption, edit type): ``caption`` (text), ``edit_type`` (a type of ``lance_pipeline.edit_types``),
``variations`` (a list of edited captions; empty for a row whose every variation was rejected), and optionally
``label_name`` and ``instruction`` (text or null). ``--data`` may name:

* a directory holding the split's files: ``data/{split}-*.parquet``, ``data/{split}.parquet``, ``data/{split}-*.jsonl``,
  ``data/{split}.jsonl``, or the same names at the top level;
* one ``.jsonl`` or ``.parquet`` file (the train split; there is then no test split);
* a Hub dataset id (only the split's files are fetched, at ``revision``).

Rows are read one at a time (a JSON line, or one Parquet row group, at most ``MAX_ROW_GROUP_BYTES``), a JSON line is
never read past ``MAX_ROW_BYTES``, and every row is checked before it is used: a bad row stops the run with one line
naming the file, the line (or row) and the field, before any model is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lance_pipeline.edit_types import edit_type as edit_type_row
from lance_pipeline.readers import InputError, load_json

# A perturber row is a caption and a few short variations (plus, in collected data, the teacher's raw answer and the
# rejected variations): a few kilobytes. A row beyond this is not perturber data, and is refused unread.
MAX_ROW_BYTES = 1 << 20
# Parquet is read one row group at a time; a row group larger than this (uncompressed) is refused unread.
MAX_ROW_GROUP_BYTES = 256 << 20
SPLIT_PATTERNS = (
    "data/{split}-*.parquet",
    "data/{split}.parquet",
    "data/{split}-*.jsonl",
    "data/{split}.jsonl",
    "{split}-*.parquet",
    "{split}.parquet",
    "{split}-*.jsonl",
    "{split}.jsonl",
)
DATA_SUFFIXES = (".jsonl", ".parquet")


class InstructionDataError(ValueError):
    """A row (or file) of instruction data is unusable; the message is one line naming the file, line and field."""


def split_files(data: str, split: str, revision: str | None = None) -> tuple[list[Path], Path | None]:
    """The files of one split, and the directory their names are shown relative to (``None``: show them whole).

    Raises:
        InstructionDataError: for a path that does not exist, or a file that is neither JSON Lines nor Parquet.
    """
    path = Path(data)
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise InstructionDataError(f"{data}: instruction data must be a .jsonl or .parquet file (or a directory)")
        return ([path] if split == "train" else []), None
    if path.is_dir():
        root = path
    elif data.count("/") != 1 or data.startswith((".", "/", "~")):
        raise InstructionDataError(f"{data}: no such file or directory (give a directory, a file or a Hub dataset id)")
    else:
        from huggingface_hub import snapshot_download

        patterns = [p.format(split=split) for p in SPLIT_PATTERNS]
        root = Path(snapshot_download(data, repo_type="dataset", revision=revision, allow_patterns=patterns))
    files: list[Path] = []
    for pattern in SPLIT_PATTERNS:
        for found in sorted(root.glob(pattern.format(split=split))):
            if found.is_file() and found not in files:
                files.append(found)
    return files, root


def _jsonl_rows(file: Path, shown: str) -> Iterator[tuple[str, Any]]:
    """``(where, parsed row)`` of each non-blank line, reading at most ``MAX_ROW_BYTES`` of any line."""
    with open(file, "rb") as handle:
        number = 0
        while True:
            line = handle.readline(MAX_ROW_BYTES + 1)
            if not line:
                return
            number += 1
            where = f"{shown}:{number}"
            if len(line) > MAX_ROW_BYTES:
                raise InstructionDataError(
                    f"{where}: the row is longer than {MAX_ROW_BYTES >> 20} MiB; a perturber row is a caption and a "
                    "few short variations (fix or drop the line)"
                )
            if not line.strip():
                continue
            try:
                row = load_json(line, where, max_bytes=MAX_ROW_BYTES)
            except InputError as error:
                raise InstructionDataError(str(error)) from None
            yield where, row


def _parquet_rows(file: Path, shown: str) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of each row, one row group in memory at a time."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except Exception as error:  # noqa: BLE001 - pyarrow raises several kinds for a broken file; all mean the same
        raise InstructionDataError(f"{shown}: not a readable Parquet file ({error})") from None
    number = 0
    for group in range(parquet.num_row_groups):
        size = parquet.metadata.row_group(group).total_byte_size
        if size > MAX_ROW_GROUP_BYTES:
            raise InstructionDataError(
                f"{shown}: row group {group} holds {size >> 20} MiB, more than {MAX_ROW_GROUP_BYTES >> 20} MiB; "
                "write it in smaller row groups"
            )
        for row in parquet.read_row_group(group).to_pylist():
            number += 1
            yield f"{shown}: row {number}", row


def check_row(row: Any, where: str) -> dict[str, Any]:
    """The row if it is usable instruction data, else ``InstructionDataError`` naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise InstructionDataError(f"{where}: a row must be a JSON object, got {_kind(row)}")

    def bad(field: str, expected: str) -> InstructionDataError:
        return InstructionDataError(f"{where}: field {field!r} must be {expected}, got {_kind(row.get(field))}")

    caption = row.get("caption")
    if not isinstance(caption, str) or not caption.strip():
        raise bad("caption", "a non-empty string")
    name = row.get("edit_type")
    if not isinstance(name, str):
        raise bad("edit_type", "the name of an edit type")
    try:
        edit_type_row(name)
    except ValueError as error:
        raise InstructionDataError(f"{where}: field 'edit_type': {error}") from None
    variations = row.get("variations")
    if not isinstance(variations, list):
        raise bad("variations", "a list of edited captions")
    for index, variation in enumerate(variations):
        if not isinstance(variation, str) or not variation.strip():
            raise InstructionDataError(
                f"{where}: field 'variations'[{index}] must be a non-empty string, got {_kind(variation)}"
            )
    for field in ("label_name", "instruction"):
        if row.get(field) is not None and not isinstance(row[field], str):
            raise bad(field, "a string or null")
    size = len(caption) + sum(len(v) for v in variations) + len(row.get("instruction") or "")
    if size > MAX_ROW_BYTES:
        raise InstructionDataError(f"{where}: the row's text is longer than {MAX_ROW_BYTES >> 20} MiB")
    return row


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a string" if value.strip() else "an empty string"
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


def iter_instruction_rows(
    data: str, split: str = "train", revision: str | None = None, accepted_only: bool = True
) -> Iterator[dict[str, Any]]:
    """The checked rows of one split, streamed.

    Args:
        data: A directory, a ``.jsonl``/``.parquet`` file, or a Hub dataset id (see the module docstring).
        split: ``train`` or ``test``.
        revision: Hub revision of ``data``.
        accepted_only: Yield only rows with at least one variation (the ones there is something to learn from).

    Raises:
        InstructionDataError: at the first bad row, naming its file, line and field.
    """
    files, root = split_files(data, split, revision)
    for file in files:
        shown = str(file) if root is None else f"{data.rstrip('/')}/{file.relative_to(root)}"
        reader = _jsonl_rows if file.suffix == ".jsonl" else _parquet_rows
        for where, row in reader(file, shown):
            row = check_row(row, where)
            if row["variations"] or not accepted_only:
                yield row


def count_instruction_rows(data: str, split: str = "train", revision: str | None = None) -> dict[str, int]:
    """Check every row of a split (streamed, nothing kept) and count them: ``rows`` and ``with_variations``.

    Raises:
        InstructionDataError: at the first bad row; and for the train split, when it has no row at all (naming the
            files looked for) or none with a variation.
    """
    files, _ = split_files(data, split, revision)
    rows = with_variations = 0
    for row in iter_instruction_rows(data, split, revision, accepted_only=False):
        rows += 1
        with_variations += bool(row["variations"])
    if split == "train" and not files:
        looked = ", ".join(p.format(split=split) for p in SPLIT_PATTERNS[:4])
        raise InstructionDataError(f"{data}: no train split (looked for {looked}, ...)")
    if split == "train" and not rows:
        raise InstructionDataError(f"{data}: the train split has no rows ({', '.join(f.name for f in files)} empty)")
    if split == "train" and not with_variations:
        raise InstructionDataError(f"{data}: no train row has an accepted variation; nothing to learn from")
    return {"rows": rows, "with_variations": with_variations}
