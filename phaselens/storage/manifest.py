"""What phaselens wrote: the one record every writer's ownership comes from.

A folder that phaselens writes into holds ``.phaselens-manifest.json``: for each file it wrote there (a path
relative to the folder, e.g. ``figures/top.png``) the sha256, the size and which writer wrote it (``by``:
``"report"``, ``"model checkpoint"``, ``"command-line output"``, ...), and the folders it created. A file is
phaselens's own, and may be replaced or removed by the same writer, only while the manifest lists it *and* its
bytes still hash to the recorded sha256. Everything else is the user's: a file the manifest does not list, one
a user edited after phaselens wrote it, a file of another writer, whatever its name or extension.

Files that carry their own manifest in a header (the journals of the analyses, the training state) prove
themselves by it instead (see :func:`phaselens.storage.writing.write_owned_file`).

The manifest is updated under an advisory lock of its folder (``flock``, where the OS has it) and replaced
atomically; a missing, unreadable or damaged manifest proves nothing (so nothing is replaced without
``overwrite``/``--force``, and even then no listed-but-unproven file is touched).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phaselens.storage.temporaries import clean_stale, token

MANIFEST = ".phaselens-manifest.json"
FORMAT = "phaselens.manifest/1"

Record = dict[str, Any]  # {"sha256": str, "size": int, "by": str, optionally "also": [{"sha256", "size"}]}


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: str | os.PathLike, by: str) -> Record:
    """The manifest entry of the file at ``path`` as it is now, written by ``by``."""
    return {"sha256": sha256_file(path), "size": os.stat(path).st_size, "by": by}


def is_plain_file(path: Path) -> bool:
    """A regular file that is not a symlink (only those can be phaselens's)."""
    return os.path.isfile(path) and not os.path.islink(path)


def read_manifest(folder: str | os.PathLike) -> tuple[dict[str, Record], dict[str, str], bool]:
    """``(files, dirs, present)`` of ``folder``'s manifest: ``files`` maps a relative path to its record, ``dirs``
    a folder phaselens created to the writer; ``present`` is whether a manifest file exists. A damaged or
    unreadable manifest reads as empty (it proves nothing)."""
    path = Path(folder) / MANIFEST
    if not os.path.lexists(path):
        return {}, {}, False
    if not is_plain_file(path):  # a pipe would block the read; a link could point anywhere: proves nothing
        return {}, {}, True
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = {str(k): dict(v) for k, v in dict(data["files"]).items()
                 if isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("by"), str)}
        dirs = {str(k): str(v) for k, v in dict(data.get("dirs", {})).items()}
        if data.get("format") != FORMAT:
            return {}, {}, True
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return {}, {}, True
    return files, dirs, True


def proven(folder: Path, rel: str, record: Record) -> bool:
    """Whether ``folder/rel`` is still exactly the file phaselens recorded (size, then sha256)."""
    path = folder / rel
    try:
        # "also": the previous version, while a replacement is in flight (a kill then leaves either one)
        versions = [record, *record.get("also", ())]
        if not is_plain_file(path):
            return False
        size = os.stat(path).st_size
        versions = [v for v in versions if int(v.get("size", -1)) == size]
        return bool(versions) and sha256_file(path) in {v["sha256"] for v in versions}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def owned_by(folder: str | os.PathLike, by: str) -> dict[str, Record]:
    """The files of ``folder`` that writer ``by`` wrote and that nobody changed since (relative path -> record)."""
    folder = Path(folder)
    files, _, _ = read_manifest(folder)
    return {rel: rec for rel, rec in files.items() if rec["by"] == by and proven(folder, rel, rec)}


def manifest_text(files: dict[str, Record], dirs: dict[str, str]) -> str:
    return json.dumps({"format": FORMAT, "files": dict(sorted(files.items())), "dirs": dict(sorted(dirs.items()))},
                      indent=1)


@contextlib.contextmanager
def locked(folder: str | os.PathLike) -> Iterator[None]:
    """An exclusive advisory lock on ``folder`` (``flock`` on the folder itself; nothing where unsupported)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` beside ``path`` and rename it over ``path`` (atomic; mode of a new file from the umask)."""
    clean_stale(path.parent, f".{path.name}.tmp-")  # one a killed writer left
    tmp = path.parent / f".{path.name}.tmp-{token()}"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def update(folder: str | os.PathLike, put: dict[str, Record] | None = None, drop: tuple[str, ...] = ()) -> None:
    """Record ``put`` (relative path -> record) and forget ``drop`` in ``folder``'s manifest, under its lock."""
    folder = Path(folder)
    with locked(folder):
        files, dirs, _ = read_manifest(folder)
        for rel in drop:
            files.pop(rel, None)
        files.update(put or {})
        replace_text(folder / MANIFEST, manifest_text(files, dirs))
