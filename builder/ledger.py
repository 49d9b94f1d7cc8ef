"""The build ledger: all progress of a build, in one SQLite file inside the output directory.

Every unit of work commits in one transaction (a stage over one batch; the release samples of one batch), so a build
killed at any moment (``kill -9`` included) loses at most the unit in flight, and a re-run redoes exactly that.
Shards are written only from the ledger, in key order, after all batches are done: an interrupted-and-resumed build
and an uninterrupted one therefore write the same bytes.

Stage outputs are stored with a small pickle-free codec: JSON for the structure, PNG for images and safetensors for
tensors. Every stored stage output and release sample carries its sha256, checked when it is read back (replayed into
a later stage, or written into a shard): a changed byte in the ledger stops the release instead of being published.

A sample's outcome at a stage is one of: an output (``stage_outputs``), a *failure* (``failures``: final, data, e.g.
"no edit passed the gates"), or an *error* (``errors``: an exception, e.g. CUDA out of memory; retried when the build
is re-run). A file that is not a lance-cf ledger (another SQLite database, a corrupt file) is refused by name.
"""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Marks a SQLite file as a lance-cf ledger (``PRAGMA application_id``; "LCF1").
APPLICATION_ID = 0x4C434631
LEDGER_FORMAT = "2"  # 2: checksums and errors

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS plan (
    source_key TEXT PRIMARY KEY, batch INTEGER NOT NULL, label INTEGER NOT NULL, origin TEXT NOT NULL,
    seed INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS stage_outputs (
    source_key TEXT NOT NULL, stage TEXT NOT NULL, payload BLOB NOT NULL, sha256 TEXT,
    PRIMARY KEY (source_key, stage)
);
CREATE TABLE IF NOT EXISTS stage_batches (batch INTEGER NOT NULL, stage TEXT NOT NULL, PRIMARY KEY (batch, stage));
CREATE TABLE IF NOT EXISTS failures (
    source_key TEXT NOT NULL, stage TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (source_key, stage)
);
CREATE TABLE IF NOT EXISTS errors (
    source_key TEXT NOT NULL, stage TEXT NOT NULL, message TEXT NOT NULL, PRIMARY KEY (source_key, stage)
);
CREATE TABLE IF NOT EXISTS outputs (
    config TEXT NOT NULL, key TEXT NOT NULL, source_key TEXT NOT NULL, metadata BLOB NOT NULL, image BLOB NOT NULL,
    sha256 TEXT, PRIMARY KEY (config, key)
);
CREATE TABLE IF NOT EXISTS done_batches (batch INTEGER PRIMARY KEY);
"""
OUR_TABLES = {"meta", "plan", "stage_outputs", "stage_batches", "failures", "errors", "outputs", "done_batches"}


class LedgerError(ValueError):
    """The ledger file is not a lance-cf ledger, or it is corrupt, or a stored value no longer matches its checksum."""


def _sha256(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


class Ledger:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # Stages whose stored outputs go once their batch is done (``--keep-inversions no``): the release samples
        # are written by then; a batch reopened later replays without them and runs those stages again.
        self.drop_when_done: tuple[str, ...] = ()
        fix = f"move {path} away (or use a new --output directory) and build again"
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None)  # explicit transactions only
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            app_id = self.db.execute("PRAGMA application_id").fetchone()[0]
        except sqlite3.OperationalError:
            raise  # the environment (read-only, disk full), not the file: the engine names it
        except sqlite3.DatabaseError as err:
            raise LedgerError(f"{path} is not a lance-cf ledger ({err}): {fix}") from err
        # Ours: marked, or (ledgers from before the mark) unmarked with our tables only.
        ours = app_id == APPLICATION_ID or (app_id == 0 and "meta" in tables and tables <= OUR_TABLES)
        if tables and not ours:
            self.db.close()
            raise LedgerError(f"{path} is a SQLite database of something else, not a lance-cf ledger: {fix}")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        if app_id != APPLICATION_ID:
            self.db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        self.db.executescript(SCHEMA)
        for table in ("stage_outputs", "outputs"):  # ledgers written before checksums: their rows stay unchecked
            columns = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if "sha256" not in columns:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN sha256 TEXT")

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

    def stage_outcomes(self, keys: list[str], stage: str) -> tuple[dict[str, dict[str, Any]], set[str], set[str]]:
        """For ``keys`` at ``stage``: (stored outputs by key, keys with a failure, keys with an error)."""
        outputs, failed, errored = {}, set(), set()
        for key in keys:
            row = self.db.execute(
                "SELECT payload, sha256 FROM stage_outputs WHERE source_key=? AND stage=?", (key, stage)
            ).fetchone()
            if row is not None:
                payload, checksum = row
                if checksum is not None and _sha256(payload) != checksum:
                    raise LedgerError(
                        f"{self.path}: the stored output of stage {stage} for {key} does not match its checksum "
                        "(the ledger was modified or damaged); use a new --output directory"
                    )
                outputs[key] = decode_payload(payload)
                continue
            if self.db.execute("SELECT 1 FROM failures WHERE source_key=? AND stage=?", (key, stage)).fetchone():
                failed.add(key)
            elif self.db.execute("SELECT 1 FROM errors WHERE source_key=? AND stage=?", (key, stage)).fetchone():
                errored.add(key)
        return outputs, failed, errored

    def failures(self) -> list[tuple[str, str, str]]:
        return self.db.execute("SELECT source_key, stage, reason FROM failures ORDER BY source_key, stage").fetchall()

    def errors(self) -> list[tuple[str, str, str]]:
        return self.db.execute("SELECT source_key, stage, message FROM errors ORDER BY source_key, stage").fetchall()

    # Writers below are called inside a transaction by the engine.
    def record_stage(
        self,
        batch: int,
        stage: str,
        updates: dict[str, dict[str, Any]],
        failures: dict[str, str],
        errors: dict[str, str] | None = None,
    ) -> None:
        rows = []
        for key, update in updates.items():
            payload = encode_payload(update)
            rows.append((key, stage, payload, _sha256(payload)))
        self.db.executemany("INSERT OR REPLACE INTO stage_outputs VALUES (?, ?, ?, ?)", rows)
        self.db.executemany(
            "INSERT OR REPLACE INTO failures VALUES (?, ?, ?)", [(k, stage, r) for k, r in failures.items()]
        )
        self.db.executemany(
            "INSERT OR REPLACE INTO errors VALUES (?, ?, ?)", [(k, stage, m) for k, m in (errors or {}).items()]
        )
        self.db.execute("INSERT OR REPLACE INTO stage_batches VALUES (?, ?)", (batch, stage))

    def record_failure(self, key: str, stage: str, reason: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO failures VALUES (?, ?, ?)", (key, stage, reason))

    def record_outputs(self, batch: int, rows: list[tuple[str, str, str, bytes, bytes]]) -> None:
        self.db.executemany(
            "INSERT OR REPLACE INTO outputs VALUES (?, ?, ?, ?, ?, ?)",
            [(*row, _sha256(row[3], row[4])) for row in rows],
        )
        self.db.execute("INSERT OR REPLACE INTO done_batches VALUES (?)", (batch,))
        for stage in self.drop_when_done:
            self.db.execute(
                "DELETE FROM stage_outputs WHERE stage=? AND source_key IN (SELECT source_key FROM plan WHERE batch=?)",
                (stage, batch),
            )

    def iter_stage_structures(self, stage: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every stored output of ``stage`` in key order, as its JSON structure: images and tensors are left as
        ``{"__png__": i}`` / ``{"__tensor__": i}`` references, not decoded (for counting what a stage decided)."""
        for key, payload, checksum in self.db.execute(
            "SELECT source_key, payload, sha256 FROM stage_outputs WHERE stage=? ORDER BY source_key", (stage,)
        ):
            if checksum is not None and _sha256(payload) != checksum:
                raise LedgerError(
                    f"{self.path}: the stored output of stage {stage} for {key} does not match its checksum "
                    "(the ledger was modified or damaged); use a new --output directory"
                )
            yield key, payload_structure(payload)

    def has_worked(self, stage: str) -> bool:
        """Whether ``stage`` has stored an output for any sample of this build."""
        return self.db.execute("SELECT 1 FROM stage_outputs WHERE stage=? LIMIT 1", (stage,)).fetchone() is not None

    def batch_keys(self, batch: int) -> list[str]:
        return [
            r[0] for r in self.db.execute("SELECT source_key FROM plan WHERE batch=? ORDER BY source_key", (batch,))
        ]

    def key_batches(self, keys: list[str]) -> dict[str, int]:
        out = {}
        for key in keys:
            row = self.db.execute("SELECT batch FROM plan WHERE source_key=?", (key,)).fetchone()
            if row is not None:
                out[key] = row[0]
        return out

    def reopen(self, batch: int, stages: list[str]) -> None:
        """Make ``batch`` run ``stages`` again for all its samples: their stored outputs, failures and errors at
        those stages go, with the batch's release samples and done mark. Called inside a transaction.

        The whole batch reruns (not only the samples that raised) so that each stage sees the same batch it would
        have seen had nothing gone wrong: a retried build ends byte-identical to an uninterrupted one.
        """
        for key in self.batch_keys(batch):
            for stage in stages:
                self.db.execute("DELETE FROM stage_outputs WHERE source_key=? AND stage=?", (key, stage))
                self.db.execute("DELETE FROM failures WHERE source_key=? AND stage=?", (key, stage))
                self.db.execute("DELETE FROM errors WHERE source_key=? AND stage=?", (key, stage))
            self.db.execute("DELETE FROM outputs WHERE source_key=?", (key,))
        self.db.execute("DELETE FROM done_batches WHERE batch=?", (batch,))

    # -- release --------------------------------------------------------------------------------------------------
    def iter_outputs(self, config: str) -> Iterator[tuple[str, str, bytes, bytes]]:
        """A config's release samples in key order, each checked against the checksum stored with it."""
        for key, source_key, metadata, image, checksum in self.db.execute(
            "SELECT key, source_key, metadata, image, sha256 FROM outputs WHERE config=? ORDER BY key", (config,)
        ):
            if checksum is not None and _sha256(metadata, image) != checksum:
                raise LedgerError(
                    f"{self.path}: stored sample {config}/{key} does not match its checksum (the ledger was modified "
                    "or damaged); nothing was released from it: use a new --output directory"
                )
            yield key, source_key, metadata, image


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


def payload_structure(payload: bytes) -> dict[str, Any]:
    """The JSON part of a payload, blobs left as references (cheap: nothing is decoded)."""
    n = int.from_bytes(payload[:4], "big")
    sizes = json.loads(payload[4 : 4 + n])
    return json.loads(payload[4 + n : 4 + n + sizes[0]])


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
