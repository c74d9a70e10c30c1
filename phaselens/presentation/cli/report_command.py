"""report: the figure report."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from phaselens.errors import InputError
from phaselens.presentation.cli import served_options as so
from phaselens.presentation.cli.common import (
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
        metavar="[MODELS]...", help="Zoo names, checkpoint dirs, hf:PATH or served models http://HOST:PORT/v1 "
                                    "(default: w8s4 full).")] = None,
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Directory to write the report into.")] = "report",
    quick: Annotated[bool, typer.Option("--quick", help="Smaller samples (a fast look, wider CIs).")] = False,
    static: Annotated[bool, typer.Option("--static/--no-static", help="Write PNGs when a Chromium is present.")] = True,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
    tokenizer: so.TokenizerOpt = None,
    served_model: so.ServedModelOpt = None,
    concurrency: so.ConcurrencyOpt = None,
    task: so.TaskOpt = None,
    records: so.RecordsOpt = 16000,
    length: so.LengthOpt = 131072,
    retries: so.RetriesOpt = 6,
    lm_eval: Annotated[list[str] | None, typer.Option(
        "--lm-eval", metavar="PATH", help="lm-eval --output_path folder (or samples file) of tasks phaselens exported "
                                          "or stratified: each is read back and reported (repeatable; alone, the "
                                          "report holds only these).")] = None,
) -> None:
    """Write the figure report: evaluation, battery, recordings, maps, gate cycling and repair (a served model:
    evaluation, battery and repair; the options for served models apply to every URL given).

    Example: phaselens report w8s4 full --out report; with lm-eval's samples: phaselens report --lm-eval out/
    """
    from phaselens.presentation.reporting import ReportSettings
    from phaselens.presentation.reporting import report as build

    check_out(out, kind="dir", what="the report is a folder")
    served = so.Served(tokenizer, served_model, concurrency, task, records, length, retries)
    chosen: list = [served.load(m) if so.is_url(m) else m for m in models or []]  # served models loaded here
    if tokenizer is not None and not any(so.is_url(m) for m in models or []):
        raise InputError("--tokenizer and the other served-model options apply to served models "
                         "(http://HOST:PORT/v1); none was given.")
    settings = ReportSettings(n_eval=40, n_record=8, n_map=12, n_cycle=24, n_repair=24) if quick else ReportSettings()
    path = build(chosen or None, out, settings=settings, progress=progress, static=static, overwrite=force,
                 command=" ".join(["phaselens", *sys.argv[1:]]), lm_eval=lm_eval or None)
    say(f"report written to {path}/index.html")
