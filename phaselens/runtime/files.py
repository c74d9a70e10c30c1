"""Atomic, non-destructive writes of the files and directories phaselens produces.

Two rules hold for every writer (model checkpoints, the report, map checkpoints, caches, training state):

* **Nothing of the user's is deleted.** A directory that holds files phaselens did not write is refused
  with an :class:`~phaselens.core.errors.OutputError` unless ``overwrite=True``; even then only phaselens's own
  files are replaced and every other file stays as it was. A path that is a file is never replaced by a
  directory (nor the reverse).
* **A kill at any instant loses nothing.** A single file is written beside its target and renamed over it
  (``os.replace``). A new directory is written beside its target and renamed into place. An existing
  directory is updated in place through a journal: the new files are written into a hidden stage inside it,
  the stage is committed with one rename (``.phaselens-new-*``, holding the list of files to move), and the
  files are then moved into place. A kill before the commit leaves the old version; a kill after it is
  rolled forward by :func:`recover_dir`, which every loader and the next write call, so the target always
  reads as the old or the new complete version.

New directories get the user's normal permissions (``0o777`` less the umask), like ``mkdir`` does.
``FAULT_HOOK`` lets tests kill a writer at a named point (e.g. between two renames).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phaselens.core.errors import OutputError

STAGE = ".phaselens-tmp-"  # a stage being written (incomplete)
COMMITTED = ".phaselens-new-"  # a complete stage whose files are being moved into place
DONE = ".phaselens-done-"  # a stage whose files are all in place: only its deletion was left
JOURNAL = ".phaselens-journal.json"
TRASH = ".phaselens-trash"

#: Called with the name of each fault point a writer passes (tests set it to kill the process there).
FAULT_HOOK: Callable[[str], None] | None = None

_TOKEN = re.compile(r"-(\d+)-[0-9a-f]{8}$")


def _fault(point: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(point)


def _token() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def _alive(name: str) -> bool:
    """Whether the process that created the temporary ``name`` may still be running (unknown counts as alive)."""
    m = _TOKEN.search(name)
    if m is None:
        return True
    pid = int(m.group(1))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _clean_stale(folder: Path, prefix: str) -> None:
    """Remove temporaries ``prefix*`` in ``folder`` left by processes that no longer run."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and not _alive(name):
            _remove(folder / name)


def _fsync(path: Path, *, directory: bool = False) -> None:
    """Flush ``path`` to disk so a power cut cannot reorder the data behind the rename (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for f in files:
            _fsync(Path(folder) / f)
    _fsync(root, directory=True)


def _umask() -> int:
    """The process's umask, read without changing it where the OS allows (Linux), else by the usual swap."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_modes(root: Path) -> None:
    """Give what a writer made under ``root`` the modes a plain ``open``/``mkdir`` would (some libraries, e.g.
    safetensors, create files 0600)."""
    mask = _umask()
    for folder, dirs, names in os.walk(root):
        for d in dirs:
            os.chmod(Path(folder) / d, 0o777 & ~mask)
        for n in names:
            os.chmod(Path(folder) / n, 0o666 & ~mask)


def _refuse_dir(path: Path) -> None:
    if path.is_dir():
        raise OutputError(f"{path} is a directory, but a file goes there; pass a file path (e.g. {path / 'x'}).")


# ---- single files ---------------------------------------------------------------------------------------
def atomic_write_file(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` to write a temporary beside ``path``, then rename it over ``path`` (atomic).

    The caller decides whether an existing ``path`` may be replaced (it must be phaselens's own file).
    """
    path = Path(path)
    _refuse_dir(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(path.parent, f".{path.name}.tmp-")
    tmp = path.parent / f".{path.name}.tmp-{_token()}"
    try:
        write(tmp)
        try:  # an existing file keeps its mode; a new one gets the umask's
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError:
            mode = 0o666 & ~_umask()
        os.chmod(tmp, mode)
        _fsync(tmp)
        _fault("file:written")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent, directory=True)
    _fault("file:replaced")
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


# ---- directories ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DirKind:
    """A kind of output directory.

    Attributes:
        what: how messages name it (``"model checkpoint"``, ``"report"``).
        owned: the names, in an existing directory, that a previous output of this kind wrote (what may be
            replaced or removed); everything else there belongs to the user.
    """

    what: str
    owned: Callable[[Path], frozenset[str]]


def _entries(target: Path) -> set[str]:
    return {n for n in os.listdir(target) if not n.startswith((STAGE, COMMITTED, DONE))}


def _survey(target: Path, kind: DirKind) -> tuple[frozenset[str], list[str]]:
    """(owned names, sorted foreign names) of an existing directory."""
    entries = _entries(target)
    owned = frozenset(kind.owned(target)) & entries
    return owned, sorted(entries - owned)


def _foreign_error(target: Path, kind: DirKind, foreign: list[str]) -> OutputError:
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return OutputError(
        f"{target} already holds files phaselens did not write ({shown}); choose a new or empty directory, "
        f"or pass overwrite=True (--force on the command line) to replace only phaselens's own {kind.what} "
        "files there and keep the others."
    )


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: where a file or folder at ``path`` would be created
    (missing folders in between are made on the first write)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable(folder: Path) -> bool:
    """Whether new entries can be made in ``folder`` (write and search permission)."""
    return os.access(folder, os.W_OK | os.X_OK)


def check_output_dir(target: str | os.PathLike, kind: DirKind, *, overwrite: bool = False) -> Path:
    """Raise :class:`OutputError` now if :func:`atomic_write_dir` would refuse ``target`` (check before a
    long computation): a path that is a file, an unwritable location, or foreign files without ``overwrite``."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{target} is a file, not a directory; choose a directory path for the {kind.what}.")
    if target.is_dir():
        _, foreign = _survey(target, kind)
        if foreign and not overwrite:
            raise _foreign_error(target, kind, foreign)
        where = target
    else:
        where = nearest_existing(target.parent)
        if not where.is_dir():
            raise OutputError(f"{where} is a file, so {target} cannot be created; choose another path.")
    if not writable(where):
        raise OutputError(f"{where} is not writable, so the {kind.what} cannot be written to {target}; "
                          "choose a writable path.")
    return target


def atomic_write_dir(
    target: str | os.PathLike, write: Callable[[Path], None], *, kind: DirKind, overwrite: bool = False
) -> Path:
    """Call ``write(stage)`` to write a complete output into an empty folder, then put it at ``target``.

    A missing ``target`` appears in one rename. An existing ``target`` may hold only a previous output of
    ``kind`` unless ``overwrite=True``; its files are replaced through a committed journal (see the module
    docstring), and previous files of ``kind`` that the new output lacks are removed. Files of the user's
    are never touched: one whose name the new output needs is refused even with ``overwrite``.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise OutputError(
            f"{target} is a file, not a directory; phaselens will not replace it. Choose a directory path for "
            f"the {kind.what}."
        )
    if target.is_dir():
        recover_dir(target)
        _, foreign = _survey(target, kind)
        if foreign and not overwrite:
            raise _foreign_error(target, kind, foreign)
        _write_in_place(target, write, kind)
    else:
        _write_new(target, write, kind)
    return target


def _write_new(target: Path, write: Callable[[Path], None], kind: DirKind) -> None:
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(parent, f".{target.name}.tmp-")
    tmp = parent / f".{target.name}.tmp-{_token()}"
    os.mkdir(tmp)  # mode 0o777 & ~umask, as the user's own mkdir would give
    try:
        write(tmp)
        _normal_modes(tmp)
        _fsync_tree(tmp)
        _fault("dir:written")
        try:
            os.rename(tmp, target)
        except OSError as err:
            raise OutputError(f"{target} appeared while the {kind.what} was being written ({err}); write again.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(parent, directory=True)


def _write_in_place(target: Path, write: Callable[[Path], None], kind: DirKind) -> None:
    _clean_stale(target, STAGE)
    stage = target / f"{STAGE}{_token()}"
    os.mkdir(stage)
    try:
        write(stage)
        names = sorted(os.listdir(stage))
        owned, _ = _survey(target, kind)
        clash = [n for n in names if os.path.lexists(target / n) and n not in owned]
        if clash:
            raise OutputError(
                f"{target / clash[0]} exists and was not written by phaselens; the {kind.what} needs that name. "
                "Move the file away or choose another directory (phaselens replaces only its own files)."
            )
        if JOURNAL in names or TRASH in names:
            raise OutputError(f"a writer produced the reserved name {JOURNAL!r} or {TRASH!r}.")
        _normal_modes(stage)
        journal = {"put": names, "remove": sorted(owned - set(names))}
        (stage / JOURNAL).write_text(json.dumps(journal))
        _fsync_tree(stage)
        _fault("dir:written")
        committed = target / f"{COMMITTED}{stage.name[len(STAGE):]}"
        os.rename(stage, committed)  # the commit point: from here on the new version is the one
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _fsync(target, directory=True)
    _fault("dir:committed")
    _roll_forward(target, committed)


def _roll_forward(target: Path, committed: Path) -> None:
    """Move a committed stage's files into place; idempotent, so a rerun after a kill completes it."""
    try:
        journal = json.loads((committed / JOURNAL).read_text())
        put, remove = list(journal["put"]), list(journal["remove"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise OutputError(
            f"{committed} is an interrupted write whose journal cannot be read ({err}); delete that folder."
        ) from None
    trash = committed / TRASH
    for name in put:
        src, dst = committed / name, target / name
        if not os.path.lexists(src):
            continue  # moved before an interruption (or by a concurrent recovery)
        try:
            if dst.is_dir() and not dst.is_symlink():
                trash.mkdir(exist_ok=True)
                if os.path.lexists(trash / name):
                    shutil.rmtree(dst, ignore_errors=True)
                else:
                    os.rename(dst, trash / name)
            os.replace(src, dst)
        except FileNotFoundError:
            continue
        _fault("dir:moved")
    for name in remove:
        if os.path.lexists(target / name):
            _remove(target / name)
    # renamed before deleting: a kill inside rmtree must not leave a "committed" stage without its journal
    done = target / f"{DONE}{committed.name[len(COMMITTED):]}"
    try:
        os.rename(committed, done)
    except FileNotFoundError:
        return  # a concurrent recovery finished it
    _fsync(target, directory=True)
    shutil.rmtree(done, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def recover_dir(target: str | os.PathLike) -> bool:
    """Finish any committed write into ``target`` that a kill interrupted, and drop stages of dead writers.

    Returns whether a write was completed. Loaders call this first, so they never see a half-moved version.
    """
    target = Path(target)
    try:
        names = os.listdir(target)
    except OSError:
        return False
    pending = sorted((target / n for n in names if n.startswith(COMMITTED)), key=_mtime)
    for committed in pending:
        if committed.is_dir():
            _roll_forward(target, committed)
    for n in names:
        if (n.startswith(STAGE) and not _alive(n)) or n.startswith(DONE):
            shutil.rmtree(target / n, ignore_errors=True)
    return bool(pending)
