"""Temporaries beside an output: named with the writing process's pid, so a later writer can tell a stale
one (its process is gone, e.g. killed mid-write) from one still being written, and remove only the former."""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

_TOKEN = re.compile(r"-(\d+)-[0-9a-f]{8}$")


def token() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def alive(name: str) -> bool:
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


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_stale(folder: Path, prefix: str) -> None:
    """Remove temporaries ``prefix*`` in ``folder`` left by processes that no longer run."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and not alive(name):
            remove(folder / name)
