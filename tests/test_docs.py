"""The API reference and the other pages with examples run as written; every public name is documented."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

import phaselens

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("page", ["api.md", "evaluation.md", "concepts.md"])
def test_page_examples_run(page):
    res = doctest.testfile(str(DOCS / page), module_relative=False, verbose=False,
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted >= 2 and res.failed == 0


def test_every_public_name_is_in_the_api_reference():
    text = (DOCS / "api.md").read_text()
    skip = {"__version__", "stats", "tasks"} | set(phaselens.errors.__all__)
    missing = [n for n in phaselens.__all__ if n not in skip and n not in text]
    assert missing == []


def test_readme_links_resolve():
    readme = (DOCS.parent / "README.md").read_text()
    for target in ["docs/index.md", "docs/quickstart.md", "docs/api.md", "docs/zoo.md", "docs/benchmarks.md"]:
        assert target in readme and (DOCS.parent / target).exists(), target
