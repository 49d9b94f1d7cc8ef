"""Judgements as data: a SQLite database in the release's work directory (``.lance-cf/review.sqlite``).

WAL mode with full synchronous commits: a judgement is on disk when the page is told it was saved, so a killed server
loses nothing, and two reviewers (two servers, or two pages on one) write at once without blocking each other's
reads. Every judgement is one row (reviewer, time, study, sample, question, answer, reason) and rows are only ever
appended: going back and judging a sample again adds rows, and the latest per (reviewer, sample, question) counts.
Each row also names the release it judged (the manifest's sha256), so judgements of a rebuilt release are not
mistaken for judgements of this one.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import release_format as rf

DB_NAME = "review.sqlite"
APPLICATION_ID = 0x4C43_5256  # "LCRV": the file is ours (a stranger's SQLite file is refused by name)
VERDICT = "verdict"  # the question id of the accept / reject / flag decision
VERDICTS = ("accept", "reject", "flag")

SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (name TEXT PRIMARY KEY, spec TEXT NOT NULL, release TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS judgements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    release TEXT NOT NULL,
    study TEXT NOT NULL,
    reviewer TEXT NOT NULL,
    config TEXT NOT NULL,
    key TEXT NOT NULL,
    question TEXT NOT NULL,
    answer TEXT NOT NULL,
    reason TEXT,
    at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS judgements_by_item ON judgements (study, reviewer, config, key, question);
"""


@dataclass(frozen=True)
class Judgement:
    """One stored answer (the verdict is the question ``verdict``)."""

    id: int
    release: str
    study: str
    reviewer: str
    config: str
    key: str
    question: str
    answer: str
    reason: str | None
    at: str


def store_path(release_dir: Path) -> Path:
    return Path(release_dir) / rf.WORK_DIR / DB_NAME


class JudgementStore:
    """The judgements of one release directory. Connections are opened per operation (safe across threads)."""

    def __init__(self, release_dir: Path, release_sha: str) -> None:
        self.path = store_path(release_dir)
        self.release_sha = release_sha
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            found = db.execute("PRAGMA application_id").fetchone()[0]
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if found not in (0, APPLICATION_ID) or (found == 0 and tables - {"sqlite_sequence"}):
                raise ValueError(f"{self.path}: not a lance-cf review database; move it away and start again")
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            db.execute(f"PRAGMA application_id={APPLICATION_ID}")

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA busy_timeout=30000")
            yield db
        finally:
            db.close()

    # -- studies ----------------------------------------------------------------------------------------------------
    def study_spec(self, name: str) -> dict[str, Any] | None:
        with self._connect() as db:
            row = db.execute("SELECT spec FROM studies WHERE name=?", (name,)).fetchone()
        return json.loads(row[0]) if row else None

    def studies(self) -> list[str]:
        with self._connect() as db:
            return [r[0] for r in db.execute("SELECT name FROM studies ORDER BY name")]

    def save_study(self, name: str, spec: dict[str, Any]) -> None:
        """Record a study's spec; a study keeps its spec for life (its judgements answer those questions)."""
        text = json.dumps(spec, sort_keys=True)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT spec FROM studies WHERE name=?", (name,)).fetchone()
            if row is None:
                db.execute("INSERT INTO studies VALUES (?, ?, ?)", (name, text, self.release_sha))
            db.execute("COMMIT")
        if row is not None and json.loads(row[0]) != spec:
            raise ValueError(
                f"study {name!r} already exists in {self.path} with other settings; continue it without study "
                "options (--study-name only), or start a new one with another --study-name"
            )

    # -- judgements -------------------------------------------------------------------------------------------------
    def record(
        self,
        study: str,
        reviewer: str,
        config: str,
        key: str,
        answers: dict[str, str],
        reason: str | None = None,
    ) -> None:
        """Append one judgement of a sample: every answer (the verdict included) in one transaction."""
        at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
        rows = [
            (self.release_sha, study, reviewer, config, key, q, a, reason if q == VERDICT else None, at)
            for q, a in answers.items()
        ]
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO judgements (release, study, reviewer, config, key, question, answer, reason, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            db.execute("COMMIT")

    def history(self, study: str | None = None) -> list[Judgement]:
        """Every row, oldest first (of one study when given)."""
        query = "SELECT * FROM judgements" + (" WHERE study=?" if study else "") + " ORDER BY id"
        with self._connect() as db:
            return [Judgement(*row) for row in db.execute(query, (study,) if study else ())]

    def latest(self, study: str, reviewer: str | None = None) -> dict[tuple[str, str, str, str], Judgement]:
        """The judgement that counts per (reviewer, config, key, question): the latest, of this release only."""
        query = (
            "SELECT * FROM judgements WHERE id IN (SELECT MAX(id) FROM judgements WHERE study=? AND release=?"
            + (" AND reviewer=?" if reviewer else "")
            + " GROUP BY reviewer, config, key, question) ORDER BY id"
        )
        params = (study, self.release_sha, reviewer) if reviewer else (study, self.release_sha)
        with self._connect() as db:
            rows = [Judgement(*row) for row in db.execute(query, params)]
        return {(j.reviewer, j.config, j.key, j.question): j for j in rows}

    def other_release_rows(self, study: str) -> int:
        """Rows of this study that judged another build of the release (ignored by ``latest``)."""
        with self._connect() as db:
            return db.execute(
                "SELECT COUNT(*) FROM judgements WHERE study=? AND release<>?", (study, self.release_sha)
            ).fetchone()[0]

    def export(self, path: Path, study: str | None = None) -> int:
        """Write every judgement (history included) to ``path``: ``.csv`` or ``.parquet``. Returns the row count."""
        import pandas as pd

        rows = self.history(study)
        columns = list(Judgement.__dataclass_fields__)
        frame = pd.DataFrame([[getattr(j, c) for c in columns] for j in rows], columns=columns)
        path = Path(path)
        if path.suffix == ".csv":
            frame.to_csv(path, index=False)
        elif path.suffix == ".parquet":
            frame.to_parquet(path, index=False)
        else:
            raise ValueError(f"{path}: export to a .csv or .parquet file")
        return len(frame)
