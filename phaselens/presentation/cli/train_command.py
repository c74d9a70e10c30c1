"""train: a zoo recipe, or a member of the paper's family (one process or torchrun)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from phaselens.errors import InputError
from phaselens.presentation.cli.common import (
    FORCE_HELP,
    PROGRESS_HELP,
    _Command,
    _label,
    app,
    friendly_errors,
    say,
)

FAMILY_HELP = "Paper family only (--recipe paper-*)."


@app.command(cls=_Command)
@friendly_errors
def train(
    recipe: Annotated[str, typer.Option("--recipe", metavar="NAME", help=(
        "A zoo recipe name (see `phaselens zoo list`), or NAME-seedK for another seed K; or a recipe of the "
        "paper's family: paper-full, paper-w4s4, paper-w8s4, paper-w6s6, paper-w12s6, paper-w8s8, paper-w16s8, "
        "paper-w12s12, paper-w24s12, paper-w4s4-mean, paper-w4s4-norope (with --size)."))],
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Directory that receives the model directory.")]
    = "zoo-out",
    runs: Annotated[str | None, typer.Option("--runs", metavar="DIR", help=(
        "Where resumable checkpoints (and a family run's log.json) live (default: runs/zoo, runs/family).")
    )] = None,
    steps: Annotated[int | None, typer.Option(
        "--steps", metavar="N", min=1,
        help="Train this many steps instead of the recipe's (a different run: its schedule and checkpoints differ).")]
    = None,
    threads: Annotated[int, typer.Option("--threads", metavar="N", min=1,
                                         help="Torch threads (a bit-identical resume needs the same count).")] = 1,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
    size: Annotated[str | None, typer.Option("--size", metavar="SIZE", help=(
        f"{FAMILY_HELP} The backbone's size: tiny, small, base or 0.6b (Qwen3-0.6B) (default: tiny).")
    )] = None,
    plan: Annotated[bool, typer.Option("--plan", help=(
        f"{FAMILY_HELP} Print what the run costs (parameters, tokens, FLOPs per layer kind, memory per GPU under FSDP, "
        "GPU-hours) without building the model, and exit."))] = False,
    gpus: Annotated[str | None, typer.Option("--gpus", metavar="LIST", help=(
        f"{FAMILY_HELP} GPU counts to plan for, comma-separated (default: 1,8,64)."))] = None,
    mfu: Annotated[float, typer.Option("--mfu", metavar="U", min=0.01, max=1.0, help=(
        f"{FAMILY_HELP} Utilisation of the peak the plan's GPU-hours assume, on the FLOPs the GPU executes "
        "(activation recompute included)."))] = 0.40,
    peak_tflops: Annotated[float, typer.Option("--peak-tflops", metavar="T", min=1.0, help=(
        f"{FAMILY_HELP} Peak TFLOP/s per GPU the plan assumes (default: 989, dense bf16 H100/H200)."))] = 989.0,
    tokens: Annotated[float | None, typer.Option("--tokens", metavar="N", help=(
        f"{FAMILY_HELP} Token budget (sets the steps; e.g. 1e11) (default: the size's; 0.6b: 1e11)."))] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", metavar="B", min=1, help=(
        f"{FAMILY_HELP} Global batch in sequences (split over the ranks)."))] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", metavar="B", min=1, help=(
        f"{FAMILY_HELP} Sequences per forward on each rank (gradient accumulation)."))] = None,
    precision: Annotated[str | None, typer.Option("--precision", metavar="P", help=(
        f"{FAMILY_HELP} fp32 or bf16 (default: bf16 with CUDA, fp32 on CPU)."))] = None,
    recompute_activations: Annotated[bool | None, typer.Option(
        "--recompute-activations/--no-recompute-activations", help=(
            f"{FAMILY_HELP} Recompute block activations in the backward (default: on with CUDA)."))] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", min=0, help=(
        f"{FAMILY_HELP} Seed of the initial weights and the data."))] = 0,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", metavar="N", min=1, help=(
        f"{FAMILY_HELP} KV heads, a divisor of the query heads (the paper's baseline: 1; Qwen3-0.6B: 8; "
        "default: the size's)."))] = None,
    vocab: Annotated[int | None, typer.Option("--vocab", metavar="N", min=1, help=(
        f"{FAMILY_HELP} Vocabulary size (default: the task's below 0.6b; Qwen3's 151,936 at 0.6b)."))] = None,
    pretrain: Annotated[list[str] | None, typer.Option("--pretrain", metavar="FILE", help=(
        f"{FAMILY_HELP} Your pretraining tokens: a 1-D .npy or a raw binary file of ids (repeatable)."))] = None,
    pretrain_ratio: Annotated[float, typer.Option("--pretrain-ratio", metavar="R", min=0.0, max=0.99, help=(
        f"{FAMILY_HELP} Fraction of each batch's sequences cut from --pretrain files."))] = 0.0,
    pretrain_dtype: Annotated[str, typer.Option("--pretrain-dtype", metavar="T", help=(
        f"{FAMILY_HELP} Id type of raw --pretrain files: uint16, uint32, int32, int64."))] = "uint16",
    eval_per_residue: Annotated[int, typer.Option("--eval-per-residue", metavar="N", min=0, help=(
        f"{FAMILY_HELP} Items per residue of the final evaluation with the battery (0: none)."))] = 256,
    time_limit: Annotated[float | None, typer.Option("--time-limit", metavar="SECONDS", min=0.0, help=(
        f"{FAMILY_HELP} Stop with a checkpoint once this many seconds have passed (e.g. inside a job's "
        "wall-clock limit); rerun to resume."))] = None,
) -> None:
    """Train one zoo model or a member of the paper's family, resuming if interrupted; writes OUT/NAME.

    Under torchrun a family recipe trains across the ranks with FSDP2:
    torchrun --nproc-per-node 8 -m phaselens train --recipe paper-w4s4 --size 0.6b

    Example: phaselens train --recipe w8s4 --out my-zoo

    Example: phaselens train --recipe paper-w4s4 --size tiny

    Example: phaselens train --recipe paper-w4s4 --size 0.6b --plan
    """
    from phaselens.runtime.budget import check_threads

    check_threads(threads, name="--threads")  # torch/OpenMP abort the whole process on a count they cannot start
    if recipe.startswith("paper-"):
        from phaselens.train.family.command import FamilyArgs
        from phaselens.train.family.command import run as run_family

        try:
            gpu_list = tuple(int(g) for g in gpus.split(",")) if gpus is not None else ()
        except ValueError:
            raise InputError(f"--gpus {gpus!r}: give GPU counts separated by commas, e.g. 1,8,64.") from None
        if gpus is not None and not gpu_list or any(g < 1 for g in gpu_list):
            raise InputError(f"--gpus {gpus!r}: GPU counts must be positive, e.g. 1,8,64.")
        if not plan:  # every other argument: run_family's check_args, before anything is built
            _check_out_folder(out)
        run_family(FamilyArgs(
            recipe=recipe, size="tiny" if size is None else size, out=out, runs=runs or "runs/family", steps=steps,
            tokens=tokens,
            batch_size=batch_size, seed=seed, vocab=vocab, kv_heads=kv_heads, precision=precision,
            recompute_activations=recompute_activations, micro_batch=micro_batch, pretrain=tuple(pretrain or ()),
            pretrain_ratio=pretrain_ratio, pretrain_dtype=pretrain_dtype, eval_per_residue=eval_per_residue,
            time_limit=time_limit,
            threads=threads, plan=plan, gpus=gpu_list, mfu=mfu, peak_tflops=peak_tflops, force=force,
            progress=progress), say)
        return
    family_only = {"--size": size, "--plan": plan or None, "--gpus": gpus, "--tokens": tokens,
                   "--batch-size": batch_size, "--micro-batch": micro_batch, "--precision": precision,
                   "--recompute-activations": recompute_activations, "--vocab": vocab, "--pretrain": pretrain,
                   "--kv-heads": kv_heads,
                   "--seed": seed or None, "--pretrain-ratio": pretrain_ratio or None, "--time-limit": time_limit,
                   "--eval-per-residue": None if eval_per_residue == 256 else eval_per_residue,
                   "--mfu": None if mfu == 0.40 else mfu,
                   "--peak-tflops": None if peak_tflops == 989.0 else peak_tflops,
                   "--pretrain-dtype": None if pretrain_dtype == "uint16" else pretrain_dtype}
    given = [k for k, v in family_only.items() if v is not None]
    if given:
        raise InputError(f"{', '.join(given)} apply to the paper's family only (--recipe paper-LAYOUT); zoo recipe "
                         f"{recipe!r} takes --out, --runs, --steps, --threads and --force (use {recipe}-seedK for "
                         "another seed).")
    runs = runs or "runs/zoo"
    from phaselens.train.loop import saved_step
    from phaselens.train.zoo_recipes import get_recipe

    chosen = get_recipe(recipe)  # a clear error for an unknown name, before any work
    _check_out_folder(out)
    from phaselens.models.compressed.io import checkpoint_kind
    from phaselens.storage.writing import check_output_dir

    check_output_dir(Path(out) / recipe, checkpoint_kind(extra=("eval_batch.safetensors",)), overwrite=force)
    run_dir = Path(runs) / recipe
    from phaselens.train.family.command import check_runs

    check_runs(runs, run_dir)
    total = steps or chosen.settings.steps
    again = " ".join(["phaselens", "train", "--recipe", recipe, "--out", out, "--runs", runs, "--threads", str(threads),
                      *(["--steps", str(steps)] if steps else []), *(["--force"] if force else [])])
    done = saved_step(run_dir)
    if done is not None:
        typer.echo(f"resuming {recipe} from step {done} of {total} (checkpoint in {run_dir})", err=True)

    import torch

    from phaselens.train.zoo_training import build_zoo_model

    torch.set_num_threads(threads)
    try:
        with _label(recipe):
            card = build_zoo_model(recipe, out, run_dir=runs, progress=progress, steps=steps, threads=threads,
                                   overwrite=force)
    except KeyboardInterrupt:
        at = saved_step(run_dir)
        where = f"the last checkpoint is step {at} of {total} in {run_dir}" if at else "no checkpoint was written yet"
        typer.echo(f"\ninterrupted: {where}; resume with: {again}", err=True)
        raise typer.Exit(130) from None
    b = card["battery"]
    typer.echo(f"{recipe}: mean {100 * b['mean']:.1f}%, worst {100 * b['worst']:.1f}%, gap {100 * b['gap']:.1f} pp, "
               f"period {b['period']}; written to {Path(out) / recipe}")


def _check_out_folder(out: str) -> None:
    """``--out``: created with its missing parents like ``--runs`` (a file on the way, or a folder that cannot
    be written, is refused before any training)."""
    from phaselens.train.family.command import check_folder

    check_folder("--out", out, Path(out).expanduser(), "the trained model")
