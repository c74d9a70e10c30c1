"""What the operating system refused, said in words: one translation of ``OSError`` for every reader and writer.

Writers (model save, report, result journals, caches, training state, command-line outputs) turn an ``OSError``
into an :class:`~phaselens.errors.OutputError`; readers into a
:class:`~phaselens.errors.CheckpointError`. A file that cannot be *read* (permission, a directory in its
place, an I/O error) is never called corrupt and never comes with the advice to delete it: only a file that
was read and proven malformed is (see :mod:`phaselens.storage.resumable`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from phaselens.errors import CheckpointError, OutputError

NAME_MAX = 255  # the longest single name most file systems allow (ext4, xfs, btrfs, APFS, NTFS)


def _long_name(path: Path) -> str:
    longest = max((p for p in Path(path).parts), key=len, default="")
    return f"a name of {len(longest)} characters (most file systems allow {NAME_MAX})" if len(longest) > NAME_MAX \
        else f"a path of {len(str(path))} characters"


def why_not_written(err: OSError, path: str | os.PathLike) -> str:
    """The cause of a failed write of ``path`` and what to do, in one sentence (no traceback needed)."""
    path = Path(path)
    return _said(err, {
        (errno.ENOSPC, getattr(errno, "EDQUOT", -1)): (
            f"the disk is full (no space left on the device holding {path.parent}); free some space or write "
            "elsewhere. Nothing was replaced: the previous version, if any, is intact."),
        (errno.EACCES, errno.EPERM): (
            f"permission denied writing {path}; choose a folder you can write to, or change its permissions."),
        (errno.EROFS,): f"{path} is on a read-only file system; choose a writable place.",
        (errno.ENAMETOOLONG,): f"the file name is too long ({_long_name(path)}): {str(path)[:80]}...; choose a shorter name.",
        (errno.ENOTDIR,): f"a part of {path} is a file, not a folder; choose another path.",
        (errno.EISDIR,): f"{path} is a directory, but a file goes there; pass a file path.",
        (errno.ENOENT,): f"a folder on the way to {path} does not exist (or was removed while writing); create it first.",
        (errno.EEXIST,): f"{path} appeared while phaselens was writing it; write again.",
    }, f"{path} could not be written ({err.strerror or err}); check the path and the disk.")


def why_not_read(err: OSError, path: str | os.PathLike) -> str:
    """The cause of a failed read of ``path`` (the file was not changed, and is not known to be damaged)."""
    path = Path(path)
    return _said(err, {
        (errno.EACCES, errno.EPERM): (
            f"{path} cannot be read: permission denied. The file itself may be fine: give yourself read permission "
            f"(e.g. chmod u+r {path}) or run as its owner."),
        (errno.EISDIR,): f"{path} is a directory, but a file is needed there.",
        (errno.ENAMETOOLONG,): f"the file name is too long ({_long_name(path)}); pass a shorter path.",
        (errno.ENOENT,): f"{path} is missing.",
        (errno.EIO,): f"{path} cannot be read: an input/output error from the disk ({err.strerror}); check the device.",
    }, f"{path} cannot be read ({err.strerror or err}); check that it exists and that you may read it.")


def _said(err: OSError, by_code: dict[tuple[int, ...], str], otherwise: str) -> str:
    """The sentence for ``err``'s errno (the first entry whose codes hold it), else ``otherwise``."""
    return next((said for codes, said in by_code.items() if err.errno in codes), otherwise)


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn an ``OSError`` raised inside the block into an :class:`OutputError` naming the cause and the fix."""
    try:
        yield
    except OSError as err:
        raise OutputError(why_not_written(err, path)) from err
    except Exception as err:
        os_err = _wrapped_os_error(err)
        if os_err is None:
            raise
        raise OutputError(why_not_written(os_err, path)) from err


def _wrapped_os_error(err: Exception) -> OSError | None:
    """The ``OSError`` inside a library's own error: safetensors writes its files in Rust and reports the OS's
    refusal as ``SafetensorError("... I/O error: Permission denied (os error 13) ...")``."""
    import re

    found = re.search(r"\(os error (\d+)\)", str(err)) if type(err).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


@contextmanager
def reading(path: str | os.PathLike, *, error: type[Exception] = CheckpointError) -> Iterator[None]:
    """Turn an ``OSError`` raised inside the block into ``error`` saying why the file could not be read."""
    try:
        yield
    except OSError as err:
        raise error(why_not_read(err, path)) from err


def why_os_error(err: OSError) -> str:
    """An ``OSError`` whose read or write side is unknown (the command line's last resort), in words."""
    path = err.filename if err.filename is not None else "a file"
    code = err.errno
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return f"the disk is full (no space left on the device holding {path}); free some space or write elsewhere."
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied for {path}; choose a path you may read and write, or change its permissions."
    if code == errno.EROFS:
        return f"{path} is on a read-only file system; choose a writable place."
    if code == errno.ENAMETOOLONG:
        return f"the file name is too long ({_long_name(Path(str(path)))}); choose a shorter name."
    if code in (errno.ENOENT, errno.ENOTDIR):
        return f"{path}: {err.strerror}; check the path (a folder on the way is missing, or is a file)."
    return f"{path}: {err.strerror or err}."
