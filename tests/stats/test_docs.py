"""Every example in docs/statistics.md and in the phaselens.stats docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import json
import pkgutil

import pytest

import phaselens.stats
from tests.support.paths import DOCS

DOC = DOCS / "statistics.md"
SIMULATIONS = DOC.parent / "data" / "stats_simulations.json"
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


def test_simulation_tables_come_from_the_script() -> None:
    # docs/statistics.md quotes the tables experiments/stats_simulations.py wrote, verbatim.
    sims = json.loads(SIMULATIONS.read_text())
    text = DOC.read_text()
    assert set(sims["tables_md"]) == {"coverage", "paired", "detector"}
    for name, table in sims["tables_md"].items():
        assert table in text, name
    assert sims["command"] in text


def test_simulated_goals_hold() -> None:
    # The goals, on the committed full simulation: coverage ≥ 93% everywhere, the wrong "2" on the
    # 10 pp period-4 dip at most 5%, and no period under the null at least 95%.
    sims = json.loads(SIMULATIONS.read_text())
    assert min(r["two_sided"] for r in sims["coverage"]["rows"]) >= 0.93
    rows = {r["scenario"]: r["new"] for r in sims["detector"]["rows"]}
    assert rows["period 4, 10 pp dip"].get("2", 0.0) <= 0.05
    null = rows["no effect"]
    assert null.get("no effect", 0.0) + null.get("ambiguous", 0.0) >= 0.95
    rates = sims["paired"]["rates"]
    assert abs(rates["null"]["Cochran Q"] - 0.05) < 0.015 and abs(rates["null"]["nested Cochran"] - 0.05) < 0.015
