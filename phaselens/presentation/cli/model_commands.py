"""plan and zoo: what a checkpoint needs, and the embedded zoo."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from phaselens.presentation.cli.common import (
    _Command,
    _Group,
    app,
    friendly_errors,
    say,
)


@app.command("plan", cls=_Command)
@friendly_errors
def plan_cmd(
    source: Annotated[str, typer.Argument(
        metavar="SOURCE", help="A checkpoint directory (or hf:DIR); one that holds only config.json is enough.")],
    context: Annotated[int, typer.Option("--context", metavar="T", min=1, help="Tokens per sequence.")] = 131072,
    gpu_memory: Annotated[str, typer.Option(
        "--gpu-memory", metavar="GB", help="Memory of one GPU: GB (141), '80GiB', or H100 / H200 / B200.")] = "141",
    chunk: Annotated[int | None, typer.Option(
        "--chunk", metavar="N", min=1,
        help="Prefill chunk (default: the largest that fits the smallest node found for a 128K map).")] = None,
    batch: Annotated[int, typer.Option("--batch", metavar="B", min=1, help="Sequences per forward.")] = 1,
    engram: Annotated[str, typer.Option(
        "--engram", metavar="run|drop", help="DeepSeek-V4.1: plan with Engram's tables (run, load's default) or "
                                             "without them (drop).")] = "run",
    map_context: Annotated[int | None, typer.Option(
        "--map-context", metavar="T", min=1, help="Tokens per item of the per-head map (default 131072).")] = None,
    items: Annotated[int, typer.Option("--items", metavar="N", min=1,
                                       help="Items of the per-head map whose time is priced.")] = 8,
    item_batch: Annotated[int, typer.Option("--item-batch", metavar="B", min=1,
                                            help="Items per batch of the map (one prefix pass each).")] = 1,
    mfu: Annotated[float, typer.Option("--mfu", metavar="F", help="Fraction of the GPU's peaks reached (time).")]
    = 0.4,
    peak_tflops: Annotated[float | None, typer.Option(
        "--peak-tflops", metavar="TF", help="bf16 dense peak of one GPU (default: the --gpu-memory type's; "
                                            "H100/H200 989, B200 2250).")] = None,
    fp32_tflops: Annotated[float | None, typer.Option(
        "--fp32-tflops", metavar="TF", help="fp32 peak of one GPU (default: H100/H200 67, B200 80).")] = None,
    hbm_tbps: Annotated[float | None, typer.Option(
        "--hbm-tbps", metavar="TB", help="GPU memory bandwidth in TB/s (default: H100 3.35, H200 4.8, "
                                         "B200 8).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (bytes).")] = False,
) -> None:
    """What a DeepSeek-V4 / V4.1 checkpoint needs, from config.json alone (no weights read): weights as stored
    and as loaded, cache and activations at --context, GPUs of --gpu-memory, the smallest node for a 128K map;
    for V4.1 also where Engram's tables go and the time (FLOPs, bytes, GPU-hours) of a forward and of the map.

    Example: phaselens plan hf:/data/DeepSeek-V4.1-Flash --gpu-memory H100 --items 8 --json
    """
    import json

    from phaselens.planning.plans import plan as plan_of

    plan = plan_of(source, "specialization_map", context=context, gpu_memory=gpu_memory, chunk=chunk, batch=batch,
                   engram=engram, map_context=map_context, items=items, item_batch=item_batch, mfu=mfu,
                   peak_tflops=peak_tflops, fp32_tflops=fp32_tflops, hbm_tbps=hbm_tbps)
    say(json.dumps(plan.to_dict(), indent=2) if as_json else str(plan))


zoo_app = typer.Typer(help="The embedded zoo of tiny compressed models.", no_args_is_help=True, cls=_Group)
app.add_typer(zoo_app, name="zoo")


def _p(p: float | None) -> str:
    return "n/a" if p is None else "<1e-300" if p == 0 else f"{p:.2g}"


def zoo_table(rows: list[dict[str, Any]], width: int = 80) -> str:
    """The zoo's headline numbers as plain text that never cuts a model's name (description on its own line)."""
    import textwrap

    head = ("model", "mean", "worst", "bound", "gap [95% CI]", "period", "p(G)", "p(nested)")
    cells = []
    for r in rows:
        b = r["battery"]
        lo, hi = b["gap_ci"]
        cells.append((r["name"], f"{100 * b['mean']:.1f}", f"{100 * b['worst']:.1f}", f"{100 * b['boundary']:.1f}",
                      f"{100 * b['gap']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]", str(b["period"] or "none"),
                      _p(b["p_g"]), _p(b["p_nested"])))
    widths = [max(len(str(c[i])) for c in [head, *cells]) for i in range(len(head))]

    def line(c: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))).rstrip()

    out = [line(head), "  ".join("-" * w for w in widths)]
    for r, c in zip(rows, cells):
        out.append(line(c))
        out += textwrap.wrap(r["description"], width=max(40, width - 1), initial_indent="  ", subsequent_indent="  ")
    out += ["", *textwrap.wrap("mean, worst, bound: accuracy in % (mean over phases, worst phase, boundary phase); "
                               "gap: folded phase gap in percentage points with its bootstrap CI; period: detected "
                               "period; p(G): G test of accuracy by residue; p(nested): residues mod M against mod S.",
                               width=max(40, width - 1))]
    return "\n".join(out)


@zoo_app.command("list", cls=_Command)
@friendly_errors
def zoo_list() -> None:
    """Each shipped model with its card's headline.

    Example: phaselens zoo list
    """
    import shutil

    from phaselens.models.zoo import entry, list_models

    rows = [entry(name).card for name in list_models()]
    typer.echo(zoo_table(rows, width=shutil.get_terminal_size((80, 24)).columns))
