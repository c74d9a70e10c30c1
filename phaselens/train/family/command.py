"""The body of ``phaselens train --recipe paper-LAYOUT --size SIZE ...`` (the CLI stays a thin layer over it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phaselens.core.errors import InputError


@dataclass(frozen=True)
class FamilyArgs:
    """The command's options for a family recipe (see ``phaselens train --help``)."""

    recipe: str
    size: str = "tiny"
    out: str = "zoo-out"
    runs: str = "runs/family"
    steps: int | None = None
    tokens: float | None = None
    batch_size: int | None = None
    seed: int = 0
    vocab: int | None = None
    kv_heads: int | None = None
    precision: str | None = None
    activation_checkpointing: bool | None = None
    micro_batch: int | None = None
    pretrain: tuple[str, ...] = ()
    pretrain_ratio: float = 0.0
    pretrain_dtype: str = "uint16"
    eval_per_residue: int = 256
    time_limit: float | None = None
    threads: int | None = 1
    plan: bool = False
    gpus: tuple[int, ...] = ()
    mfu: float = 0.40
    peak_tflops: float = 989.0
    force: bool = False
    progress: bool = True


def build_recipe(a: FamilyArgs) -> Any:
    import dataclasses

    from phaselens.train.family.recipes import family_recipe

    if a.tokens is not None and a.tokens < 1:
        raise InputError(f"--tokens must be a positive token budget (e.g. 1e11), got {a.tokens}.")
    r = family_recipe(a.recipe, a.size, vocab=a.vocab, seed=a.seed, steps=a.steps,
                      tokens=int(a.tokens) if a.tokens else None, batch_size=a.batch_size, kv_heads=a.kv_heads)
    if a.threads is not None and not a.plan:
        r = dataclasses.replace(r, settings=dataclasses.replace(r.settings, threads=a.threads))
    return r


def parallelism(a: FamilyArgs) -> Any:
    """Defaults where they help: bf16 and activation checkpointing on GPUs, fp32 without on CPUs."""
    import torch

    from phaselens.train.family.trainer import Parallelism

    gpu = torch.cuda.is_available()
    return Parallelism(precision=a.precision or ("bf16" if gpu else "fp32"),
                       activation_checkpointing=gpu if a.activation_checkpointing is None else a.activation_checkpointing,
                       micro_batch=a.micro_batch)


def plan_text(a: FamilyArgs) -> str:
    from phaselens.train.family.plan import format_plans, plan_run

    recipe = build_recipe(a)
    gpus = a.gpus or (1, 8, 64)
    return format_plans([
        plan_run(recipe, gpus=g, micro_batch=a.micro_batch, precision=a.precision or "bf16",
                 activation_checkpointing=True if a.activation_checkpointing is None else a.activation_checkpointing,
                 pretrain_ratio=a.pretrain_ratio, peak_tflops=a.peak_tflops, mfu=a.mfu)
        for g in gpus
    ])


def run(a: FamilyArgs, say: Any) -> None:
    """Train, resume or plan; ``say`` prints on the main rank."""
    if a.plan:
        say(plan_text(a))
        return
    from phaselens.models.compressed.io import checkpoint_kind
    from phaselens.runtime.files import check_output_dir
    from phaselens.train.family.data import TokenFiles
    from phaselens.train.family.run import member_name, run_recipe

    recipe = build_recipe(a)
    pretraining = TokenFiles(tuple(a.pretrain), a.pretrain_dtype) if a.pretrain else None
    if a.pretrain_ratio and pretraining is None:
        raise InputError("--pretrain-ratio needs --pretrain FILE (your token files).")
    if pretraining is not None and not a.pretrain_ratio:
        raise InputError("--pretrain FILE needs --pretrain-ratio R (the fraction of each batch from your tokens).")
    name = member_name(recipe)
    check_output_dir(Path(a.out) / name, checkpoint_kind(), overwrite=a.force)
    from phaselens.train.family.checkpoints import latest

    pointer = latest(Path(a.runs) / name / "checkpoints")
    if pointer is not None:
        print(f"resuming {name} from step {pointer['step']} of {recipe.settings.steps}", file=sys.stderr)
    card = run_recipe(recipe, out=a.out, runs=a.runs, parallel=parallelism(a), pretraining=pretraining,
                      ratio=a.pretrain_ratio, eval_per_residue=a.eval_per_residue, progress=a.progress,
                      overwrite=a.force, time_limit=a.time_limit)
    if card is None:
        pointer = latest(Path(a.runs) / name / "checkpoints")
        if pointer is not None and pointer["step"] < recipe.settings.steps:
            say(f"{name}: stopped at step {pointer['step']} of {recipe.settings.steps} (time limit); rerun the same "
                "command to resume.")
        return
    t = card["training"]
    line = f"{name}: {t['tokens']:,} tokens, final loss {t['final_loss']:.4f}"
    if "battery" in card:
        b = card["battery"]
        line += (f"; mean {100 * b['mean']:.1f}%, worst {100 * b['worst']:.1f}%, gap {100 * b['gap']:.1f} pp, "
                 f"period {b['period']}")
    say(f"{line}; written to {Path(a.out) / name} (loss log: {Path(a.runs) / name / 'log.json'})")
