"""Screenshots of a built report as a browser shows it (headless Chromium through playwright), to look at.

    .venv/bin/python -m tools.screenshot_report report docs/figures [SECTION ...]

Writes ``report_top.png`` (title, headline sentence, table) and one PNG per section id given (default:
every section) into the output folder, and prints what overlaps: any subplot title or legend whose box
meets a tick label of the same figure.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from phaselens.presentation.reporting.browser import OVERLAPS_JS


def main() -> None:
    from playwright.sync_api import sync_playwright

    report, out = Path(sys.argv[1]), Path(sys.argv[2])
    wanted = sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1150, "height": 900})
            page.goto((report / "index.html").resolve().as_uri())
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0")
            page.wait_for_timeout(1500)
            table = page.locator("table").first.bounding_box()
            page.screenshot(path=str(out / "report_top.png"),
                            clip={"x": 0, "y": 0, "width": 1150, "height": table["y"] + table["height"] + 20})
            ids = wanted or page.evaluate("Array.from(document.querySelectorAll('section')).map(s => s.id)")
            for sid in ids:
                page.locator(f"section#{sid}").screenshot(path=str(out / f"report_{sid}.png"))
            print(json.dumps({"overlaps": page.evaluate(OVERLAPS_JS), "shots": ["report_top", *ids]}, indent=1))
        finally:
            browser.close()


if __name__ == "__main__":
    main()
