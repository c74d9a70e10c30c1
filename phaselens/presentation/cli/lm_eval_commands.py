"""lm-eval: lm-evaluation-harness with phaselens' models, stratified and exported tasks, and the read-back.

``phaselens lm-eval run ...`` is lm-eval's own command line (``lm-eval run ...``) with the models ``phaselens`` and
``phaselens-completions`` registered (lm-eval 0.4.13 has no plugin hook that would find them); ``stratify``,
``export`` and ``read`` are thin over :mod:`phaselens.integrations.lm_eval`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from phaselens.errors import InputError
from phaselens.presentation.cli.common import (
    FORCE_FILE_HELP,
    FORCE_HELP,
    _Command,
    _Group,
    app,
    check_out,
    friendly_errors,
    main_rank,
    say,
    write_csv,
)

lm_app = typer.Typer(name="lm-eval", no_args_is_help=True, add_completion=False, cls=_Group,
                     help="Phase-aware evaluation in lm-evaluation-harness: phaselens models, phase-stratified tasks, "
                          "exported phaselens tasks, and lm-eval's samples read back (docs/lm_eval.md).")
app.add_typer(lm_app, name="lm-eval")

TokOpt = Annotated[str | None, typer.Option(
    "--tokenizer", metavar="PATH", help="The model's tokenizer: a tokenizer.json or its folder, or zoo:NAME.")]


@lm_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                add_help_option=False)
def run_cmd(ctx: typer.Context) -> None:
    """lm-eval's own command line with the phaselens models registered; everything after `run` goes to lm-eval
    (`phaselens lm-eval run --help` shows lm-eval's options).

    Example: phaselens lm-eval run --model phaselens --model_args model=zoo:w8s4 --tasks phaselens_kv_recall
    --include_path tasks/ --log_samples --output_path out/
    """
    from phaselens.integrations.lm_eval.harness import run_cli

    friendly_errors(run_cli)(["run", *ctx.args])


@lm_app.command("stratify", cls=_Command)
@friendly_errors
def stratify_cmd(
    task: Annotated[str, typer.Argument(metavar="TASK", help="An lm-eval task name, or a task's YAML file.")],
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Folder to write <name>.yaml into.")],
    stride: Annotated[int, typer.Option(metavar="S", min=1, help="The compression stride phases are read at.")],
    tokenizer: TokOpt = None,
    modulus: Annotated[int | None, typer.Option(metavar="M", min=1,
                                                help="Shifts per document and the residues' period (default S).")] = None,
    filler: Annotated[str, typer.Option(metavar="TEXT", help="The padding unit (one token); auto: the first "
                                                               "token-exact one of ' .', ' ,', ...")] = "auto",
    origin: Annotated[int, typer.Option(metavar="N", min=0, help="The geometry's origin.")] = 0,
    prefix_tokens: Annotated[int | None, typer.Option(
        "--prefix-tokens", metavar="N", min=0,
        help="Tokens the backend puts before the context (default: the tokenizer's BOS prefix).")] = None,
    include_path: Annotated[str | None, typer.Option("--include-path", metavar="DIR",
                                                     help="Where TASK's own YAML lives, if not in lm-eval.")] = None,
    name: Annotated[str | None, typer.Option(metavar="NAME", help="The task's name (default <task>_phase<S>).")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
) -> None:
    """Write a phase-stratified variant of an lm-eval task: every document M times, behind k = 0..M-1 filler
    tokens, each sample's residue recorded.

    Example: phaselens lm-eval stratify arc_easy --tokenizer /data/model --stride 4 --out tasks/
    """
    from phaselens.integrations.lm_eval.stratification import write_stratified

    if tokenizer is None:
        raise InputError("stratify needs --tokenizer: the filler must be one token of the model's tokenizer.")
    path = write_stratified(task, out, tokenizer=tokenizer, stride=stride, modulus=modulus, filler=filler,
                            origin=origin, prefix_tokens=prefix_tokens, name=name, include_path=include_path,
                            overwrite=force)
    say(f"wrote {path}; run it with: lm_eval --tasks {path.stem} --include_path {path.parent} ...")


@lm_app.command("export", cls=_Command)
@friendly_errors
def export_cmd(
    model: Annotated[str | None, typer.Argument(
        metavar="[MODEL]", help="A zoo name or hf:PATH whose tokenizer, geometry and default task to use.")] = None,
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Folder to write the tasks into.")] = "lm_eval_tasks",
    task: Annotated[str, typer.Option(metavar="NAME", help="default (the model's task), needle, niah-128k or "
                                                           "fp8-probe.")] = "default",
    tokenizer: TokOpt = None,
    stride: Annotated[int | None, typer.Option(metavar="S", min=1, help="The stride phases are read at.")] = None,
    n_per_residue: Annotated[int, typer.Option("--n-per-residue", metavar="N", min=1, help="Items per residue.")] = 16,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the items.")] = 0,
    records: Annotated[int, typer.Option(metavar="N", min=2, help="niah-128k: key-value records.")] = 16000,
    length: Annotated[int, typer.Option(metavar="T", min=16, help="niah-128k: prompt length in tokens.")] = 131072,
    name: Annotated[str | None, typer.Option(metavar="NAME", help="The lm-eval task name.")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
) -> None:
    """Export phaselens' phase-controlled items as lm-eval tasks (YAML over local JSONL): <name> (multiple choice:
    answer vs distractor) and <name>_gen (one generated token).

    Example: phaselens lm-eval export w8s4 --out tasks/ --n-per-residue 16
    """
    from phaselens.integrations.lm_eval.export import export_task

    m = None
    if model is not None:
        from phaselens.presentation.cli.common import _load

        m = _load(model)
    elif tokenizer is None:
        raise InputError("export needs a MODEL or --tokenizer (the prompts become text in its tokens).")
    options = {"n_records": records, "length": length} if task == "niah-128k" else {}
    spec = None
    if m is None and stride is None:
        from phaselens.models.served.loader import served_geometry

        if str(tokenizer).startswith("zoo:"):
            raise InputError(f"give the zoo model itself as MODEL ({str(tokenizer)[4:]}): it has the geometry too.")

        spec = served_geometry(tokenizer, None)  # the checkpoint's config.json beside its tokenizer gives S
    chosen = None if task == "default" else _task(task, tokenizer, m)
    files = export_task(chosen, out, model=m, tokenizer=tokenizer, spec=spec, stride=stride,
                        n_per_residue=n_per_residue, seed=seed, name=name, overwrite=force, **options)
    say("wrote " + ", ".join(str(f) for f in files))
    say(f"run them with: lm_eval --tasks {files[1].stem},{files[2].stem} --include_path {files[0].parent} "
        "--log_samples --output_path OUT ...; then phaselens lm-eval read OUT")


def _task(task: str, tokenizer: str | None, model: object) -> object:
    if task in ("niah-128k", "fp8-probe"):
        return task
    if task == "needle":
        from phaselens.integrations.lm_eval.tokens import load_any_tokenizer
        from phaselens.tasks import Needle

        tok = load_any_tokenizer(tokenizer) if tokenizer is not None else model.tokenizer  # type: ignore[attr-defined]
        return Needle(tok)
    raise InputError(f"--task {task!r}: use default, needle, niah-128k or fp8-probe.")


@lm_app.command("read", cls=_Command)
@friendly_errors
def read_cmd(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help="lm-eval's --output_path folder or a samples_*.jsonl.")],
    task: Annotated[str | None, typer.Option(metavar="NAME", help="Which task, when SOURCE holds several.")] = None,
    filter: Annotated[str | None, typer.Option("--filter", metavar="NAME", help="Which filter of the task.")] = None,
    metric: Annotated[str | None, typer.Option(metavar="NAME", help="A stratified task's 0/1 metric (default acc, or "
                                                                    "exact_match for generation).")] = None,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the battery's resampling.")] = 0,
    out: Annotated[str | None, typer.Option("--out", metavar="FILE.csv", help="Write the per-item frame as CSV.")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
) -> None:
    """Read lm-eval's --log_samples output of an exported or stratified task as a PhaseEval: per-residue accuracy,
    the folded gap with its interval, the period test, the worst and boundary phases.

    Example: phaselens lm-eval read out/ --task phaselens_kv_recall --out kv.csv
    """
    from phaselens.integrations.lm_eval.samples import read_samples

    path = check_out(out, kind="file", force=force)
    ev = read_samples(source, task=task, filter=filter, metric=metric, seed=seed)
    say(ev.summary())
    say(ev.per_phase().to_string(index=False))
    if path and main_rank():
        write_csv(ev.to_frame("item"), path, force=force)
