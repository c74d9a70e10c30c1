"""Resumable results on disk: readers that turn damaged files into clear errors, a checkpoint of finished
cells (maps), and a cache of finished results keyed by fingerprint (repair tables).

Every checkpoint is safetensors + JSON, never pickle, written with :mod:`phaselens.runtime.files` (atomic) and
stamped with a fingerprint of what produced it (:mod:`phaselens.runtime.fingerprints`), so a resume from another
model, calibration or setting raises instead of mixing results.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from phaselens.core.errors import CheckpointError
from phaselens.runtime.files import atomic_write_file, atomic_write_text, nearest_existing, writable

CELLS_FORMAT = "phaselens.cells/1"


# ---- readers ----------------------------------------------------------------------------------------------
def read_json(path: str | os.PathLike, *, fix: str, expect: type = dict) -> Any:
    """Parse the JSON file ``path``; a missing, unreadable or invalid file, or one whose top level is not an
    ``expect``, raises :class:`CheckpointError` ending with ``fix`` (what the user should do)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path} is not valid JSON (truncated or corrupt: {err}); {fix}") from None
    if not isinstance(data, expect):
        raise CheckpointError(
            f"{path} holds a JSON {_json_name(type(data))}, but a JSON {_json_name(expect)} is needed; {fix}"
        )
    return data


def _json_name(t: type) -> str:
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return names.get(t, "null" if t is type(None) else t.__name__)


def safetensors_metadata(path: str | os.PathLike, *, fix: str) -> dict[str, str]:
    """The header metadata of a safetensors file, after checking that the file is complete.

    safetensors checks the header and that the data exactly covers the file, without reading the data, so
    this is cheap. A truncated, random or non-safetensors file raises :class:`CheckpointError` with ``fix``.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; {fix}")
    try:
        with safe_open(str(path), framework="np") as f:
            return dict(f.metadata() or {})
    except Exception as err:  # SafetensorError, OSError, ...: all mean the file cannot be trusted
        raise CheckpointError(
            f"{path} is not a complete safetensors file (truncated or corrupt: {err}); {fix}"
        ) from None


def load_safetensors(path: str | os.PathLike, *, fix: str, framework: str = "pt") -> dict[str, Any]:
    """All tensors of a safetensors file (``framework`` ``"pt"`` or ``"np"``); damage raises :class:`CheckpointError`."""
    safetensors_metadata(path, fix=fix)
    try:
        if framework == "pt":
            from safetensors.torch import load_file
        else:
            from safetensors.numpy import load_file
        return load_file(str(path))
    except Exception as err:
        raise CheckpointError(f"{path} cannot be read ({err}); {fix}") from None


# ---- finished cells (maps) --------------------------------------------------------------------------------
def check_checkpoint_path(path: Any) -> Path | None:
    """Refuse a checkpoint path that cannot be written, before any computation: not a path, a directory, or
    under a file or an unwritable folder (missing folders are created when the first cell is written)."""
    if path is None:
        return None
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise CheckpointError(f"checkpoint must be a file path (a str or pathlib.Path), got {path!r}.")
    p = Path(path)
    if p.is_dir():
        raise CheckpointError(f"checkpoint={str(p)!r} is a directory; pass a file path such as "
                              f"{str(p / 'map.ckpt')!r}.")
    where = nearest_existing(p.parent)
    if not where.is_dir():
        raise CheckpointError(f"checkpoint={str(p)!r} lies under the file {where}; pass a path in a folder.")
    if not writable(where):
        raise CheckpointError(f"checkpoint={str(p)!r}: the folder {where} is not writable; pass a path you can "
                              "write to.")
    return p


class CellCheckpoint:
    """Finished cells of a long computation, each a tuple of arrays named ``fields``, kept in ONE file.

    The file at ``path`` (any name and suffix: nothing else is derived from it, so nothing can collide) is a
    safetensors file whose header holds the manifest (format, fingerprint, fields, cell order). It is
    rewritten atomically by :meth:`flush`. ``path=None`` keeps everything in memory.

    Raises:
        CheckpointError: ``path`` is a directory, a file phaselens did not write (it is never overwritten),
            a damaged checkpoint, or one written for a different computation (another fingerprint).
    """

    def __init__(self, path: str | os.PathLike | None, fingerprint: str, fields: tuple[str, ...]) -> None:
        self.path = check_checkpoint_path(path)
        self.fingerprint = str(fingerprint)
        self.fields = tuple(fields)
        self.done: dict[str, tuple[np.ndarray, ...]] = {}
        if self.path is None:
            return
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        fix = ("if it is a damaged phaselens checkpoint, delete it to start over; otherwise pass another checkpoint "
               "path (phaselens never overwrites a file it did not write).")
        meta = safetensors_metadata(self.path, fix=fix)
        if meta.get("format") != CELLS_FORMAT:
            raise CheckpointError(
                f"{self.path} exists but is not a phaselens checkpoint (format {meta.get('format')!r}); phaselens "
                "never overwrites a file it did not write: pass another checkpoint path."
            )
        try:
            man = json.loads(meta["manifest"])
            cells, fields, fp = list(man["cells"]), tuple(man["fields"]), str(man["fingerprint"])
        except (KeyError, ValueError, TypeError) as err:
            raise CheckpointError(f"{self.path} has a damaged manifest ({err}); {fix}") from None
        if fp != self.fingerprint or fields != self.fields:
            raise CheckpointError(
                f"{self.path} holds a different computation (the model, its weights, the items, the calibration "
                "or a setting differ); pass another checkpoint path, or delete it to start over."
            )
        arrays = load_safetensors(self.path, fix=fix, framework="np")
        try:
            self.done = {c: tuple(arrays[f"{c}/{f}"] for f in self.fields) for c in cells}
        except KeyError as err:
            raise CheckpointError(f"{self.path} lacks the arrays of cell {err}; {fix}") from None

    def add(self, label: str, *arrays: np.ndarray) -> None:
        """Record a finished cell (one array per field); :meth:`flush` writes it."""
        if len(arrays) != len(self.fields):
            raise ValueError(f"a cell needs {len(self.fields)} arrays ({self.fields}), got {len(arrays)}.")
        self.done[str(label)] = tuple(np.asarray(a) for a in arrays)

    def flush(self) -> None:
        """Write every finished cell to ``path`` (one atomic replace)."""
        if self.path is None:
            return
        from safetensors.numpy import save_file

        tensors = {f"{c}/{f}": np.ascontiguousarray(a) for c, arrs in self.done.items() for f, a in zip(self.fields, arrs)}
        manifest = {"fingerprint": self.fingerprint, "fields": list(self.fields), "cells": list(self.done)}
        meta = {"format": CELLS_FORMAT, "manifest": json.dumps(manifest)}
        atomic_write_file(self.path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


# ---- finished results (caches) ----------------------------------------------------------------------------
class ResultCache:
    """JSON results in ``folder``, one file per key, each stamped with the fingerprint that produced it.

    :meth:`get` returns a result only when its fingerprint matches; an entry that is missing, damaged or
    stale is a miss (the caller recomputes and :meth:`put` replaces it atomically). Keys are file stems.
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
        try:
            entry = json.loads(self.path(key).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("fingerprint") != fingerprint or not isinstance(entry.get("result"), dict):
            return None
        return entry["result"]

    def put(self, key: str, fingerprint: str, result: dict[str, Any]) -> None:
        atomic_write_text(self.path(key), json.dumps({"fingerprint": fingerprint, "result": result}))
