"""pytest's settings for the whole checkout (tests/conftest.py holds the tests' fixtures).

A doctest that pytest collects anywhere here (``pytest --doctest-glob='*.md' README.md docs``, ``pytest
--doctest-modules phaselens``) runs from its own temporary folder: an example that writes a file, as the README's
``fig.write_html("map.html")`` does, writes it there and never into the checkout (tests/test_clean_checkout.py).
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _doctests_run_in_a_temporary_folder(request):
    if isinstance(request.node, pytest.DoctestItem):
        request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
