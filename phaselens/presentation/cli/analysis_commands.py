"""eval, record and map: the analyses, each a thin call of the Python API."""

from __future__ import annotations

from typing import Annotated

import typer

from phaselens.presentation.cli.common import (
    FORCE_FILE_HELP,
    MODEL_HELP,
    PROGRESS_HELP,
    NPerResidueOpt,
    _Command,
    _label,
    _load,
    _load_for_phases,
    app,
    check_out,
    friendly_errors,
    main_rank,
    require_default_task,
    say,
    write_csv,
)
from phaselens.presentation.cli.served_options import (
    ConcurrencyOpt,
    LengthOpt,
    RecordsOpt,
    RetriesOpt,
    Served,
    ServedModelOpt,
    TaskOpt,
    TokenizerOpt,
    is_url,
    price,
)


@app.command("eval", cls=_Command)
@friendly_errors
def eval_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP + " Or a served model: http://HOST:PORT/v1.",
                                         metavar="MODEL")],
    n_per_residue: NPerResidueOpt = None,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the items and of the battery's resampling.")] = 0,
    stride: Annotated[int | None, typer.Option(
        metavar="S", help="Fold residues by this stride; required for a model without compressed layers "
                          "(the full-attention control: use the compressed model's stride, e.g. 4).")] = None,
    out: Annotated[str | None, typer.Option("--out", metavar="FILE.csv", help="Write the per-item frame as CSV.")] = None,
    journal: Annotated[str | None, typer.Option(metavar="FILE",
                                                help="The result journal: finished item blocks (rerun to resume).")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
    tokenizer: TokenizerOpt = None,
    served_model: ServedModelOpt = None,
    concurrency: ConcurrencyOpt = None,
    task: TaskOpt = None,
    records: RecordsOpt = 16000,
    length: LengthOpt = 131072,
    retries: RetriesOpt = 6,
    plan: Annotated[bool, typer.Option("--plan", help="Print what a served model's run costs (requests, prompt "
                                                      "tokens, prefix-cache saving, time at --prefill-rate) and exit; "
                                                      "needs only --tokenizer, not the server.")] = False,
    prefill_rate: Annotated[float, typer.Option("--prefill-rate", metavar="TOK/S", min=1e-9,
                                                help="--plan: the server's prefill rate in tokens/s.")] = 10_000.0,
) -> None:
    """Phase-aware evaluation with the statistics battery.

    Example: phaselens eval w8s4 --n-per-residue 256 --out w8s4.csv

    A served model: phaselens eval http://node:8000/v1 --tokenizer /data/DeepSeek-V4-Flash-Base --task niah-128k
    --journal flash.journal --out flash.csv
    """
    from phaselens.analyses.evaluation import evaluate

    opts = Served(tokenizer, served_model, concurrency, task, records, length, retries)
    opts.check(model)
    n = opts.items(n_per_residue, model)
    if plan:
        say(str(price(model, opts, n_per_residue=n, seed=seed, stride=stride, rate=prefill_rate)))
        return
    path = check_out(out, kind="file", force=force)
    with _label(model):
        if is_url(model):
            m, fold = opts.load(model, stride), None  # --stride is the served model's stride
        else:
            m, fold = _load_for_phases(model, stride), stride
        items = opts.preset(opts_tokenizer(opts), model) if task is not None and not is_url(model) else None
        if items is None:  # a run folder or a transformers checkpoint: the fix in the command line's words
            require_default_task(m, model, "eval", task_option=True)
        ev = evaluate(m, items, n_per_residue=n, seed=seed, progress=progress, stride=fold,
                                journal=journal)
    say(ev.summary())
    if path and main_rank():
        write_csv(ev.to_frame("item"), path, force=force)


@app.command("record", cls=_Command)
@friendly_errors
def record_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP, metavar="MODEL")],
    n_per_residue: NPerResidueOpt = None,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the items.")] = 0,
    out: Annotated[str | None, typer.Option("--out", metavar="FILE.csv", help="Write the tidy recording as CSV.")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
) -> None:
    """Record attention into compressed entries and the compressors' gate weights, by residue.

    Example: phaselens record w8s4 --out w8s4-recording.csv
    """
    from phaselens.analyses.recording import record

    path = check_out(out, kind="file", force=force)
    with _label(model):
        m = require_default_task(_load(model), model, "record", task_option=False)
        rec = record(m, n_per_residue=n_items(n_per_residue), seed=seed, progress=progress)
    say(repr(rec))
    if path and main_rank():
        write_csv(rec.to_frame(), path, force=force)


def n_items(n_per_residue: int | None) -> int:
    """``--n-per-residue``, or the analyses' one default."""
    from phaselens.analyses.runner import N_PER_RESIDUE

    return N_PER_RESIDUE if n_per_residue is None else n_per_residue


def opts_tokenizer(opts: Served) -> object:
    """The ``--tokenizer`` of an in-process model's ``--task`` preset."""
    from phaselens.models.served.vocabulary import load_tokenizer

    return load_tokenizer(opts.tokenizer)


KINDS = ("head", "kv_head", "layer")


def _parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise typer.BadParameter(f"{text!r}: give a comma-separated subset of {','.join(KINDS)}.")
    return kinds


@app.command("map", cls=_Command)
@friendly_errors
def map_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP, metavar="MODEL")],
    n_per_residue: NPerResidueOpt = None,
    method: Annotated[str, typer.Option(metavar="NAME", help="Replacement of a head's output: mean, zero or resample.")] = "mean",
    kinds: Annotated[str, typer.Option(metavar="LIST", help="Cells to map, comma-separated: head, kv_head, layer.")]
    = ",".join(KINDS),
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the items (and of resample knockouts).")] = 0,
    stride: Annotated[int | None, typer.Option(
        metavar="S", help="Fold residues by this stride; required for a model without compressed layers.")] = None,
    journal: Annotated[str | None, typer.Option(metavar="FILE",
                                                help="The result journal: finished cells (rerun to resume).")] = None,
    out: Annotated[str | None, typer.Option("--out", metavar="FILE.csv", help="Write the tidy map as CSV.")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
    plan: Annotated[bool, typer.Option("--plan", help="Print what the map would run (cells, forwards, token passes, "
                                                      "a memory estimate) and exit without running it.")] = False,
) -> None:
    """Knock out every head, KV head and layer at the query; effects per residue, specialization index.

    Example: phaselens map w8s4 --journal runs/w8s4-map.journal --out w8s4-map.csv
    """
    from phaselens.analyses.maps import specialization_map

    kind_tuple = _parse_kinds(kinds)
    if plan:
        m = require_default_task(_load_for_phases(model, stride), model, "map", task_option=False)
        from phaselens.planning.plans import plan as plan_of

        say(repr(plan_of(m, specialization_map, method=method, n_per_residue=n_items(n_per_residue), seed=seed,
                         kinds=kind_tuple, stride=stride)))
        return
    path = check_out(out, kind="file", force=force)
    with _label(model):
        m = require_default_task(_load_for_phases(model, stride), model, "map", task_option=False)
        pm = specialization_map(m, method=method, n_per_residue=n_items(n_per_residue), seed=seed,
                                          kinds=kind_tuple, stride=stride, journal=journal, progress=progress)
    say(repr(pm))
    if "head" in kind_tuple:
        say(pm.specialization_index().to_string(index=False))
    if path and main_rank():
        write_csv(pm.to_frame(), path, force=force)
