"""Atomic, non-destructive writes of the files and directories phaselens produces.

One ownership rule holds for every writer (model checkpoints, the report, result journals, caches,
training state, command-line outputs): **a file is phaselens's only if phaselens's own record says it wrote
it and nobody changed it since** (:mod:`phaselens.storage.manifest`: the folder's ``.phaselens-manifest.json``
with each file's sha256, or, for safetensors files, their own phaselens header). Never from a name or an
extension.

* **Nothing of the user's is removed or changed.** A directory that holds files phaselens did not write is
  refused with an :class:`~phaselens.errors.OutputError` unless ``overwrite=True``; even then only
  phaselens's own files are replaced, and every other file stays as it was, also inside phaselens's own
  sub-folders (a PNG of yours in a report's ``figures/``). A file of yours whose name phaselens needs is
  refused even with ``overwrite``. A single output file (``--out FILE``) that phaselens cannot prove it wrote
  is replaced only with ``overwrite=True`` (``--force``), the user naming that very file.
* **A kill at any instant loses nothing.** A single file is written beside its target and renamed over it
  (``os.replace``). A new directory is written beside its target and renamed into place. An existing
  directory is updated in place through a commit record (:mod:`phaselens.storage.in_place`); a kill before its
  commit leaves the old version, a kill after it is rolled forward by :func:`recover_dir`, which every
  loader and the next write call.
* **What the OS refuses is said in words**: a full disk, a permission, a name too long
  (:mod:`phaselens.storage.oserrors`), as an :class:`OutputError`.

New directories get the user's normal permissions (``0o777`` less the umask), like ``mkdir`` does.
``FAULT_HOOK`` lets tests kill a writer at a named point (e.g. between two renames).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from phaselens.errors import OutputError
from phaselens.storage import manifest as mf
from phaselens.storage.in_place import (  # noqa: F401 - the names files.STAGE etc. are part of the API
    COMMITTED,
    DONE,
    RECORD,
    STAGE,
    TRASH,
    DirKind,
    clean_stale,
    fsync,
    fsync_tree,
    normal_modes,
    stage_dirs,
    stage_files,
    survey,
    token,
    umask,
)
from phaselens.storage.in_place import recover_dir as _recover
from phaselens.storage.in_place import write_in_place as _write_in_place
from phaselens.storage.oserrors import writing

MANIFEST = mf.MANIFEST

#: Called with the name of each fault point a writer passes (tests set it to kill the process there).
FAULT_HOOK: Callable[[str], None] | None = None


def _fault(point: str) -> None:
    if FAULT_HOOK is not None:
        FAULT_HOOK(point)


def _refuse_unreplaceable(path: Path) -> None:
    if path.is_dir():
        raise OutputError(f"{path} is a directory, but a file goes there; pass a file path (e.g. {path / 'x'}).")
    if os.path.islink(path) or (path.exists() and not path.is_file()):  # a device, a FIFO, a socket, a link
        raise OutputError(f"{path} is not a regular file ({_what(path)}); phaselens never replaces one, even with "
                          "--force / overwrite=True: pass the path of a regular file or a new one.")


def _what(path: Path) -> str:
    if os.path.islink(path):
        return f"a symbolic link to {os.readlink(path)}"
    mode = os.lstat(path).st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


# ---- single files ---------------------------------------------------------------------------------------
def atomic_write_file(path: str | os.PathLike, write: Callable[[Path], None],
                      on_written: Callable[[Path], None] | None = None) -> Path:
    """Call ``write(tmp)`` to write a temporary beside ``path``, then rename it over ``path`` (atomic).

    ``on_written(tmp)`` runs on the complete temporary just before the rename (e.g. to record it in the
    manifest). The caller decides whether an existing ``path`` may be replaced (see :func:`write_owned_file`).
    An ``OSError`` (disk full, permission, name too long) becomes an :class:`OutputError`; the old file, if
    any, is intact.
    """
    path = Path(path)
    with writing(path):
        _refuse_unreplaceable(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(path.parent, f".{path.name}.tmp-")
        tmp = path.parent / f".{path.name}.tmp-{token()}"
        try:
            write(tmp)
            try:  # an existing file keeps its mode; a new one gets the umask's
                mode = stat.S_IMODE(path.stat().st_mode)
            except OSError:
                mode = 0o666 & ~umask()
            os.chmod(tmp, mode)
            fsync(tmp)
            if on_written is not None:
                on_written(tmp)
            _fault("file:written")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync(path.parent, directory=True)
    _fault("file:replaced")
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (the caller has checked that ``path`` may be replaced)."""
    return atomic_write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def owns_file(path: str | os.PathLike, by: str, proves: Callable[[Path], bool] | None = None) -> bool:
    """Whether the file at ``path`` is writer ``by``'s own: its folder's manifest lists it unchanged, or
    ``proves(path)`` (its own phaselens header) says so."""
    path = Path(path)
    if not mf.is_plain_file(path):
        return False
    if path.name in mf.owned_by(path.parent, by):
        return True
    return bool(proves is not None and proves(path))


def write_owned_file(path: str | os.PathLike, write: Callable[[Path], None], *, by: str, overwrite: bool = False,
                     proves: Callable[[Path], bool] | None = None, record: bool = True,
                     force_hint: str = "overwrite=True") -> Path:
    """Write one output file atomically under the ownership rule: an existing ``path`` is replaced only when
    phaselens can prove it wrote it (:func:`owns_file`), or with ``overwrite`` (the caller named that very
    file); ``record`` lists the new file in the folder's manifest (before the rename, with the previous
    version still accepted, so a kill leaves a provable file either way).

    Raises:
        OutputError: ``path`` is a directory, or a file phaselens cannot prove it wrote (without ``overwrite``),
            or the OS refused the write (disk full, permission, name too long).
    """
    path = Path(path)
    with writing(path):
        _refuse_unreplaceable(path)
        exists = os.path.lexists(path)
        if exists and not overwrite and not owns_file(path, by, proves):
            raise OutputError(
                f"{path} already exists and phaselens cannot show it wrote it (its manifest does not list it "
                f"unchanged), so it is kept; choose another name, or pass {force_hint} to replace that file.")
        previous = mf.owned_by(path.parent, by).get(path.name) if exists and record else None

        def note(tmp: Path) -> None:
            if record:
                new = mf.file_record(tmp, by)
                if previous is not None:
                    new["also"] = [{"sha256": previous["sha256"], "size": previous["size"]}]
                mf.update(path.parent, {path.name: new})

        atomic_write_file(path, write, on_written=note)
        if record:
            mf.update(path.parent, {path.name: mf.file_record(path, by)})
    return path


# ---- directories ----------------------------------------------------------------------------------------
def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: where a file or folder at ``path`` would be created
    (missing folders in between are made on the first write)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable(folder: Path) -> bool:
    """Whether new entries can be made in ``folder`` (write and search permission)."""
    return os.access(folder, os.W_OK | os.X_OK)


def foreign_error(target: Path, kind: DirKind, foreign: list[str]) -> OutputError:
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    return OutputError(
        f"{target} already holds files phaselens did not write ({shown}); choose a new or empty directory, "
        f"or pass overwrite=True (--force on the command line) to replace only phaselens's own {kind.what} "
        "files there and keep the others."
    )


def check_output_dir(target: str | os.PathLike, kind: DirKind, *, overwrite: bool = False) -> Path:
    """Raise :class:`OutputError` now if :func:`atomic_write_dir` would refuse ``target`` (check before a
    long computation): a path that is a file, an unwritable location, or foreign files without ``overwrite``."""
    target = Path(target)
    with writing(target):
        if target.exists() and not target.is_dir():
            raise OutputError(f"{target} is a file, not a directory; choose a directory path for the {kind.what}.")
        if target.is_dir():
            recover_dir(target)
            _, foreign = survey(target, kind)
            if foreign and not overwrite:
                raise foreign_error(target, kind, foreign)
            where = target
        else:
            where = nearest_existing(target.parent)
            if not where.is_dir():
                raise OutputError(f"{where} is a file, so {target} cannot be created; choose another path.")
        if not writable(where):
            raise OutputError(f"{where} is not writable (permission denied), so the {kind.what} cannot be written "
                              f"to {target}; choose a writable path.")
    return target


def atomic_write_dir(
    target: str | os.PathLike, write: Callable[[Path], None], *, kind: DirKind, overwrite: bool = False
) -> Path:
    """Call ``write(stage)`` to write a complete output into an empty folder, then put it at ``target``.

    A missing ``target`` appears in one rename. An existing ``target`` may hold only a previous output of
    ``kind`` unless ``overwrite=True``; its files are replaced through a committed record, and previous
    files of ``kind`` that the new output lacks are removed. Files of the user's (anything the manifest does
    not prove to be this kind's) are never touched: one whose path the new output needs is refused even
    with ``overwrite``. The manifest of ``target`` lists every file written.
    """
    target = Path(target)
    with writing(target):
        if target.exists() and not target.is_dir():
            raise OutputError(
                f"{target} is a file, not a directory; phaselens will not replace it. Choose a directory path for "
                f"the {kind.what}."
            )
        if target.is_dir():
            recover_dir(target)
            _, foreign = survey(target, kind)
            if foreign and not overwrite:
                raise foreign_error(target, kind, foreign)
            _write_in_place(target, write, kind, _fault)
        else:
            _write_new(target, write, kind)
    return target


def _write_new(target: Path, write: Callable[[Path], None], kind: DirKind) -> None:
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale(parent, f".{target.name}.tmp-")
    tmp = parent / f".{target.name}.tmp-{token()}"
    os.mkdir(tmp)  # mode 0o777 & ~umask, as the user's own mkdir would give
    try:
        write(tmp)
        names = stage_files(tmp)
        normal_modes(tmp)
        dirs = {d: kind.what for d in stage_dirs(tmp)}
        records = {n: mf.file_record(tmp / n, kind.what) for n in names}
        (tmp / MANIFEST).write_text(mf.manifest_text(records, dirs), encoding="utf-8")
        os.chmod(tmp / MANIFEST, 0o666 & ~umask())
        fsync_tree(tmp)
        _fault("dir:written")
        try:
            os.rename(tmp, target)
        except OSError as err:
            raise OutputError(f"{target} appeared while the {kind.what} was being written ({err}); write again.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(parent, directory=True)


def recover_dir(target: str | os.PathLike) -> bool:
    """Finish any committed write into ``target`` that a kill interrupted (see :mod:`phaselens.storage.in_place`)."""
    return _recover(target, _fault)
