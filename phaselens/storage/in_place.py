"""Updating an existing output directory in place, file by file, through a committed record.

The new files are written into a hidden stage inside the directory (``.phaselens-tmp-*``); the stage, with
its commit record (which files to put, with the sha256 each replaced file must still have, which stale files of
this writer to remove, with theirs) and the directory's new manifest, is committed with one rename
(``.phaselens-new-*``); then the files are moved into place one by one. A kill before the commit leaves the
old version; a kill after it is rolled forward by :func:`recover_dir` (every loader and the next write call
it), so the directory always reads as the old or the new complete version. The roll-forward first checks
every staged file against the sha256 the stage's manifest recorded, so a file damaged on disk meanwhile is
never put in place.

Ownership is per file (:mod:`phaselens.storage.manifest`), also inside sub-folders: the roll-forward
replaces or removes a file only if it still hashes to what the record holds, so a file a user put or
edited there meanwhile is kept (and left out of the manifest).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phaselens.errors import OutputError
from phaselens.storage import manifest as mf
from phaselens.storage.temporaries import alive, clean_stale, remove, token  # noqa: F401 - re-exported

STAGE = ".phaselens-tmp-"  # a stage being written (incomplete)
COMMITTED = ".phaselens-new-"  # a complete stage whose files are being moved into place
DONE = ".phaselens-done-"  # a stage whose files are all in place: only its deletion was left
RECORD = ".phaselens-commit.json"  # the commit record: which files to put and remove
TRASH = ".phaselens-trash"  # reserved (older versions moved replaced folders there)
RESERVED = (mf.MANIFEST, RECORD, TRASH)

Fault = Callable[[str], None]


def _no_fault(point: str) -> None:
    pass


@dataclass(frozen=True)
class DirKind:
    """A kind of output directory.

    Attributes:
        what: how messages name it (``"model checkpoint"``, ``"report"``); also the writer's name in the
            manifest, so one kind never replaces another kind's files.
        legacy: for a directory written before manifests existed (it has none): the top-level file names a
            previous output of this kind provably wrote there (e.g. those its own index lists). Never folders.
    """

    what: str
    legacy: Callable[[Path], frozenset[str]] | None = None


# ---- helpers ----------------------------------------------------------------------------------------------
def fsync(path: Path, *, directory: bool = False) -> None:
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


def fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for f in files:
            fsync(Path(folder) / f)
    fsync(root, directory=True)


def umask() -> int:
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


def normal_modes(root: Path) -> None:
    """Give what a writer made under ``root`` the modes a plain ``open``/``mkdir`` would (some libraries, e.g.
    safetensors, create files 0600)."""
    mask = umask()
    for folder, dirs, names in os.walk(root):
        for d in dirs:
            os.chmod(Path(folder) / d, 0o777 & ~mask)
        for n in names:
            os.chmod(Path(folder) / n, 0o666 & ~mask)


def rel(path: Path, root: Path) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def stage_files(stage: Path) -> list[str]:
    """Relative paths of the files a writer put in ``stage``; a nested writer's manifest is dropped (the
    directory's own manifest lists everything)."""
    out = []
    for folder, _, names in os.walk(stage):
        for n in names:
            if n == mf.MANIFEST:
                os.unlink(os.path.join(folder, n))
            else:
                out.append(rel(Path(folder) / n, stage))
    return sorted(out)


def stage_dirs(stage: Path) -> list[str]:
    return sorted(rel(Path(f), stage) for f, _, _ in os.walk(stage) if Path(f) != stage)


# ---- who owns what ----------------------------------------------------------------------------------------
def entries(target: Path) -> list[str]:
    """Every file (and symlink, and other non-folder) under ``target``, relative; phaselens's stages and its
    manifest left out. Symlinked folders are entries, never followed."""
    out = []
    for folder, dirs, names in os.walk(target):
        here = Path(folder)
        if here == target:
            dirs[:] = [d for d in dirs if not d.startswith((STAGE, COMMITTED, DONE))]
            names = [n for n in names if n != mf.MANIFEST and not n.startswith((STAGE, COMMITTED, DONE))]
        out += [rel(here / d, target) for d in dirs if os.path.islink(here / d)]
        out += [rel(here / n, target) for n in names]
    return sorted(out)


def survey(target: Path, kind: DirKind) -> tuple[dict[str, mf.Record], list[str]]:
    """``(owned, foreign)`` of an existing directory: the files this kind provably wrote (relative path ->
    record) and, sorted, every other file."""
    files, _, present = mf.read_manifest(target)
    if present:
        owned = {r: rec for r, rec in files.items() if rec["by"] == kind.what and mf.proven(target, r, rec)}
    else:  # written before manifests: the kind's own index says which top-level files are its own
        names = kind.legacy(target) if kind.legacy is not None else frozenset()
        owned = {n: mf.file_record(target / n, kind.what) for n in names if mf.is_plain_file(target / n)}
    return owned, [e for e in entries(target) if e not in owned]


# ---- the in-place update ----------------------------------------------------------------------------------
def write_in_place(target: Path, write: Callable[[Path], None], kind: DirKind, fault: Fault = _no_fault) -> None:
    clean_stale(target, STAGE)
    stage = target / f"{STAGE}{token()}"
    os.mkdir(stage)
    try:
        write(stage)
        names = stage_files(stage)
        if any(n.split("/")[0] in RESERVED for n in names):
            raise OutputError(f"a writer produced one of the reserved names {RESERVED}.")
        owned, _ = survey(target, kind)
        clash = [n for n in names if _blocked(target, n, owned)]
        if clash:
            raise OutputError(
                f"{target / clash[0]} exists and was not written by phaselens (or was changed since); the "
                f"{kind.what} needs that name. Move the file away or choose another directory (phaselens replaces "
                "only its own files)."
            )
        normal_modes(stage)
        files, dirs, _ = mf.read_manifest(target)
        keep = {r: rec for r, rec in files.items() if rec["by"] != kind.what}  # other writers' entries
        new = {n: mf.file_record(stage / n, kind.what) for n in names}
        made = {d: kind.what for d in stage_dirs(stage) if not (target / d).is_dir()}
        ours = {d: w for d, w in dirs.items() if w == kind.what}
        prune = sorted((d for d in ours if not any(n.startswith(d + "/") for n in names)), key=len, reverse=True)
        new_dirs = {**{d: w for d, w in dirs.items() if d not in prune}, **made}
        (stage / mf.MANIFEST).write_text(mf.manifest_text({**keep, **new}, new_dirs), encoding="utf-8")
        os.chmod(stage / mf.MANIFEST, 0o666 & ~umask())
        record = {"put": {n: owned[n]["sha256"] if n in owned else None for n in names},
                  "remove": {r: rec["sha256"] for r, rec in owned.items() if r not in new},
                  "prune": prune}
        (stage / RECORD).write_text(json.dumps(record))
        fsync_tree(stage)
        fault("dir:written")
        committed = target / f"{COMMITTED}{stage.name[len(STAGE):]}"
        os.rename(stage, committed)  # the commit point: from here on the new version is the one
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    fsync(target, directory=True)
    fault("dir:committed")
    roll_forward(target, committed, fault)


def _blocked(target: Path, name: str, owned: dict[str, mf.Record]) -> bool:
    """Whether putting ``name`` would touch something not this kind's own: a foreign file at that path, or a
    file or symlink (or a foreign file) where one of its folders goes."""
    parts = name.split("/")
    for i in range(1, len(parts)):
        sub = "/".join(parts[:i])
        p = target / sub
        if os.path.islink(p):
            return True  # never write through a symlink
        if os.path.lexists(p) and not p.is_dir():
            return sub not in owned  # a stale file of this kind gives way to the folder; a user's never
    dst = target / name
    return os.path.islink(dst) or dst.is_dir() or (os.path.lexists(dst) and name not in owned)


def _matches(path: Path, sha: str | None) -> bool:
    """Whether ``path`` is the file the record expects (``sha`` None: nothing may be there)."""
    if sha is None:
        return not os.path.lexists(path)
    try:
        return mf.is_plain_file(path) and mf.sha256_file(path) == sha
    except OSError:
        return False


def roll_forward(target: Path, committed: Path, fault: Fault = _no_fault) -> None:
    """Move a committed stage's files into place; idempotent, so a rerun after a kill completes it.

    A file is replaced or removed only while it still hashes to what the record holds; one a user put
    or changed meanwhile is kept, and the new manifest then does not list the file phaselens did not place.
    """
    try:
        record = json.loads((committed / RECORD).read_text())
        put, stale, prune = dict(record["put"]), dict(record["remove"]), list(record.get("prune", []))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise OutputError(
            f"{committed} is an interrupted write whose commit record cannot be read ({err}); delete that folder."
        ) from None
    staged, _, _ = mf.read_manifest(committed)  # each new file's sha256, recorded before the commit
    damaged = [n for n in put if os.path.lexists(committed / n) and n in staged
               and not mf.proven(committed, n, staged[n])]
    if damaged:  # checked before anything moves: a damaged file is never put in place as phaselens's own
        raise OutputError(f"{committed} is an interrupted write whose staged file(s) {damaged[:3]} no longer match "
                          "the sha256 recorded when they were written (damaged on disk); delete that folder and "
                          "write again.")
    for name, sha in stale.items():
        if _matches(target / name, sha):
            (target / name).unlink()
    skipped = []
    for name, expect in put.items():
        src, dst = committed / name, target / name
        if not os.path.lexists(src):
            continue  # moved before an interruption (or by a concurrent recovery)
        if os.path.lexists(dst) and not (expect is not None and _matches(dst, expect)) \
                and not _matches(dst, mf.sha256_file(src)):
            skipped.append(name)  # a user's file took that path meanwhile: it stays
            continue
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        except (NotADirectoryError, IsADirectoryError, FileExistsError):
            skipped.append(name)
            continue
        except FileNotFoundError:
            continue
        fault("dir:moved")
    for d in prune:  # folders this writer made that no longer hold its files: removed only when empty
        try:
            (target / d).rmdir()
        except OSError:
            pass
    man = committed / mf.MANIFEST
    if os.path.lexists(man):
        files, dirs, _ = mf.read_manifest(committed)
        if skipped:
            man.write_text(mf.manifest_text({k: v for k, v in files.items() if k not in skipped},
                                            {d: w for d, w in dirs.items() if (target / d).is_dir()}))
        os.replace(man, target / mf.MANIFEST)
        fault("dir:moved")
    # renamed before deleting: a kill inside rmtree must not leave a "committed" stage without its record
    done = target / f"{DONE}{committed.name[len(COMMITTED):]}"
    try:
        os.rename(committed, done)
    except FileNotFoundError:
        return  # a concurrent recovery finished it
    fsync(target, directory=True)
    shutil.rmtree(done, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def recover_dir(target: str | os.PathLike, fault: Fault = _no_fault) -> bool:
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
            roll_forward(target, committed, fault)
    for n in names:
        if (n.startswith(STAGE) and not alive(n)) or n.startswith(DONE):
            shutil.rmtree(target / n, ignore_errors=True)
    return bool(pending)
