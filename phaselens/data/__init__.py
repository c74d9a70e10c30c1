"""Data that ship with phaselens (read with ``importlib.resources``, so they work from any directory).

- :func:`paper_counts`: the published per-residue counts of the 128K needle test (DeepSeek-V4-Flash-Base,
  DeepSeek-V4.1) and the FP8 padding probe, with the paper's own numbers to check against.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def paper_counts() -> dict[str, Any]:
    """The paper's figure data: ``{"source", "models": {name: {"stride", "n_per_residue", "correct",
    "published"}}, "fp8_probe": {...}}`` (a fresh copy on every call).

    Example:
        >>> from phaselens.data import paper_counts
        >>> paper_counts()["models"]["DeepSeek-V4-Flash-Base"]["correct"][:4]
        [112, 178, 169, 76]
    """
    return json.loads(resources.files(__name__).joinpath("niah_counts.json").read_text())


__all__ = ["paper_counts"]
