"""Checks of an output directory a command will create or fill, before any work (and any model) starts.

A typo in ``--output`` (a parent that is a file, a folder name longer than the file system allows, a place the user
cannot write) would otherwise surface as a traceback from ``mkdir`` after the source was listed, or, for commands
that write at the end, after every model has run. ``output_problem`` says what is wrong in one line, naming the path
and the fix.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# The usual NAME_MAX where the file system does not say (pathconf is POSIX-only).
DEFAULT_NAME_MAX = 255


def output_problem(output: Path, flag: str = "--output", *, file_ok: bool = False) -> str | None:
    """Why ``output`` cannot be created or written as a directory (``file_ok``: as a file), or None.

    Checks, without creating anything: every name in the path fits the file system's name limit; the nearest
    existing ancestor is a directory this process may write into; an existing ``output`` is a directory (or a file
    when ``file_ok``).
    """
    output = Path(os.path.abspath(os.path.expanduser(output)))
    existing = output
    while not _exists(existing):
        existing = existing.parent
    limit = _name_max(existing if existing.is_dir() else existing.parent)
    for name in output.parts:
        if len(os.fsencode(name)) > limit:
            shown = name if len(name) <= 40 else f"{name[:20]}…{name[-12:]}"
            return (
                f"{flag} {shown!r}: a name of {len(os.fsencode(name))} bytes is longer than this file system allows "
                f"({limit}); choose a shorter name"
            )
    if existing == output:
        if output.is_dir():
            if os.access(output, os.W_OK | os.X_OK):
                return None
            why = "a read-only file system" if _read_only(output) else "not writable by this user"
            return f"{flag} {output}: {why}; give a writable {flag} directory"
        if file_ok:
            return None if os.access(output, os.W_OK) else f"{flag} {output}: not writable by this user"
        return f"{flag} {output} is a file; give a directory (new, empty, or an earlier output of this command)"
    if not existing.is_dir():
        return f"{flag} {output}: {existing} is a file, so nothing can be created under it; choose another path"
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only(existing) else "not writable by this user"
        return f"{flag} {output}: cannot create it in {existing} ({why}); give a writable {flag} directory"
    return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            return False
        raise
    return True


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return DEFAULT_NAME_MAX
