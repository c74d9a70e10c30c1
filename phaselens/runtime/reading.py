"""Reading a file phaselens did not necessarily write, without blocking or running on forever.

A path a user (or a crafted folder) controls may be a named pipe, whose ``open`` waits for a writer that never
comes, or a device such as ``/dev/zero``, whose read never ends. Every reader of JSON or weights that a user
can point at goes through here: a path that is not a regular file (after symbolic links) is never opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file, after symbolic links (``os.path.isfile``; never raises)."""
    return os.path.isfile(path)


def peek_json(path: str | os.PathLike) -> Any:
    """The JSON value in ``path``, or ``None`` when it is missing, not a regular file, unreadable or not JSON.

    For sniffing what a folder holds (``config.json``'s format or ``model_type``); nothing is ever raised.
    """
    if not is_regular(path):
        return None
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def peek_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """:func:`peek_json`, as a dict: ``{}`` for anything that is not a JSON object."""
    value = peek_json(path)
    return value if isinstance(value, dict) else {}
