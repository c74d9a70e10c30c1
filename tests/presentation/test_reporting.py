"""The generated report: files, numbers, atomic writes, and rendering in a real browser."""

from __future__ import annotations

import json
import shutil

import pytest

from phaselens.presentation.reporting import ReportSettings, report
from phaselens.presentation.reporting.browser import OVERLAPS_JS
from tests.support.models import LAYOUTS, task_model

TINY = ReportSettings(n_eval=4, n_record=2, n_map=2, n_cycle=2, n_repair=2)
TRAINING = {"steps": 25, "loss_curve_every_10": [4.5, 3.25, 2.0], "val": [[20, 0.25], [25, 0.5]]}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    a = task_model(LAYOUTS["w8s4-deepseek"])
    a.name = "tiny-w8s4"
    a.metadata["training"] = TRAINING  # as a trained model's card has it
    b = task_model(None)
    b.name = "tiny-full"
    out = tmp_path_factory.mktemp("rep") / "report"
    report([a, b], out, settings=TINY, progress=False, static=False)
    return out


def test_report_files_and_numbers(built):
    names = {p.name for p in built.iterdir()}
    assert {"index.html", "results.json", "headline.csv", "tiny-w8s4_per_residue.csv", "tiny-w8s4_map.csv",
            "tiny-w8s4_recording.csv", "tiny-w8s4_cycling.csv", "tiny-w8s4_repair.csv", "tiny-full_map.csv"} <= names
    res = json.loads((built / "results.json").read_text())
    head = res["tables"]["headline"]
    assert [r["model"] for r in head] == ["tiny-w8s4", "tiny-full"]
    assert head[1]["stride"] == 4  # the control is folded by the compressed model's stride
    per = res["tables"]["tiny-w8s4_per_residue"]
    assert len(per) == 8 and sum(r["n"] for r in per) == 8 * TINY.n_eval
    page = (built / "index.html").read_text()
    assert "plotly" in page and page.count('<section id="') >= 9
    assert "How this was made" in page and "phaselens.report(" in page
    assert "skipped (static=False)" in page
    assert "<script src=" not in page and len(page) > 3_000_000  # self-contained: plotly.js is embedded


def test_the_training_loss_curve_of_a_models_card_is_plotted(built):
    page = (built / "index.html").read_text()
    sec = page[page.index('<section id="training">'):]
    sec = sec[: sec.index("</section>")]
    assert "Training loss" in sec and "undertrained" in sec
    # the figure's data: the card's block means at the last step of each block (the last block is short)
    assert '"x":[10,20,25]' in sec.replace(" ", "") and '"y":[4.5,3.25,2.0]' in sec.replace(" ", "")
    assert '"x":[20,25]' in sec.replace(" ", "") and '"y":[0.25,0.5]' in sec.replace(" ", "")
    assert "tiny-full loss" not in sec  # a model built in code has no training record: no curve


def test_headline_sentence_opens_the_report(built):
    import re

    page = (built / "index.html").read_text()
    body = page[page.index("<body>"):]
    first = re.search(r"<h1>.*?</h1>\s*<p id=\"headline\"[^>]*><b>(.*?)</b></p>", body, re.S)
    assert first, "the headline sentence must follow the title"
    text = first.group(1)
    res = json.loads((built / "results.json").read_text())["tables"]["headline"]
    w8 = next(r for r in res if r["model"] == "tiny-w8s4")
    assert text.startswith("tiny-w8s4 loses ") and f"{100 * w8['gap']:.1f} pp" in text
    assert f"worst phase {w8['worst_phase']}" in text
    assert "the full-attention control tiny-full is " in text and text.endswith(".") and text.count(". ") == 0


def test_control_map_beside_and_captions_that_explain(built):
    page = (built / "index.html").read_text()
    assert 'id="tiny-full_head_map"' not in page  # no separate, differently scaled control map at the end
    head = page[page.index('<section id="tiny-w8s4_head_map">'):]
    head = head[: head.index("</section>")]
    assert "control tiny-full stands on the right on the same colour scale" in head
    cyc = page[page.index('<section id="tiny-w8s4_cycling">'):]
    cyc = cyc[: cyc.index("</section>")]
    assert "below 0 worse than that" in cyc


def test_csv_integer_columns_are_integers(built):
    import csv

    from phaselens.presentation.reporting.write import INTEGER_COLUMNS

    checked = 0
    for path in built.glob("*.csv"):
        with open(path) as f:
            rows = list(csv.DictReader(f))
        for col in INTEGER_COLUMNS & set(rows[0] if rows else ()):
            vals = [r[col] for r in rows if r[col] != ""]
            if all(v.lstrip("-").replace(".", "", 1).isdigit() for v in vals):  # numeric columns only
                assert all("." not in v for v in vals), (path.name, col, vals[:3])
                checked += 1
    assert checked >= 10
    with open(built / "tiny-w8s4_recording.csv") as f:
        first = next(csv.DictReader(f))
    assert [first[c] for c in ("layer", "head", "residue")] == ["0", "0", "0"]  # was "0,0.0,0.0"


def test_interrupted_report_leaves_no_partial_directory(tmp_path, monkeypatch):
    import phaselens.presentation.reporting.write as w

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(w, "tables", boom)
    m = task_model(LAYOUTS["w4s4-scalar"])
    with pytest.raises(KeyboardInterrupt):
        report([m], tmp_path / "r", settings=TINY, progress=False, static=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.browser
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_every_figure_renders_in_headless_chromium(built):
    from playwright.sync_api import sync_playwright

    page_html = (built / "index.html").read_text()
    n_figures = page_html.count('class="plotly-graph-div"')
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--no-first-run", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((built / "index.html").as_uri())
            page.wait_for_function(
                f"Array.from(document.querySelectorAll('.js-plotly-plot')).filter(d => d.querySelector('.main-svg')).length >= {n_figures}",
                timeout=30_000,
            )
            rendered = page.evaluate(
                "Array.from(document.querySelectorAll('.js-plotly-plot')).filter(d => d.querySelector('.main-svg')).length"
            )
            overlaps = page.evaluate(OVERLAPS_JS)
            headline_y = page.locator("#headline").bounding_box()["y"]
            first_fig_y = page.locator(".js-plotly-plot").first.bounding_box()["y"]
        finally:
            browser.close()
    assert n_figures >= 9 and rendered == n_figures
    assert errors == []
    # no subplot title or legend entry sits on a tick label, in any figure, as drawn
    assert [o for o in overlaps if o[1]] == []
    assert headline_y < first_fig_y
