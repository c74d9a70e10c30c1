"""The ``phaselens`` command line: a thin layer over the Python API.

Exit codes: 0 ok; 2 bad usage (typer); 3 a ``PhaseLensError``, printed as one line (``--debug`` shows
the traceback).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

import phaselens
from phaselens.errors import PhaseLensError

app = typer.Typer(
    name="phaselens",
    help="Phase sensitivity and phase specialization in chunk-compressed KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}
F = TypeVar("F", bound=Callable[..., Any])


def friendly_errors(fn: F) -> F:
    """Turn a PhaseLensError into one readable line and exit code 3 (unless --debug)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PhaseLensError as err:
            if _state["debug"]:
                raise
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(3) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"phaselens {phaselens.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks of phaselens errors.")] = False,
) -> None:
    """phaselens: measure how a compressed-cache model's answers depend on token phase."""
    _state["debug"] = debug


def _load(model: str):
    return phaselens.load(model)


@app.command("eval")
@friendly_errors
def eval_cmd(
    model: Annotated[str, typer.Argument(help="Zoo name, checkpoint directory or hf:PATH.")],
    n_per_residue: Annotated[int, typer.Option("--n-per-residue", help="Items per residue.")] = 256,
    seed: Annotated[int, typer.Option(help="Item seed.")] = 0,
    out: Annotated[str | None, typer.Option("--out", help="Write the per-item frame as CSV.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Phase-aware evaluation with the statistics battery.

    Example: phaselens eval w8s4 --n-per-residue 256 --out w8s4.csv
    """
    ev = phaselens.evaluate(_load(model), n_per_residue=n_per_residue, seed=seed, progress=progress)
    typer.echo(ev.summary())
    if out:
        ev.to_frame().to_csv(out, index=False)


@app.command("record")
@friendly_errors
def record_cmd(
    model: Annotated[str, typer.Argument(help="Zoo name, checkpoint directory or hf:PATH.")],
    n_per_residue: Annotated[int, typer.Option("--n-per-residue")] = 64,
    out: Annotated[str | None, typer.Option("--out", help="Write the tidy recording as CSV.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Record attention into compressed entries and the compressors' gate weights, by residue.

    Example: phaselens record w8s4 --out w8s4-recording.csv
    """
    rec = phaselens.record(_load(model), n_per_residue=n_per_residue, progress=progress)
    typer.echo(repr(rec))
    if out:
        rec.to_frame().to_csv(out, index=False)


@app.command("map")
@friendly_errors
def map_cmd(
    model: Annotated[str, typer.Argument(help="Zoo name, checkpoint directory or hf:PATH.")],
    n_per_residue: Annotated[int, typer.Option("--n-per-residue")] = 64,
    method: Annotated[str, typer.Option(help="mean, zero or resample.")] = "mean",
    checkpoint: Annotated[str | None, typer.Option(help="Resumable .npz of finished cells.")] = None,
    out: Annotated[str | None, typer.Option("--out", help="Write the tidy map as CSV.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Knock out every head, KV head and layer at the query; effects per residue, specialization index.

    Example: phaselens map w8s4 --checkpoint runs/w8s4-map.npz --out w8s4-map.csv
    """
    pm = phaselens.specialization_map(_load(model), method=method, n_per_residue=n_per_residue,
                                      checkpoint=checkpoint, progress=progress)
    typer.echo(repr(pm))
    typer.echo(pm.specialization_index().to_string(index=False))
    if out:
        pm.to_frame().to_csv(out, index=False)


zoo_app = typer.Typer(help="The embedded zoo of tiny compressed models.", no_args_is_help=True)
app.add_typer(zoo_app, name="zoo")


@app.command()
@friendly_errors
def train(
    recipe: Annotated[str, typer.Option("--recipe", help="A zoo recipe name (see `phaselens zoo list`), or NAME-seedK for another seed K.")],
    out: Annotated[str, typer.Option("--out", help="Directory that receives the model directory.")] = "zoo-out",
    runs: Annotated[str, typer.Option("--runs", help="Where resumable checkpoints live.")] = "runs/zoo",
    threads: Annotated[int, typer.Option("--threads", help="Torch threads (resume needs the same count).")] = 1,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Train one zoo model from its recipe, resuming if interrupted; writes OUT/RECIPE.

    Example: phaselens train --recipe w8s4 --out my-zoo
    """
    import torch

    from phaselens.zoo.build import build_zoo_model
    from phaselens.zoo.recipes import get_recipe

    get_recipe(recipe)  # a clear error for an unknown name, before any work
    torch.set_num_threads(threads)
    card = build_zoo_model(recipe, out, run_dir=runs, progress=progress)
    b = card["battery"]
    typer.echo(f"{recipe}: mean {100 * b['mean']:.1f}%, worst {100 * b['worst']:.1f}%, gap {100 * b['gap']:.1f} pp, "
               f"period {b['period']}")


@zoo_app.command("list")
@friendly_errors
def zoo_list() -> None:
    """Each shipped model with its card's headline.

    Example: phaselens zoo list
    """
    from rich.console import Console
    from rich.table import Table

    from phaselens.zoo import entry, list_models

    table = Table("model", "what it is", "mean %", "worst %", "boundary %", "gap pp [95% CI]", "period",
                  "p (G)", "p (nested)")
    for name in list_models():
        card = entry(name).card
        b = card["battery"]
        lo, hi = b["gap_ci"]
        table.add_row(name, card["description"], f"{100 * b['mean']:.1f}", f"{100 * b['worst']:.1f}",
                      f"{100 * b['boundary']:.1f}", f"{100 * b['gap']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]",
                      str(b["period"]), f"{b['p_g']:.2g}", f"{b['p_nested']:.2g}")
    Console().print(table)


@app.command()
@friendly_errors
def report(
    models: Annotated[list[str] | None, typer.Argument(help="Zoo names, checkpoint dirs or hf:PATH (default: w8s4 full).")] = None,
    out: Annotated[str, typer.Option("--out", help="Directory to write the report into.")] = "report",
    quick: Annotated[bool, typer.Option("--quick", help="Smaller samples (a fast look, wider CIs).")] = False,
    static: Annotated[bool, typer.Option("--static/--no-static", help="Write PNGs when a Chromium is present.")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Write the figure report: evaluation, battery, recordings, maps, gate cycling and repair.

    Example: phaselens report w8s4 full --out report
    """
    import sys

    from phaselens.reporting import ReportSettings
    from phaselens.reporting import report as build

    settings = ReportSettings(n_eval=40, n_record=8, n_map=12, n_cycle=24, n_repair=24) if quick else ReportSettings()
    path = build(models or None, out, settings=settings, progress=progress, static=static,
                 command=" ".join(["phaselens", *sys.argv[1:]]))
    typer.echo(f"report written to {path}/index.html")


if __name__ == "__main__":
    app()
