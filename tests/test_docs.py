"""The API reference and the other pages with examples run as written; every public name is documented."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

import phaselens

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("page", ["api.md", "evaluation.md", "concepts.md", "architecture.md", "transformer_lens.md",
                                  "nnsight.md", "causal_lm.md"])
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here, not in the checkout
    res = doctest.testfile(str(DOCS / page), module_relative=False, verbose=False,
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted >= 2 and res.failed == 0


def test_every_public_name_is_in_the_api_reference():
    text = (DOCS / "api.md").read_text()
    skip = {"__version__", "plots", "stats", "tasks"} | set(phaselens.errors.__all__)
    missing = [n for n in phaselens.__all__ if n not in skip and n not in text]
    assert missing == []


def test_readme_links_resolve():
    """Every relative link and image in the README points at a file that exists (the report PNG included)."""
    import re

    readme = (DOCS.parent / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", readme)
    for target in ["docs/index.md", "docs/zoo.md", "docs/benchmarks.md", "docs/repair.md", "docs/figures/w8s4_accuracy.png"]:
        assert target in targets, target
    missing = [t for t in targets if not t.startswith("http") and not (DOCS.parent / t).exists()]
    assert missing == []


def test_readme_quickstart_runs(tmp_path, monkeypatch):
    """The README's Python blocks run as written, in order, in one namespace (in an empty directory: the
    figure is written there)."""
    import re

    monkeypatch.chdir(tmp_path)
    readme = (DOCS.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)
    assert "worst" in repr(namespace["ev"]) and namespace["pm"].values("head").shape == (2, 4, 24)
    assert (tmp_path / "map.html").stat().st_size > 10_000  # the script writes its figure, not fig.show()


@pytest.mark.slow
def test_quickstart_runs_as_written(tmp_path, monkeypatch):
    """docs/quickstart.md's Python block runs at the sizes it states and writes its figure (not fig.show())."""
    import re

    monkeypatch.chdir(tmp_path)
    text = (DOCS / "quickstart.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(code, "quickstart.md", "exec"), namespace)
    assert (tmp_path / "accuracy.html").stat().st_size > 10_000
    pm = namespace["pm"]
    assert pm.values("head").shape == (2, 4, 24) and "L0H3" in pm.most_specialized()["label"].tolist()
