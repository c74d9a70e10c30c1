"""Every example in docs/statistics.md and in the phaselens.stats docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import phaselens.stats

DOC = Path(__file__).resolve().parents[1] / "docs" / "statistics.md"
MODULES = sorted(m.name for m in pkgutil.iter_modules(phaselens.stats.__path__, "phaselens.stats."))


def test_statistics_page_examples() -> None:
    res = doctest.testfile(str(DOC), module_relative=False, optionflags=doctest.ELLIPSIS, verbose=False)
    assert res.attempted > 40
    assert res.failed == 0


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert res.failed == 0


def test_every_public_name_is_documented() -> None:
    text = DOC.read_text()
    missing = [
        n for n in phaselens.stats.__all__ if n[0].islower() and f"{n}(" not in text and f"`{n}`" not in text
    ]
    assert missing == []
