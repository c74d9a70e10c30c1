"""The result journal of a resumable analysis (``journal=``): finished units of work, kept in ONE file.

A journal is safetensors + JSON, never pickle, written atomically (:mod:`phaselens.storage.writing`) and
stamped with a fingerprint of what produced it (:mod:`phaselens.storage.fingerprints`), so a resume from
another model, calibration or setting raises :class:`~phaselens.errors.JournalError` instead of mixing results.
A journal holds results, never weights: a *checkpoint* is a model's weights (docs/architecture.md, Words).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from phaselens.errors import CheckpointError, JournalError, OutputError
from phaselens.storage.checksums import stamped
from phaselens.storage.oserrors import NAME_MAX, why_not_written
from phaselens.storage.resumable import load_safetensors, safetensors_metadata
from phaselens.storage.writing import atomic_write_file, nearest_existing, writable

CELLS_FORMAT = "phaselens.cells/1"


def malformed_cells(done: Mapping[str, Any], fields: tuple[str, ...] | None,
                    shapes: Mapping[str, Any] | None = None) -> str:
    """What is wrong with a journal's arrays, or ``""``: every array numeric; with ``fields`` and the
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


# ---- the journal ----------------------------------------------------------------------------------------
def check_journal_path(path: Any) -> Path | None:
    """Refuse a journal path that cannot be written, before any computation: not a path, a directory, a
    symbolic link (dangling or not) or another special file, or under a file or an unwritable folder (missing folders are created when the first cell is written)."""
    if path is None:
        return None
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise JournalError(f"journal must be a file path (a str or pathlib.Path), got {path!r}.")
    p = Path(path)
    try:
        if any(len(part.encode()) > NAME_MAX for part in p.parts):
            raise OSError(errno.ENAMETOOLONG, "File name too long", str(p))
        if p.is_dir():
            raise JournalError(f"journal={str(p)!r} is a directory; pass a file path such as "
                               f"{str(p / 'map.journal')!r}.")
        if p.is_symlink() or (p.exists() and not p.is_file()):  # a journal is replaced whole: never a link's target
            raise JournalError(f"journal={str(p)!r} is a symbolic link or a special file, not a file phaselens "
                               "wrote; pass a path where phaselens may write its own file.")
        where = nearest_existing(p.parent)
        if not where.is_dir():
            raise JournalError(f"journal={str(p)!r} lies under the file {where}; pass a path in a folder.")
        if not writable(where):
            raise OutputError(f"journal={str(p)!r}: the folder {where} is not writable (permission denied); "
                              "pass a path you can write to.")
    except OSError as err:
        shown = str(p) if len(str(p)) <= 100 else str(p)[:80] + "..."
        raise OutputError(f"journal={shown!r}: {why_not_written(err, p)}") from None
    return p


class CellJournal:
    """Finished cells of a long computation, each a tuple of arrays named ``fields`` (or, with ``fields=None``,
    a dict of named arrays whose names may differ by cell), kept in ONE file.

    The file at ``path`` (any name and suffix: nothing else is derived from it, so nothing can collide) is a
    safetensors file whose header holds the manifest (format, fingerprint, fields, cell order). It is
    rewritten atomically by :meth:`flush`. ``path=None`` keeps everything in memory.

    Raises:
        JournalError: ``path`` is a directory, a file phaselens did not write (it is never overwritten),
            a damaged journal, or one written for a different computation (another fingerprint).
    """

    def __init__(self, path: str | os.PathLike | None, fingerprint: str, fields: tuple[str, ...] | None) -> None:
        self.path = check_journal_path(path)
        self.fingerprint = str(fingerprint)
        self.fields = None if fields is None else tuple(fields)  # None: each cell is a dict of named arrays
        self.done: dict[str, Any] = {}
        if self.path is None:
            return
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        fix = ("it is a damaged phaselens journal: delete it to start over (or pass another journal path; "
               "phaselens never overwrites a file it did not write).")
        try:
            meta = safetensors_metadata(self.path, fix="")
        except CheckpointError as err:  # not even a safetensors file: nothing proves phaselens wrote it
            if "cannot be read" in str(err) or "is missing" in str(err) or "is a directory" in str(err):
                raise JournalError(str(err)) from None
            raise JournalError(
                f"{self.path} exists but is not a phaselens journal (it is not a complete safetensors file); "
                "phaselens never overwrites a file it did not write: pass another journal path, or, if it is a "
                "phaselens journal damaged by a crash of the disk, delete it to start over.") from None
        if meta.get("format") != CELLS_FORMAT:
            raise JournalError(
                f"{self.path} exists but is not a phaselens journal (format {meta.get('format')!r}); phaselens "
                "never overwrites a file it did not write: pass another journal path."
            )
        try:
            man = json.loads(meta["manifest"])
            cells, fp = list(man["cells"]), str(man["fingerprint"])
            fields = None if man["fields"] is None else tuple(man["fields"])
        except (KeyError, ValueError, TypeError) as err:
            raise JournalError(f"{self.path} has a damaged manifest ({err}); {fix}") from None
        if fp != self.fingerprint or fields != self.fields:
            raise JournalError(
                f"{self.path} holds a different computation (the model, its weights, the items, the calibration "
                "or a setting differ); pass another journal path, or delete it to start over."
            )
        try:  # the shared reader raises CheckpointError for any stored file; here the file is a journal
            arrays = load_safetensors(self.path, fix=fix, framework="np")
        except CheckpointError as err:
            raise JournalError(str(err)) from None
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
            raise JournalError(f"{self.path} lacks the arrays of cell {err}; {fix}") from None
        bad = malformed_cells(self.done, self.fields, man.get("shapes"))
        if bad:
            raise JournalError(f"{self.path} is damaged: its arrays are malformed ({bad}); {fix}")

    def add(self, label: str, *arrays: Any) -> None:
        """Record a finished cell (one array per field, or one dict of named arrays); :meth:`flush` writes it."""
        if self.fields is None:
            if len(arrays) != 1 or not isinstance(arrays[0], dict):
                raise ValueError("a cell of a journal without fields is one dict of named arrays.")
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
