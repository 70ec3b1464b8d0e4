"""Outputs a user names on a command line (``--out``, ``--json``, an export folder): written whole or not at all.

A command writes each output under a temporary name beside it and renames it into place once everything is
written, so an output that cannot be created (a missing parent that cannot be made, a read-only folder, a full
disk) or a write that is interrupted (Ctrl-C) leaves nothing behind but what was there before, and ends in one
line that names the path and why (:class:`OutputError`).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES})
"""Errors a command meets from the disk it was pointed at, not from a bug: full, over quota, read-only, not
allowed to write there."""


class OutputError(RuntimeError):
    """An output cannot be written where the user pointed it; the message names the path, why, and what to do."""


def describe(path: str | Path, e: OSError) -> OutputError:
    """The one line that says why ``path`` could not be written."""
    why = e.strerror or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free some space there or point the output at another disk"
    elif e.errno == errno.ENOENT:
        hint = "its folder cannot be made there; point the output at a folder you can write"
    else:
        hint = "point the output at a folder you can write"
    return OutputError(f"cannot write {path}: {why}; {hint}")


def _make_parents(folder: Path, created: list[Path]) -> None:
    """Create ``folder`` and its missing parents, each put first in ``created`` once made (so that a failure
    part-way removes exactly what was made, deepest first)."""
    missing = []
    for p in (folder, *folder.parents):
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        p.mkdir()
        created.insert(0, p)


def _remove_created(created: list[Path]) -> None:
    for p in created:  # deepest first; only folders this command made, and only if they are still empty
        try:
            p.rmdir()
        except OSError:
            break


@contextmanager
def output_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; once the block ends without error it becomes ``path``
    (an earlier file there is replaced in one rename).  On any error, Ctrl-C included, the temporary file and
    the folders made for it are removed; an ``OSError`` is raised again as :class:`OutputError`."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a folder; name a file")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    created: list[Path] = []
    try:
        _make_parents(path.parent, created)
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with suppress(OSError):  # (a read-only disk refuses even removing what is not there)
            tmp.unlink(missing_ok=True)
        _remove_created(created)
        if isinstance(e, OSError):
            raise describe(path, e) from None
        raise


@contextmanager
def output_folder(path: str | Path, marker: str) -> Iterator[Path]:
    """Yield a temporary folder beside ``path`` to fill; once the block ends without error it becomes ``path``.

    ``path`` may be new, empty, or an earlier output of the same command (it holds ``marker``, such as a
    prepared corpus's ``manifest.json``), which is replaced whole only once the new one is complete (renamed
    aside, then removed); a folder holding anything else is refused before any work is done.  On any error,
    Ctrl-C included, the temporary folder and the folders made for it are removed and what was at ``path``
    stays as it was; an ``OSError`` is raised again as :class:`OutputError`.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"cannot write {path}: it exists and is not a folder; name a new or empty folder")
    if path.is_dir() and any(path.iterdir()) and not (path / marker).exists():
        raise OutputError(f"cannot write {path}: it holds other files (no {marker} of an earlier output to "
                          f"replace); name a new or empty folder")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    created: list[Path] = []
    try:
        _make_parents(path.parent, created)
        tmp.mkdir()
        yield tmp
        if path.is_dir() and not any(path.iterdir()):  # (it may be a mount point, which cannot be renamed)
            for entry in tmp.iterdir():
                os.replace(entry, path / entry.name)
            tmp.rmdir()
        elif path.is_dir():
            aside = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, aside)
            os.replace(tmp, path)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        if isinstance(e, OSError):
            raise describe(path, e) from None
        raise


def writable_folder(path: str | Path) -> Path:
    """Create ``path`` (with its parents) for a command that writes many files into it over a long run, and
    check up front that a page can be written there: :class:`OutputError` in one line if not, before the
    command starts its work, and the folders it made for the check removed again."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"cannot write into {path}: it exists and is not a folder; name a folder")
    probe = path / f".write-test-{os.getpid()}"
    created: list[Path] = []
    try:
        _make_parents(path, created)
        probe.write_bytes(bytes(4096))  # a page: an empty file would pass on a full disk
        probe.unlink()
    except OSError as e:
        with suppress(OSError):
            probe.unlink(missing_ok=True)
        _remove_created(created)
        raise describe(path, e) from None
    return path


__all__ = ["OutputError", "DISK_ERRNOS", "describe", "output_file", "output_folder", "writable_folder"]
