"""One process at a time on an output directory: an advisory ``flock`` held for a command's whole life.

Two builds into one directory used to interleave their ledger commits and shard writes and could both exit 0 over a
wrong release. Now ``build`` holds an exclusive lock on the directory for its whole life; ``publish`` holds an
exclusive one and ``verify`` a shared one (several verifies may run together, never beside a build or a publish).
A process that cannot get the lock stops at once with one line naming the holder's pid and command. ``lance-cf eval``
holds its ``--output`` the same way (evaluation may import the release format, not the builder: that is why the lock
lives here).

The lock is taken on the directory itself (``flock`` on a directory descriptor), so a read-only release can still be
verified; the holder's pid and command are written, when the directory is writable, to ``.lance-cf/lock`` for the
refusal message. The kernel drops the lock when the holder exits, ``kill -9`` included: there is no stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from builder.release_format.layout import WORK_DIR

LOCK_INFO = "lock"


class OutputLocked(ValueError):
    """Another lance-cf process holds the directory."""


def _info_path(directory: Path) -> Path:
    return directory / WORK_DIR / LOCK_INFO


def lock_holder(directory: str | os.PathLike) -> dict | None:
    """Who holds ``directory`` now (``{"pid": ..., "command": ...}``), or ``None`` when nobody does."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_info(directory)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_info(directory: Path) -> dict:
    try:
        info = json.loads(_info_path(directory).read_text())
        if isinstance(info, dict):
            return info
    except (OSError, ValueError):
        pass
    return {"pid": None, "command": None}


@contextlib.contextmanager
def output_lock(directory: str | os.PathLike, command: str, *, shared: bool = False) -> Iterator[None]:
    """Hold ``directory`` for ``command`` (exclusive, or shared for readers) until the block ends.

    Raises ``OutputLocked`` at once (never waits) when another process holds it in a conflicting mode.
    """
    directory = Path(directory)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_info(directory)
            who = f"pid {holder.get('pid')}" if holder.get("pid") else "another process"
            what = f" ({holder['command']})" if holder.get("command") else ""
            raise OutputLocked(
                f"{directory} is in use by lance-cf {who}{what}; wait for it to finish, or use another directory"
            ) from None
        if not shared:
            _write_info(directory, command)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _write_info(directory: Path, command: str) -> None:
    """Best effort: a read-only directory is locked all the same, its refusal message just names no pid."""
    path = _info_path(directory)
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{LOCK_INFO}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "command": command}) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
