"""Every example in docs/tasks.md runs and prints what it says; every public name is documented."""

from __future__ import annotations

import doctest

import phaselens.tasks
from tests.support.paths import DOCS

DOC = DOCS / "tasks.md"


def test_tasks_page_examples() -> None:
    res = doctest.testfile(
        str(DOC),
        module_relative=False,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        verbose=False,
    )
    assert res.attempted > 30
    assert res.failed == 0


def test_every_public_name_is_documented() -> None:
    text = DOC.read_text()
    missing = [n for n in phaselens.tasks.__all__ if f"`{n}" not in text and f"{n}(" not in text]
    assert missing == []
