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
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import release_format as rf
from builder.release_format.text_out import write_csv
from lance_pipeline.readers import load_json

DB_NAME = "review.sqlite"
APPLICATION_ID = 0x4C43_5256  # "LCRV": the file is ours (a stranger's SQLite file is refused by name)
VERDICT = "verdict"  # the question id of the accept / reject / flag decision
VERDICTS = ("accept", "reject", "flag")
REVIEWER_PATTERN = re.compile(r"^[\w][\w .@-]{0,63}$")
MAX_REASON = 500
COLUMNS = "id, release, study, reviewer, config, key, question, answer, reason, at"

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


def check_reviewer(name: Any) -> str:
    """A reviewer's name as the page and the store accept it (one line, 1-64 characters), stripped."""
    if not isinstance(name, str) or not REVIEWER_PATTERN.match(name.strip()):
        raise ValueError("reviewer: a name of 1-64 letters, digits, spaces, '.', '@' or '-'")
    return name.strip()


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
        """A connection; a file SQLite cannot read (truncated, overwritten, another schema) is one ``ValueError`` line
        naming it, whichever operation meets it."""
        try:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        except sqlite3.Error as err:
            raise ValueError(f"{self.path}: cannot open the review database ({err})") from None
        try:
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA busy_timeout=30000")
            yield db
        except sqlite3.Error as err:
            raise ValueError(
                f"{self.path}: not a readable review database ({' '.join(str(err).split())}); restore it from a "
                "backup, or move it away and review again"
            ) from None
        finally:
            db.close()

    # -- studies ----------------------------------------------------------------------------------------------------
    def study_spec(self, name: str) -> dict[str, Any] | None:
        with self._connect() as db:
            row = db.execute("SELECT spec FROM studies WHERE name=?", (name,)).fetchone()
        if row is None:
            return None
        if not isinstance(row[0], str):
            raise ValueError(f"{self.path}: study {name!r}: its stored settings are not text; move the database away")
        return load_json(row[0], f"{self.path}: study {name!r}")

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
        if row is not None and load_json(str(row[0]), f"{self.path}: study {name!r}") != spec:
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
        """Every row, oldest first (of one study when given); a row whose columns are not text is refused."""
        query = f"SELECT {COLUMNS} FROM judgements" + (" WHERE study=?" if study else "") + " ORDER BY id"
        with self._connect() as db:
            return [self._row(row) for row in db.execute(query, (study,) if study else ())]

    def latest(self, study: Any, reviewer: str | None = None) -> dict[tuple[str, str, str, str], Judgement]:
        """The judgement that counts per (reviewer, config, key, question): the latest, of this release only.

        ``study`` is the ``Study`` the judgements answer: every row is checked against it (a reviewer the study names,
        or any well-formed name when it names none; a question it asks with one of its answers; a verdict of
        ``VERDICTS``), and a row that breaks it is refused in one line naming the row: a database changed outside
        the page is not taken as the reviewers' word."""
        query = (
            f"SELECT {COLUMNS} FROM judgements WHERE id IN (SELECT MAX(id) FROM judgements WHERE study=? AND release=?"
            + (" AND reviewer=?" if reviewer else "")
            + " GROUP BY reviewer, config, key, question) ORDER BY id"
        )
        params = (study.name, self.release_sha, reviewer) if reviewer else (study.name, self.release_sha)
        with self._connect() as db:
            rows = [self._row(row) for row in db.execute(query, params)]
        for judgement in rows:
            self._check(judgement, study)
        return {(j.reviewer, j.config, j.key, j.question): j for j in rows}

    def _row(self, row: tuple[Any, ...]) -> Judgement:
        judgement = Judgement(*row)
        texts = [getattr(judgement, f) for f in Judgement.__dataclass_fields__ if f not in ("id", "reason")]
        if (
            not isinstance(judgement.id, int)
            or not all(isinstance(t, str) for t in texts)
            or not isinstance(judgement.reason, str | None)
        ):
            raise ValueError(
                f"{self.path}: judgement row {row[0]!r} holds a value that is not text; the database was changed "
                "outside lance-cf review (restore it, or move it away and review again)"
            )
        return judgement

    def _check(self, judgement: Judgement, study: Any) -> None:
        """Refuse a judgement the study could not have produced (see ``latest``)."""
        questions = {q.id: q.answers for q in study.questions}
        allowed = VERDICTS if judgement.question == VERDICT else questions.get(judgement.question)
        problem = None
        if not REVIEWER_PATTERN.match(judgement.reviewer) or judgement.reviewer != judgement.reviewer.strip():
            problem = "its reviewer is not a reviewer's name"
        elif getattr(study, "reviewers", ()) and judgement.reviewer not in study.reviewers:
            problem = "its reviewer is not one of the study's reviewers"
        elif allowed is None:
            problem = "it answers a question the study does not ask"
        elif judgement.answer not in allowed:
            problem = f"its answer is not one of {', '.join(allowed)}"
        elif judgement.reason is not None and (judgement.question != VERDICT or len(judgement.reason) > MAX_REASON):
            problem = f"its reason is not a verdict's reason of at most {MAX_REASON} characters"
        if problem:
            raise ValueError(
                f"{self.path}: judgement row {judgement.id} of study {study.name!r}: {problem}; the database was "
                "changed outside lance-cf review (restore it, or move it away and review again)"
            )

    def other_release_rows(self, study: str) -> int:
        """Rows of this study that judged another build of the release (ignored by ``latest``)."""
        with self._connect() as db:
            return db.execute(
                "SELECT COUNT(*) FROM judgements WHERE study=? AND release<>?", (study, self.release_sha)
            ).fetchone()[0]

    def export(self, path: Path, study: str | None = None, studies: dict[str, Any] | None = None) -> int:
        """Write every judgement (history included) to ``path``: ``.csv`` or ``.parquet``. Returns the row count.

        With ``studies`` (name -> ``Study``), every row is first checked against its study as ``latest`` checks the
        rows that count, so a row written outside the page is refused in one line instead of exported as a
        reviewer's word; a row of a study not given is refused too."""
        import pandas as pd

        rows = self.history(study)
        if studies is not None:
            for judgement in rows:
                if judgement.study not in studies:
                    raise ValueError(
                        f"{self.path}: judgement row {judgement.id} names study {judgement.study!r}, which the "
                        "database does not hold; the database was changed outside lance-cf review (restore it, or "
                        "move it away and review again)"
                    )
                self._check(judgement, studies[judgement.study])
        columns = list(Judgement.__dataclass_fields__)
        frame = pd.DataFrame([[getattr(j, c) for c in columns] for j in rows], columns=columns)
        path = Path(path)
        if path.suffix == ".csv":
            write_csv(frame, path)  # a reason or answer starting with '=' is text, not a spreadsheet formula
        elif path.suffix == ".parquet":
            frame.to_parquet(path, index=False)
        else:
            raise ValueError(f"{path}: export to a .csv or .parquet file")
        return len(frame)
