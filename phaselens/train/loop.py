"""Deterministic, resumable training of a :class:`CompressedTransformer` on a token-level task (the zoo).

:func:`train` is the one training loop of phaselens (:mod:`phaselens.train.training_loop`) on one process, with the
zoo's objective (the mean cross-entropy of one forward over the whole batch) on the CPU. A run is a pure
function of its :class:`TrainSettings`: the model starts from ``cfg.seed``, and the batch of step ``s`` comes
from the seed pair ``(settings.seed, s)``, so no random-number state needs saving. Every ``checkpoint_every``
steps the weights, the AdamW moments and the loss log are committed (:mod:`phaselens.train.family.checkpoints`:
safetensors + JSON, never pickle; ``run_dir/checkpoints/step-N`` loads as a model with
:func:`~phaselens.train.family.checkpoints.load_checkpoint`); a run killed at any moment resumes from its last
checkpoint and ends bit-identical to an uninterrupted run (same thread count).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.compressed.transformer import CompressedTransformer
from phaselens.train import training_loop as engine
from phaselens.train.settings import EmptyTargetsWarning, TrainSettings  # noqa: F401  (their home before)


@dataclass
class TrainResult:
    model: CompressedTransformer
    losses: list[float]
    val_acc: list[tuple[int, float]]
    seconds: float | None  # wall time of all runs so far
    resumed_from: int


def train(
    cfg: CompressedConfig,
    batch_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    settings: TrainSettings,
    run_dir: str | os.PathLike,
    *,
    val_fn: Callable[[CompressedTransformer], float] | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    init_fn: Callable[[CompressedTransformer], None] | None = None,
    log_every: int = 10,
) -> TrainResult:
    """Train from scratch, or resume the run in ``run_dir``.

    Args:
        cfg: the model config (``cfg.seed`` sets the initial weights).
        batch_fn: ``(batch_size, seed) -> (tokens [B, T], targets [B, T])``; ``targets[b, t]`` is the token
            to predict from position t, or -100 where no loss is taken. It must be deterministic in ``seed``.
            A callable with ``uses_step = True`` is called as ``(batch_size, seed, step)`` (curricula).
        settings: optimiser, schedule and checkpoints (``checkpoint_every``).
        run_dir: where checkpoints, ``log.json`` and ``metrics.jsonl`` live; an existing run with the same
            settings resumes.
        val_fn: optional validation accuracy, run every ``settings.eval_every`` steps (for the progress bar).
        stop_after: stop (with a checkpoint) after this many steps; used to simulate interruptions.
        init_fn: called on the freshly built model before training (e.g. to plant and freeze parameters).
        log_every: steps between the metrics records (:mod:`phaselens.train.metrics`).
    """
    val = None if val_fn is None else (lambda model: (float(val_fn(model)), 1.0))
    done = engine.run(cfg, batch_fn, settings, run_dir, val=val, progress=progress, stop_after=stop_after,
                      init_fn=init_fn, objective="mean", on=torch.device("cpu"), log_every=log_every)
    log = done.log
    losses = [round(x, 6) if x == x else x for x in log["loss"]]  # the zoo's cards record 6 decimals
    return TrainResult(done.model.eval(), losses, [(int(s), float(a)) for s, a in log["val"]],
                       log["seconds"][-1] if log["seconds"] else 0.0, done.start)


def saved_step(run_dir: str | os.PathLike) -> int | None:
    """The step of the checkpoint a run in ``run_dir`` would resume from, or ``None`` if there is none.

    Reads the small JSON pointer (``checkpoints/latest.json``; no torch work): for messages such as
    "resuming from step N".
    """
    from phaselens.errors import CheckpointError
    from phaselens.train.family import checkpoints as ckpt

    try:
        pointer = ckpt.latest(Path(run_dir) / "checkpoints")
    except CheckpointError:
        return None
    return None if pointer is None else int(pointer["step"])
