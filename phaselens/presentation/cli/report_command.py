"""report: the figure report."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from phaselens.presentation.cli.base import (
    FORCE_HELP,
    PROGRESS_HELP,
    _Command,
    app,
    check_out,
    friendly_errors,
    say,
)


@app.command(cls=_Command)
@friendly_errors
def report(
    models: Annotated[list[str] | None, typer.Argument(
        metavar="[MODELS]...", help="Zoo names, checkpoint dirs or hf:PATH (default: w8s4 full).")] = None,
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Directory to write the report into.")] = "report",
    quick: Annotated[bool, typer.Option("--quick", help="Smaller samples (a fast look, wider CIs).")] = False,
    static: Annotated[bool, typer.Option("--static/--no-static", help="Write PNGs when a Chromium is present.")] = True,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
) -> None:
    """Write the figure report: evaluation, battery, recordings, maps, gate cycling and repair.

    Example: phaselens report w8s4 full --out report
    """
    from phaselens.presentation.reporting import ReportSettings
    from phaselens.presentation.reporting import report as build

    check_out(out, kind="dir", what="the report is a folder")
    settings = ReportSettings(n_eval=40, n_record=8, n_map=12, n_cycle=24, n_repair=24) if quick else ReportSettings()
    path = build(models or None, out, settings=settings, progress=progress, static=static, overwrite=force,
                 command=" ".join(["phaselens", *sys.argv[1:]]))
    say(f"report written to {path}/index.html")
