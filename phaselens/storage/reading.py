"""Reading a file phaselens did not necessarily write, without blocking or running on forever.

A path a user (or a crafted folder) controls may be a named pipe, whose ``open`` waits for a writer that never
comes, or a device such as ``/dev/zero``, whose read never ends. Every reader of JSON or weights that a user
can point at goes through here: a path that is not a regular file (after symbolic links) is never opened.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file, after symbolic links (``os.path.isfile``; never raises)."""
    return os.path.isfile(path)


#: JSON nesting phaselens reads: its own files and transformers' configs nest a handful of levels; Python's
#: parser recurses once per level and fails with a RecursionError near 1,000.
MAX_JSON_DEPTH = 64
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JSONDepthError(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH` (a ``ValueError``, as any JSON a reader cannot use)."""


def json_depth(text: str, *, stop: int | None = None) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest (0: a scalar), counted without parsing it
    (brackets inside strings are not counted); the count ends as soon as it passes ``stop``."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = most = 0
    for c in brackets:  # only brackets are left: a short loop for any real file
        depth += 1 if c in "[{" else -1
        if depth > most:
            most = depth
            if stop is not None and most > stop:
                break
    return most


def parse_json(text: str) -> Any:
    """``json.loads(text)``, its nesting bounded first: deeper than :data:`MAX_JSON_DEPTH` levels is a
    :class:`JSONDepthError` that says so, never a ``RecursionError`` from the parser."""
    if json_depth(text, stop=MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise JSONDepthError(f"its arrays and objects nest more than {MAX_JSON_DEPTH} levels deep, the most "
                             "phaselens reads (a config.json nests 2 or 3)")
    return json.loads(text)


def peek_json(path: str | os.PathLike) -> Any:
    """The JSON value in ``path``, or ``None`` when it is missing, not a regular file, unreadable or not JSON.

    For sniffing what a folder holds (``config.json``'s format or ``model_type``); nothing is ever raised.
    """
    if not is_regular(path):
        return None
    try:
        return parse_json(Path(path).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def peek_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """:func:`peek_json`, as a dict: ``{}`` for anything that is not a JSON object."""
    value = peek_json(path)
    return value if isinstance(value, dict) else {}


class TornLineWarning(UserWarning):
    """An append-only file ended in a line cut short (a writer killed mid-line): the line was dropped."""


def read_jsonl(path: str | os.PathLike, *, fix: str) -> list[Any]:
    """The values of a JSON-lines file that phaselens appends to (one value per line, each line written whole
    and ending in a newline).

    A kill while a line is being appended leaves that last line cut short, without its newline: it is dropped
    with a :class:`TornLineWarning` (a resume then rewrites it), so a run can always resume. A last line that
    is complete but lacks its newline is kept. Any other line that is not JSON is damage, not a kill.

    Raises:
        CheckpointError: ``path`` cannot be read, or a line before the last is not JSON (ending with ``fix``).
    """
    import warnings

    from phaselens.errors import CheckpointError

    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as err:
        from phaselens.storage.oserrors import why_not_read

        raise CheckpointError(why_not_read(err, path)) from None
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends in a newline; otherwise the last line, perhaps cut short
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except (ValueError, RecursionError):
            raise CheckpointError(f"{path} is damaged: line {i} is not JSON ({line[:60]!r}); {fix}") from None
    if tail.strip():
        try:
            out.append(json.loads(tail))
        except (ValueError, RecursionError):
            warnings.warn(TornLineWarning(
                f"{path}: its last line ({len(tail)} characters, {tail[:40]!r}...) was cut short, as a kill during a "
                "write leaves it; it is dropped."), stacklevel=2)
    return out
