"""Train one family member from its recipe and write it as a model directory that ``phaselens.load`` reads.

``run_recipe`` is what ``phaselens train --recipe paper-w4s4 --size tiny`` (and its torchrun form) calls:
train or resume in ``runs/NAME-SIZE``, then on rank 0 evaluate the whole model with phaselens's battery on
the paper's task (prefix padding) and write ``OUT/NAME-SIZE`` (``model.safetensors``, ``config.json`` with the
default task, ``card.json`` with the training log's summary and the battery).
"""

from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phaselens.train.family.data import FamilyData, TokenFiles
from phaselens.train.family.recipes import FamilyRecipe, paper_task, training_tasks, warmup_tasks
from phaselens.train.family.trainer import Parallelism, tokens_per_second, train_family

VAL_PER_RESIDUE = 4
VAL_SEED = 777
COMPARE_STRIDE = 4  # the full-attention control is folded by this stride


def member_name(recipe: FamilyRecipe) -> str:
    return recipe.member


def family_data(recipe: FamilyRecipe, pretraining: TokenFiles | None = None, ratio: float = 0.0) -> FamilyData:
    return FamilyData(training_tasks(), pretraining, ratio, recipe.config.d_vocab, warmup_tasks(recipe.warmup_kind),
                      recipe.warmup_steps)


def validation(rank: int, size: int) -> Any:
    """``model -> (correct, n)``: top-1 at the query on this rank's share of a fixed prefix-padded batch."""
    from phaselens.core.geometry import PhaseSpec

    batch = paper_task("prefix").build(PhaseSpec(COMPARE_STRIDE), n_per_residue=VAL_PER_RESIDUE,
                                       seed=VAL_SEED)
    rows = slice(rank * len(batch) // size, (rank + 1) * len(batch) // size)
    tokens, answer = batch.tokens[rows], batch.answer[rows]

    def val(model: Any) -> tuple[int, int]:
        device = next(model.parameters()).device
        logits = model(tokens.to(device), logits="query", query_len=1)[:, -1]
        return int((logits.argmax(-1).cpu() == answer).sum()), len(answer)

    return val


def run_recipe(recipe: FamilyRecipe, *, out: str | Path, runs: str | Path, parallel: Parallelism | None = None,
               pretraining: TokenFiles | None = None, ratio: float = 0.0, eval_per_residue: int = 256,
               progress: bool = True, overwrite: bool = False, stop_after: int | None = None,
               time_limit: float | None = None, peak_tflops: float | None = None) -> dict[str, Any] | None:
    """Train (or resume) ``recipe`` and write ``out/NAME-SIZE``; returns the card on rank 0 (None elsewhere, and
    when ``stop_after`` or ``time_limit`` seconds end the run early: rerun to resume; the last committed step
    loads with :func:`phaselens.train.load_checkpoint`). ``peak_tflops``: the GPU's peak, for the MFU in
    ``RUN_DIR/metrics.jsonl``."""
    from phaselens.parallel.world import local, process_world
    from phaselens.train.family.trainer import _barrier

    world = process_world()
    parallel = parallel or Parallelism()
    name = member_name(recipe)
    data = family_data(recipe, pretraining, ratio)
    res = train_family(recipe.config, data, recipe.settings, Path(runs) / name, parallel=parallel,
                       val=validation(world.rank, world.size), data_description=data.describe(),
                       progress=progress, stop_after=stop_after, time_limit=time_limit, peak_tflops=peak_tflops)
    card = None
    if res.model is not None:
        with local():  # rank 0 alone: the other ranks wait at the barrier below
            card = _write(recipe, res, data, Path(out) / name, eval_per_residue, progress, overwrite, parallel)
    if res.log["step"] and res.log["step"][-1] == recipe.settings.steps:  # every rank finished (and gathered)
        _barrier()
    return card


def _write(recipe: FamilyRecipe, res: Any, data: FamilyData, path: Path, eval_per_residue: int, progress: bool,
           overwrite: bool, parallel: Parallelism) -> dict[str, Any]:
    from phaselens.analyses.evaluation import evaluate
    from phaselens.core.version import __version__
    from phaselens.models.compressed.io import save_model
    from phaselens.train.zoo_training import battery_summary, code_provenance

    model = res.model
    task = paper_task("prefix")
    model.default_task = task
    log = res.log
    losses = log["loss"]
    card: dict[str, Any] = {
        "name": path.name, "recipe": recipe.name, "size": recipe.size, "description": recipe.description,
        "phaselens_version": __version__, "torch": torch.__version__, "machine": platform.machine(),
        "code": code_provenance(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "training": {**dataclasses.asdict(recipe.settings), "world_size": res.world_size,
                     "parallel": dataclasses.asdict(parallel), "resumed_from": res.resumed_from,
                     "tokens": log["tokens"][-1] if log["tokens"] else 0, "seconds": log["seconds"][-1] if log["seconds"] else 0,
                     "tokens_per_second": tokens_per_second(log), "data": data.describe(),
                     "loss_curve_every_10": [float(np.mean(losses[i:i + 10])) for i in range(0, len(losses), 10)],
                     "final_loss": float(np.mean(losses[-50:])) if losses else None, "val": log["val"]},
        "task": task.to_dict(),
    }
    if eval_per_residue:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        stride = model.analysis_spec.stride if recipe.config.compression is not None else COMPARE_STRIDE
        t0 = time.time()
        ev = evaluate(model.to(device), task, n_per_residue=eval_per_residue, seed=1, stride=stride,
                      n_permutations=2000, n_bootstrap=1000, batch_size=128, progress=progress)
        per = ev.per_residue()
        card["evaluation"] = {"n_per_residue": eval_per_residue, "seed": 1, "seconds": round(time.time() - t0, 1),
                              "correct": per["correct"].astype(int).tolist(), "n": per["n"].astype(int).tolist()}
        card["battery"] = battery_summary(ev)
        model = model.cpu()
    save_model(model, path, metadata=card, overwrite=overwrite)
    return card
