"""One process at a time on an output directory: an advisory ``flock`` held for a command's whole life.

Two builds into one directory used to interleave their ledger commits and shard writes and could both exit 0 over a
wrong release. Now ``build`` holds an exclusive lock on the directory for its whole life; ``publish`` holds an
exclusive one and ``verify`` a shared one (several verifies may run together, never beside a build or a publish).
A process that cannot get the lock stops at once with one line naming the holder's pid and command. ``lance-cf eval``
holds its ``--output`` the same way (evaluation may import the release format, not the builder: that is why the lock
lives here).

The lock is taken on the directory itself (``flock`` on a directory descriptor), so a read-only release can still be
verified; the holder's pid and command are written, when the directory is writable, to ``.lance-cf/lock`` for the
refusal message. The holder writes that note just after it takes the lock, so a process refused in between would find
no note: the holder's pid is therefore read from the kernel's own table (``/proc/locks``) where there is one, and the
note only adds the command when its pid agrees. The kernel drops the lock when the holder exits, ``kill -9``
included: there is no stale lock.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
            return _holder(directory, os.fstat(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _holder(directory: Path, stat: os.stat_result) -> dict:
    """The holder of the lock on ``directory`` (whose ``stat`` is given): the kernel's pid, with the note's command
    when the note is the same holder's; the note alone where the kernel's table cannot be read."""
    note = _read_info(directory)
    pids = _kernel_holders(stat)
    if not pids:
        return note
    if note.get("pid") in pids:
        return note
    return {"pid": min(pids), "command": None}


def _kernel_holders(stat: os.stat_result) -> set[int]:
    """The pids holding a granted flock on the file ``stat`` describes, from ``/proc/locks`` (Linux); empty elsewhere.
    A line reads ``1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF``; waiting requests carry ``->`` and are skipped."""
    ident = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    pids: set[int] = set()
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == ident and "->" not in line:
                    with contextlib.suppress(ValueError):
                        pids.add(int(fields[4]))
    except OSError:
        pass
    return pids


def _read_info(directory: Path) -> dict:
    try:
        info = json.loads(_info_path(directory).read_text())
        if isinstance(info, dict):
            return info
    except (OSError, ValueError):
        pass
    return {"pid": None, "command": None}


# The directories this process holds, by (device, inode): True for an exclusive hold. A command's body may take the
# lock its CLI already took for it (``build`` inside ``lance-cf build``): that is the same holder, not a second one.
_HELD: dict[tuple[int, int], bool] = {}


@contextlib.contextmanager
def output_lock(
    directory: str | os.PathLike, command: str, *, shared: bool = False, wait: bool = False
) -> Iterator[None]:
    """Hold ``directory`` for ``command`` (exclusive, or shared for readers) until the block ends.

    Raises ``OutputLocked`` at once when another process holds it in a conflicting mode; with ``wait`` it blocks until
    the holder is done instead (for work that is the same whoever does it, like one shared build that several
    processes need: the second finds the first's result). Taking it again inside the block, in this process, is a
    no-op where the first hold covers the second (exclusive covers both).
    """
    directory = Path(directory)
    fd = os.open(directory, os.O_RDONLY)
    stat = os.fstat(fd)
    ident = (stat.st_dev, stat.st_ino)
    if _HELD.get(ident) or (shared and ident in _HELD):
        os.close(fd)
        yield
        return
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = _holder(directory, stat)
            who = f"pid {holder.get('pid')}" if holder.get("pid") else "another process"
            what = f" ({holder['command']})" if holder.get("command") else ""
            raise OutputLocked(
                f"{directory} is in use by lance-cf {who}{what}; wait for it to finish, or use another directory"
            ) from None
        if not shared:
            _write_info(directory, command)
        _HELD[ident] = not shared
        try:
            yield
        finally:
            del _HELD[ident]
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class WritesOutput:
    """What a subcommand writes: ``directory(args)`` is the directory it writes into (a file's folder for a command
    that writes one file), or None for a run that writes nothing. Declared on the subcommand's parser
    (``declare_output``); ``lance-cf`` holds the directory's lock for the command's whole life."""

    command: str
    directory: Callable[[argparse.Namespace], str | os.PathLike | None]


NO_OUTPUT = WritesOutput("", lambda args: None)  # a command that writes no directory (verify, list, publish, ...)


def declare_output(parser: argparse.ArgumentParser, command: str, directory: Callable | None) -> None:
    """Declare what ``parser``'s command writes (``directory(args)``; None: nothing). Every subcommand declares it:
    ``tests/test_output_locks.py`` fails for one that does not."""
    parser.set_defaults(writes=NO_OUTPUT if directory is None else WritesOutput(command, directory))


def file_folder(path: str | os.PathLike | None) -> Path:
    """The folder a command's output file goes into (the current directory for a bare name or none)."""
    return Path(path).parent if path is not None else Path.cwd()


@contextlib.contextmanager
def declared_output_lock(args: argparse.Namespace) -> Iterator[None]:
    """Hold the directory ``args``' command declared (``declare_output``) for the block: a second writer of it is
    refused at once naming this process. A directory that does not exist yet is created to be locked, and removed again
    if the command leaves nothing in it; a path that is a file, or that cannot be created, is left to the command, which
    names it in its own one-line error."""
    declared: WritesOutput | None = getattr(args, "writes", None)
    target = declared.directory(args) if declared is not None else None
    if target is None:
        yield
        return
    target = Path(target)
    try:
        missing = [p for p in (target, *target.parents) if not p.exists()]
        unusable = target.exists() and not target.is_dir()
    except OSError:  # a name the file system cannot even look up (too long): the command's own check names it
        unusable = True
    if unusable:
        yield
        return
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        yield
        return
    try:
        with output_lock(target, declared.command):
            yield
    finally:
        for path in missing:  # created here: removed while they hold nothing but the lock's note
            _remove_if_unused(path)


def _remove_if_unused(path: Path) -> None:
    work = path / WORK_DIR
    try:
        if work.is_dir() and {p.name for p in work.iterdir()} <= {LOCK_INFO}:
            (work / LOCK_INFO).unlink(missing_ok=True)
            work.rmdir()
        path.rmdir()  # only when empty
    except OSError:
        pass


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
