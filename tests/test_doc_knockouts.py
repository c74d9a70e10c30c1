"""Every documented knockout shows its effect (issue 15).

Each ``phaselens.ablate(...)`` call in the README, docs/*.md and the notebooks runs here exactly as written,
with its stated settings (the notebooks at the sizes their own test uses), on the zoo model its page loads;
every head a page knocks out with ``phaselens.knockout(model, ...)`` or ``phaselens.analyses.knocked_out(model,
...)`` is ablated too. Each must cost at least 25% of the clean accuracy at its worst phase, with a CI that excludes 0: retraining a zoo model, or editing
a page, cannot silently turn an example into a null.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import phaselens

ROOT = Path(__file__).resolve().parents[1]
MIN_DAMAGE = -25.0  # percent of the clean accuracy, at the worst phase


def _code(path: Path) -> str:
    """The runnable text of a page: notebook code cells, or markdown with doctest prompts removed."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return re.sub(r"^(\s*)(>>>|\.\.\.) ?", r"\1", path.read_text(), flags=re.M)


def _calls(text: str, name: str) -> list[str]:
    """Every ``phaselens.<name>(...)`` call in ``text``, parentheses matched."""
    out = []
    for m in re.finditer(rf"phaselens\.{name}\(", text):
        depth, i = 0, m.end() - 1
        for i in range(m.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
        out.append(text[m.start() : i + 1])
    return out


def _examples() -> list[tuple[str, str, str, str]]:
    """``(page, zoo model, kind, code)``: ``kind`` is ``"ablate"`` (run the call) or ``"heads"`` (ablate them)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    found = []
    for path in pages:
        text = _code(path)
        zoo = re.search(r"\bmodel\s*=\s*phaselens\.load\(\s*['\"]zoo:([\w-]+)['\"]", text)
        if zoo is None:
            continue  # no zoo model on this page (e.g. real DeepSeek-V4 weights): nothing to run here
        page = str(path.relative_to(ROOT))
        found += [(page, zoo[1], "ablate", call) for call in _calls(text, "ablate") if "(model," in call]
        for call in _calls(text, "knockout") + _calls(text, r"analyses\.knocked_out"):
            heads = re.match(r"phaselens\.(?:knockout|analyses\.knocked_out)\(model,\s*(['\"][^'\"]+['\"])", call)
            ablated = [c for pg, _, kind, c in found if pg == page and kind == "ablate"]
            if heads and not any(heads[1][1:-1] in c for c in ablated) and (page, zoo[1], "heads", heads[1]) \
                    not in found:  # a head the page also ablates is checked by that call
                found.append((page, zoo[1], "heads", heads[1]))
    return found


EXAMPLES = _examples()


def test_the_examples_are_found():
    pages = {page for page, *_ in EXAMPLES}
    assert {"README.md", "docs/quickstart.md", "docs/api.md", "notebooks/02_phase_specialization.ipynb"} <= pages


def _notebook_namespace(monkeypatch) -> dict:
    """The sizes a notebook's first cell sets when its test runs it small."""
    monkeypatch.setenv("PHASELENS_NB_SMALL", "1")
    cells = json.loads((ROOT / "notebooks" / "02_phase_specialization.ipynb").read_text())["cells"]
    namespace: dict = {"os": os}
    exec("".join(next(c for c in cells if c["cell_type"] == "code")["source"]), namespace)
    return namespace


@pytest.fixture(scope="module")
def zoo():
    cache: dict[str, object] = {}
    return lambda name: cache.setdefault(name, phaselens.load(f"zoo:{name}"))


@pytest.mark.parametrize(("page", "model_name", "kind", "code"), EXAMPLES,
                         ids=[f"{p}:{c[:60]}" for p, _, _, c in EXAMPLES])
def test_documented_knockout_has_a_large_effect(page, model_name, kind, code, zoo, monkeypatch):
    namespace = {"phaselens": phaselens, "model": zoo(model_name)}
    if page.endswith(".ipynb"):
        namespace.update(_notebook_namespace(monkeypatch))
    if kind == "ablate":
        res = eval(code, namespace)
    else:
        res = phaselens.ablate(namespace["model"], eval(code), n_per_residue=16, progress=False)
    ph = res.per_phase()
    worst = ph.loc[ph["rel_change"].idxmin()]
    assert worst["rel_change"] <= MIN_DAMAGE and worst["ci_high"] < 0, (
        f"{page}: {code} on zoo:{model_name} costs only {worst['rel_change']:+.1f}% at its worst phase "
        f"{int(worst['phase'])} [CI {worst['ci_low']:+.1f}, {worst['ci_high']:+.1f}]; knock out a head the map "
        f"shows to matter (phaselens.specialization_map(model).most_specialized())\n{ph}")
