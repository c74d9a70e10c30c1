"""Resumable results on disk: readers that turn damaged files into clear errors, a checkpoint of finished
cells (maps), and a cache of finished results keyed by fingerprint (repair tables).

Every checkpoint is safetensors + JSON, never pickle, written with :mod:`phaselens.storage.writing` (atomic) and
stamped with a fingerprint of what produced it (:mod:`phaselens.storage.fingerprints`), so a resume from another
model, calibration or setting raises instead of mixing results.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from phaselens.errors import CheckpointError, OutputError
from phaselens.storage.checksums import listed, stamped, verify
from phaselens.storage.oserrors import NAME_MAX, why_not_read, why_not_written
from phaselens.storage.reading import JSONDepthError, parse_json, peek_json
from phaselens.storage.writing import atomic_write_file, nearest_existing, writable, write_owned_file

CELLS_FORMAT = "phaselens.cells/1"


# ---- readers ----------------------------------------------------------------------------------------------
def read_json(path: str | os.PathLike, *, fix: str, expect: type = dict) -> Any:
    """Parse the JSON file ``path``; a missing or invalid file, or one whose top level is not an ``expect``,
    raises :class:`CheckpointError` ending with ``fix`` (what the user should do). A file that exists but
    cannot be read (permission, an I/O error) says so, and is not called corrupt."""
    path = Path(path)
    _regular(path, fix)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {fix}") from None
    except OSError as err:
        raise CheckpointError(why_not_read(err, path)) from None
    try:
        data = parse_json(raw.decode("utf-8"))  # its nesting bounded first
    except JSONDepthError as err:
        raise CheckpointError(f"{path} is not a file phaselens reads: {err}; {fix}") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path} is not valid JSON (truncated or corrupt: {err}); {fix}") from None
    if not isinstance(data, expect):
        raise CheckpointError(
            f"{path} holds a JSON {_json_name(type(data))}, but a JSON {_json_name(expect)} is needed; {fix}"
        )
    return data


def _json_name(t: type) -> str:
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return names.get(t, "null" if t is type(None) else t.__name__)


def _regular(path: Path, fix: str) -> None:
    """Refuse a path that is not a regular file (after symbolic links): opening a named pipe blocks until
    someone writes to it, and a device such as ``/dev/zero`` never ends, so neither is ever read."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: the open that follows says which
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path} is not a regular file (a named pipe, a device or a socket), so phaselens "
                              f"does not read it; {fix}")


def _readable(path: Path, fix: str) -> None:
    """Raise a :class:`CheckpointError` that says *why* ``path`` cannot be opened (missing, permission, I/O),
    so a file that merely cannot be read is never taken for a corrupt one."""
    _regular(path, fix)
    try:
        with open(path, "rb") as f:
            f.read(8)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {fix}") from None
    except OSError as err:
        raise CheckpointError(why_not_read(err, path)) from None


def safetensors_metadata(path: str | os.PathLike, *, fix: str) -> dict[str, str]:
    """The header metadata of a safetensors file, after checking that the file is complete.

    safetensors checks the header and that the data exactly covers the file, without reading the data, so
    this is cheap. A truncated, random or non-safetensors file raises :class:`CheckpointError` with ``fix``;
    one that cannot be read (permission) says so instead.
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, but a safetensors file is needed there; {fix}")
    _readable(path, fix)
    try:
        with safe_open(str(path), framework="np") as f:
            return dict(f.metadata() or {})
    except OSError as err:
        raise CheckpointError(why_not_read(err, path)) from None
    except Exception as err:  # SafetensorError, ...: the bytes are not a complete safetensors file
        raise CheckpointError(
            f"{path} is not a complete safetensors file (truncated or corrupt: {err}); {fix}"
        ) from None


def load_safetensors(path: str | os.PathLike, *, fix: str, framework: str = "pt") -> dict[str, Any]:
    """All tensors of a safetensors file (``framework`` ``"pt"`` or ``"np"``), checked against the sha256 its
    header records (:mod:`phaselens.storage.checksums`); damage raises :class:`CheckpointError`."""
    meta = safetensors_metadata(path, fix=fix)
    try:
        if framework == "pt":
            from safetensors.torch import load_file
        else:
            from safetensors.numpy import load_file
        tensors = load_file(str(path))
    except OSError as err:
        raise CheckpointError(why_not_read(err, path)) from None
    except Exception as err:
        raise CheckpointError(f"{path} cannot be read ({err}); {fix}") from None
    verify(path, tensors, meta, fix=fix)
    return tensors


def check_tensor_names(expected: Mapping[str, Any], present: Mapping[str, Any], *, where: str, fix: str,
                       shapes: bool = True) -> None:
    """The one check every loader makes before trusting a checkpoint: the tensor names it holds are exactly
    the model's (and, with ``shapes``, each has the model's shape). ``expected`` and ``present`` map names to
    shapes (anything ``tuple()`` accepts; ``None`` skips that name's shape).

    Raises:
        CheckpointError: naming the missing, unexpected and mis-shaped tensors (a few of each, and how many
            in all) and ending with ``fix``. A missing weight is never initialised at random instead.
    """
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    wrong = []
    if shapes:
        for name in sorted(set(expected) & set(present)):
            a, b = expected[name], present[name]
            if a is not None and b is not None and tuple(a) != tuple(b):
                wrong.append(f"{name} {tuple(b)} where the model needs {tuple(a)}")
    if missing or unexpected or wrong:
        raise tensor_mismatch(missing, unexpected, wrong, where=where, fix=fix)


def check_floating(tensors: Mapping[str, Any], *, where: str, fix: str) -> None:
    """Refuse weights that are not floating point (a file rewritten as int32 would be cast silently on load).

    Raises:
        CheckpointError: naming the first such tensors and their dtypes, ending with ``fix``.
    """
    bad = [f"{name} ({str(t.dtype).removeprefix('torch.')})" for name, t in sorted(tensors.items())
           if not (t.is_floating_point() if hasattr(t, "is_floating_point") else t.dtype.kind == "f")]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{where} holds {len(bad)} tensor(s) that are not floating point: "
                              f"{', '.join(bad[:3])}{more}; phaselens writes weights as floats, so the file was "
                              f"rewritten or is not a phaselens checkpoint, and is not cast; {fix}")


def tensor_mismatch(missing: list[str], unexpected: list[str], wrong: list[str], *, where: str,
                    fix: str) -> CheckpointError:
    """The :class:`CheckpointError` of :func:`check_tensor_names` from its three lists (for loaders whose
    library reports them, e.g. transformers' loading info)."""
    parts = [f"{len(names)} {what}: {listed(names)}" for what, names in (
        ("missing tensor(s)", missing), ("unexpected tensor(s)", unexpected),
        ("tensor(s) with the wrong shape", wrong)) if names]
    return CheckpointError(f"{where} does not match the model ({'; '.join(parts)}); {fix}")


def malformed_cells(done: Mapping[str, Any], fields: tuple[str, ...] | None,
                    shapes: Mapping[str, Any] | None = None) -> str:
    """What is wrong with a checkpoint's arrays, or ``""``: every array numeric; with ``fields`` and the
    ``shapes`` its writer recorded in the header (``field: [ndim, dtype, [size, or None where cells differ]]``),
    each field's arrays have that number of axes, that dtype and those sizes."""
    if fields is None:  # cells of named arrays (their shapes are the analysis's own): numeric, that is all
        bad = [f"{c}/{k}" for c, arrays in done.items() for k, a in arrays.items() if a.dtype.kind not in "biuf"]
        return f"{bad[0]} is not numeric" if bad else ""
    for label, arrays in done.items():
        if any(a.dtype.kind not in "biuf" for a in arrays):
            return f"cell {label!r} holds a non-numeric array"
        for f, a in zip(fields, arrays):
            want = (shapes or {}).get(f)
            if want is None:
                continue
            ndim, dtype, sizes = want
            if a.ndim != ndim or str(a.dtype) != dtype or any(s is not None and s != n for s, n in zip(sizes, a.shape)):
                shown = ", ".join("*" if s is None else str(s) for s in sizes)
                return f"field {f!r} of cell {label!r} is {a.dtype} {a.shape}, where phaselens wrote {dtype} [{shown}]"
    return ""


def field_shapes(done: Mapping[str, tuple[np.ndarray, ...]], fields: tuple[str, ...]) -> dict[str, Any]:
    """What :func:`malformed_cells` checks on load: per field, its number of axes, its dtype, and each axis's
    size where every cell has the same (``None`` where they differ, e.g. the items of the last block)."""
    out: dict[str, Any] = {}
    for i, f in enumerate(fields):
        arrays = [cell[i] for cell in done.values()]
        first = arrays[0]
        sizes = [n if all(a.ndim == first.ndim and a.shape[k] == n for a in arrays) else None
                 for k, n in enumerate(first.shape)]
        out[f] = [first.ndim, str(first.dtype), sizes]
    return out


# ---- finished cells (maps) --------------------------------------------------------------------------------
def check_checkpoint_path(path: Any) -> Path | None:
    """Refuse a checkpoint path that cannot be written, before any computation: not a path, a directory, or
    under a file or an unwritable folder (missing folders are created when the first cell is written)."""
    if path is None:
        return None
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise CheckpointError(f"checkpoint must be a file path (a str or pathlib.Path), got {path!r}.")
    p = Path(path)
    try:
        if any(len(part.encode()) > NAME_MAX for part in p.parts):
            raise OSError(errno.ENAMETOOLONG, "File name too long", str(p))
        if p.is_dir():
            raise CheckpointError(f"checkpoint={str(p)!r} is a directory; pass a file path such as "
                                  f"{str(p / 'map.ckpt')!r}.")
        where = nearest_existing(p.parent)
        if not where.is_dir():
            raise CheckpointError(f"checkpoint={str(p)!r} lies under the file {where}; pass a path in a folder.")
        if not writable(where):
            raise OutputError(f"checkpoint={str(p)!r}: the folder {where} is not writable (permission denied); "
                              "pass a path you can write to.")
    except OSError as err:
        shown = str(p) if len(str(p)) <= 100 else str(p)[:80] + "..."
        raise OutputError(f"checkpoint={shown!r}: {why_not_written(err, p)}") from None
    return p


class CellCheckpoint:
    """Finished cells of a long computation, each a tuple of arrays named ``fields`` (or, with ``fields=None``,
    a dict of named arrays whose names may differ by cell), kept in ONE file.

    The file at ``path`` (any name and suffix: nothing else is derived from it, so nothing can collide) is a
    safetensors file whose header holds the manifest (format, fingerprint, fields, cell order). It is
    rewritten atomically by :meth:`flush`. ``path=None`` keeps everything in memory.

    Raises:
        CheckpointError: ``path`` is a directory, a file phaselens did not write (it is never overwritten),
            a damaged checkpoint, or one written for a different computation (another fingerprint).
    """

    def __init__(self, path: str | os.PathLike | None, fingerprint: str, fields: tuple[str, ...] | None) -> None:
        self.path = check_checkpoint_path(path)
        self.fingerprint = str(fingerprint)
        self.fields = None if fields is None else tuple(fields)  # None: each cell is a dict of named arrays
        self.done: dict[str, Any] = {}
        if self.path is None:
            return
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        fix = ("it is a damaged phaselens checkpoint: delete it to start over (or pass another checkpoint path; "
               "phaselens never overwrites a file it did not write).")
        try:
            meta = safetensors_metadata(self.path, fix="")
        except CheckpointError as err:  # not even a safetensors file: nothing proves phaselens wrote it
            if "cannot be read" in str(err) or "is missing" in str(err) or "is a directory" in str(err):
                raise
            raise CheckpointError(
                f"{self.path} exists but is not a phaselens checkpoint (it is not a complete safetensors file); "
                "phaselens never overwrites a file it did not write: pass another checkpoint path, or, if it is a "
                "phaselens checkpoint damaged by a crash of the disk, delete it to start over.") from None
        if meta.get("format") != CELLS_FORMAT:
            raise CheckpointError(
                f"{self.path} exists but is not a phaselens checkpoint (format {meta.get('format')!r}); phaselens "
                "never overwrites a file it did not write: pass another checkpoint path."
            )
        try:
            man = json.loads(meta["manifest"])
            cells, fp = list(man["cells"]), str(man["fingerprint"])
            fields = None if man["fields"] is None else tuple(man["fields"])
        except (KeyError, ValueError, TypeError) as err:
            raise CheckpointError(f"{self.path} has a damaged manifest ({err}); {fix}") from None
        if fp != self.fingerprint or fields != self.fields:
            raise CheckpointError(
                f"{self.path} holds a different computation (the model, its weights, the items, the calibration "
                "or a setting differ); pass another checkpoint path, or delete it to start over."
            )
        arrays = load_safetensors(self.path, fix=fix, framework="np")
        try:
            if self.fields is None:
                names: dict[str, dict[str, np.ndarray]] = {c: {} for c in cells}
                for key, value in arrays.items():
                    cell, _, name = key.partition("/")
                    names.setdefault(cell, {})[name] = value
                self.done = {c: names[c] for c in cells}
            else:
                self.done = {c: tuple(arrays[f"{c}/{f}"] for f in self.fields) for c in cells}
        except KeyError as err:
            raise CheckpointError(f"{self.path} lacks the arrays of cell {err}; {fix}") from None
        bad = malformed_cells(self.done, self.fields, man.get("shapes"))
        if bad:
            raise CheckpointError(f"{self.path} is damaged: its arrays are malformed ({bad}); {fix}")

    def add(self, label: str, *arrays: Any) -> None:
        """Record a finished cell (one array per field, or one dict of named arrays); :meth:`flush` writes it."""
        if self.fields is None:
            if len(arrays) != 1 or not isinstance(arrays[0], dict):
                raise ValueError("a cell of a checkpoint without fields is one dict of named arrays.")
            self.done[str(label)] = {str(k): np.asarray(v) for k, v in arrays[0].items()}
            return
        if len(arrays) != len(self.fields):
            raise ValueError(f"a cell needs {len(self.fields)} arrays ({self.fields}), got {len(arrays)}.")
        self.done[str(label)] = tuple(np.asarray(a) for a in arrays)

    def flush(self) -> None:
        """Write every finished cell to ``path`` (one atomic replace)."""
        if self.path is None:
            return
        from safetensors.numpy import save_file

        tensors = {f"{c}/{f}": np.ascontiguousarray(a) for c, arrs in self.done.items()
                   for f, a in (arrs.items() if self.fields is None else zip(self.fields, arrs))}
        manifest = {"fingerprint": self.fingerprint, "fields": None if self.fields is None else list(self.fields),
                    "cells": list(self.done)}
        if self.fields is not None and self.done:  # what each field's arrays look like (a load checks it)
            manifest["shapes"] = field_shapes(self.done, self.fields)
        meta = stamped({"format": CELLS_FORMAT, "manifest": json.dumps(manifest)}, tensors)
        atomic_write_file(self.path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


# ---- finished results (caches) ----------------------------------------------------------------------------
RESULT_FORMAT = "phaselens.cache/1"


def _is_cache_entry(path: Path) -> bool:
    """Whether ``path`` is a cache entry phaselens wrote before the folder had a manifest: a JSON object of
    exactly its writer's keys (``format``, ``fingerprint``, ``result``), stamped with its format."""
    entry = peek_json(path)
    return (isinstance(entry, dict) and set(entry) in ({"fingerprint", "result"}, {"format", "fingerprint", "result"})
            and entry.get("format", RESULT_FORMAT) == RESULT_FORMAT and isinstance(entry["fingerprint"], str)
            and isinstance(entry["result"], dict))


class ResultCache:
    """JSON results in ``folder``, one file per key, each stamped with the fingerprint that produced it.

    :meth:`get` returns a result only when its fingerprint matches; an entry that is missing, damaged or
    stale is a miss (the caller recomputes and :meth:`put` replaces it atomically). Keys are file stems.
    Entries are listed in the folder's manifest; a file at an entry's path that phaselens cannot prove it
    wrote (someone else's, or one damaged after it was written) is never replaced (:class:`OutputError`).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise CheckpointError(f"cache folder {self.folder} is a file; pass a directory path.")

    def path(self, key: str) -> Path:
        if not key or "/" in key or "\\" in key or key.startswith("."):
            raise ValueError(f"cache key {key!r} must be a plain file stem.")
        return self.folder / f"{key}.json"

    def get(self, key: str, fingerprint: str) -> dict[str, Any] | None:
        path = self.path(key)
        entry = peek_json(path)  # missing, damaged, or a pipe or device (never opened): a miss
        if not isinstance(entry, dict) or entry.get("fingerprint") != fingerprint or not isinstance(entry.get("result"), dict):
            return None
        return entry["result"]

    def put(self, key: str, fingerprint: str, result: dict[str, Any]) -> None:
        text = json.dumps({"format": RESULT_FORMAT, "fingerprint": fingerprint, "result": result})
        write_owned_file(self.path(key), lambda tmp: tmp.write_text(text, encoding="utf-8"), by="result cache",
                         proves=_is_cache_entry)
