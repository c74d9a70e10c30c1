"""Reading what phaselens stored: readers that turn damaged files into clear errors (JSON, safetensors, the
tensor-name check of every weights loader), and a cache of finished results keyed by fingerprint (repair tables).

Everything is safetensors + JSON, never pickle. The result journal of a resumable analysis (``journal=``) is
:mod:`phaselens.storage.journal`.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phaselens.errors import CheckpointError, OutputError
from phaselens.storage.checksums import listed, verify
from phaselens.storage.oserrors import why_not_read
from phaselens.storage.reading import JSONDepthError, parse_json, peek_json
from phaselens.storage.writing import write_owned_file


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
            raise OutputError(f"cache folder {self.folder} is a file; pass a directory path.")

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
