"""The build ledger: all progress of a build, in one SQLite file inside the output directory.

Every unit of work commits in one transaction (a stage over one batch; the release samples of one batch), so a build
killed at any moment (``kill -9`` included) loses at most the unit in flight, and a re-run redoes exactly that.
Shards are written only from the ledger, in key order, after all batches are done: an interrupted-and-resumed build
and an uninterrupted one therefore write the same bytes.

Stage outputs are stored with a small pickle-free codec: JSON for the structure, PNG for images and safetensors for
tensors.
"""

from __future__ import annotations

import io
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS plan (
    source_key TEXT PRIMARY KEY, batch INTEGER NOT NULL, label INTEGER NOT NULL, origin TEXT NOT NULL,
    seed INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS stage_outputs (
    source_key TEXT NOT NULL, stage TEXT NOT NULL, payload BLOB NOT NULL, PRIMARY KEY (source_key, stage)
);
CREATE TABLE IF NOT EXISTS stage_batches (batch INTEGER NOT NULL, stage TEXT NOT NULL, PRIMARY KEY (batch, stage));
CREATE TABLE IF NOT EXISTS failures (
    source_key TEXT NOT NULL, stage TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (source_key, stage)
);
CREATE TABLE IF NOT EXISTS outputs (
    config TEXT NOT NULL, key TEXT NOT NULL, source_key TEXT NOT NULL, metadata BLOB NOT NULL, image BLOB NOT NULL,
    PRIMARY KEY (config, key)
);
CREATE TABLE IF NOT EXISTS done_batches (batch INTEGER PRIMARY KEY);
"""


class Ledger:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(str(path), isolation_level=None)  # explicit transactions only
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def transaction(self) -> _Transaction:
        return _Transaction(self.db)

    # -- meta ---------------------------------------------------------------------------------------------------
    def get_meta(self, name: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()
        return row[0] if row else None

    def set_meta(self, name: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    # -- plan -----------------------------------------------------------------------------------------------------
    def plan(self) -> list[tuple[str, int, int, str, int]]:
        return self.db.execute(
            "SELECT source_key, batch, label, origin, seed FROM plan ORDER BY batch, source_key"
        ).fetchall()

    def write_plan(self, rows: list[tuple[str, int, int, str, int]]) -> None:
        """Called inside a transaction, together with the config hash: a ledger has both or neither."""
        self.db.execute("DELETE FROM plan")
        self.db.executemany("INSERT INTO plan VALUES (?, ?, ?, ?, ?)", rows)

    # -- progress -------------------------------------------------------------------------------------------------
    def done_batches(self) -> set[int]:
        return {r[0] for r in self.db.execute("SELECT batch FROM done_batches")}

    def stage_done(self, batch: int, stage: str) -> bool:
        return (
            self.db.execute("SELECT 1 FROM stage_batches WHERE batch=? AND stage=?", (batch, stage)).fetchone()
            is not None
        )

    def stage_outputs(self, keys: list[str], stage: str) -> dict[str, dict[str, Any]]:
        out = {}
        for key in keys:
            row = self.db.execute(
                "SELECT payload FROM stage_outputs WHERE source_key=? AND stage=?", (key, stage)
            ).fetchone()
            if row is not None:
                out[key] = decode_payload(row[0])
        return out

    def failures(self) -> list[tuple[str, str, str]]:
        return self.db.execute("SELECT source_key, stage, reason FROM failures ORDER BY source_key, stage").fetchall()

    def failed_keys(self, keys: list[str]) -> dict[str, tuple[str, str]]:
        out = {}
        for key in keys:
            row = self.db.execute("SELECT stage, reason FROM failures WHERE source_key=?", (key,)).fetchone()
            if row is not None:
                out[key] = (row[0], row[1])
        return out

    # Writers below are called inside a transaction by the engine.
    def record_stage(self, batch: int, stage: str, updates: dict[str, dict[str, Any]], failures: dict[str, str]):
        self.db.executemany(
            "INSERT OR REPLACE INTO stage_outputs VALUES (?, ?, ?)",
            [(key, stage, encode_payload(update)) for key, update in updates.items()],
        )
        self.db.executemany(
            "INSERT OR REPLACE INTO failures VALUES (?, ?, ?)", [(k, stage, r) for k, r in failures.items()]
        )
        self.db.execute("INSERT OR REPLACE INTO stage_batches VALUES (?, ?)", (batch, stage))

    def record_failure(self, key: str, stage: str, reason: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO failures VALUES (?, ?, ?)", (key, stage, reason))

    def record_outputs(self, batch: int, rows: list[tuple[str, str, str, bytes, bytes]]) -> None:
        self.db.executemany("INSERT OR REPLACE INTO outputs VALUES (?, ?, ?, ?, ?)", rows)
        self.db.execute("INSERT OR REPLACE INTO done_batches VALUES (?)", (batch,))

    # -- release --------------------------------------------------------------------------------------------------
    def iter_outputs(self, config: str) -> Iterator[tuple[str, str, bytes, bytes]]:
        yield from self.db.execute(
            "SELECT key, source_key, metadata, image FROM outputs WHERE config=? ORDER BY key", (config,)
        )


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


# -- pickle-free payload codec ---------------------------------------------------------------------------------------
def encode_payload(update: dict[str, Any]) -> bytes:
    """JSON structure + binary blobs (PNG for PIL images, safetensors for tensors) in one length-prefixed blob."""
    blobs: list[bytes] = []

    def walk(value: Any) -> Any:
        from PIL import Image

        if isinstance(value, Image.Image):
            buf = io.BytesIO()
            value.save(buf, format="PNG", compress_level=1)
            blobs.append(buf.getvalue())
            return {"__png__": len(blobs) - 1}
        if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
            from safetensors.torch import save

            blobs.append(save({"t": value.detach().cpu().contiguous()}))
            return {"__tensor__": len(blobs) - 1}
        if isinstance(value, dict):
            for k in value:
                if not isinstance(k, str):
                    raise TypeError(f"stage output keys must be strings, got {k!r}")
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v) for v in value]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalars
            return value.item()
        raise TypeError(f"stage output value of type {type(value).__name__} is not storable (JSON, PIL, tensor)")

    structure = json.dumps(walk(update), allow_nan=True).encode()
    parts = [structure, *blobs]
    header = json.dumps([len(p) for p in parts]).encode()
    return len(header).to_bytes(4, "big") + header + b"".join(parts)


def decode_payload(payload: bytes) -> dict[str, Any]:
    n = int.from_bytes(payload[:4], "big")
    sizes = json.loads(payload[4 : 4 + n])
    parts, offset = [], 4 + n
    for size in sizes:
        parts.append(payload[offset : offset + size])
        offset += size
    structure, blobs = json.loads(parts[0]), parts[1:]

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"__png__"}:
                from PIL import Image

                img = Image.open(io.BytesIO(blobs[value["__png__"]]))
                img.load()
                return img
            if set(value) == {"__tensor__"}:
                from safetensors.torch import load

                return load(blobs[value["__tensor__"]])["t"]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(structure)
