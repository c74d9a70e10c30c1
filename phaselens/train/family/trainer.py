"""Training of a family member on one process or across ranks (``torchrun``) with FSDP2.

One code path for every world size, and for the zoo too (:mod:`phaselens.train.training_loop` is the one loop;
:func:`phaselens.train.loop.train` is it at world size 1 with the zoo's objective):

- **One process** (``python -m phaselens train ...``): the plain model, no FSDP, no process group.
- **torchrun** (``torchrun --nproc-per-node N -m phaselens train ...``): every block and then the root are
  sharded with ``torch.distributed.fsdp.fully_shard`` over a 1-D mesh of the ranks (NCCL on GPUs, gloo on CPU;
  FSDP2 runs on CPU with gloo in torch 2.13, which ``tests/train/family/test_train.py`` exercises).

The batch of step ``s`` is the same global batch on every world size (``data(batch_size, seed)`` with the
seed of step ``s``, built on every rank); rank ``r`` trains rows ``r*B/N .. (r+1)*B/N - 1`` in micro-batches.
Each rank's loss is its share of the *global* mean (its summed cross-entropy over the global number of
trained positions, times N to undo FSDP's gradient averaging), so the gradient is the single-process one up
to floating-point reduction order. Options: bf16 mixed precision (FSDP's ``MixedPrecisionPolicy`` with fp32
gradient reduction; autocast on one process) and activation recompute of every block
(``torch.distributed._composable.checkpoint``, which keeps module names, so hook names do not change).

A run resumes from its last checkpoint (:mod:`phaselens.train.family.checkpoints`) bit-identically to an
uninterrupted run on the same world size, and on any other world size with the same curve to rounding (the
checkpoint is resharded): the weights, AdamW's moments and the loss log are restored, and the data depends only
on the step. Any committed step loads as a model (:func:`load_checkpoint`), so a run stopped by a time limit
still gives one. At the end the whole model is gathered and rank 0 writes it as
``model.safetensors`` + ``config.json`` (+ ``card.json``), which :func:`phaselens.load` reads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phaselens.errors import InputError
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.compressed.transformer import CompressedTransformer
from phaselens.train import training_loop as engine
from phaselens.train.family.checkpoints import load_checkpoint  # noqa: F401
from phaselens.train.settings import TrainSettings
from phaselens.train.training_loop import LOG, LOG_FORMAT, Parallelism  # noqa: F401  (the family's names for them)
from phaselens.train.training_loop import barrier as _barrier  # noqa: F401


@dataclass
class FamilyRun:
    """What :func:`train_family` returns on every rank (``model`` is the unsharded model on rank 0 only)."""

    model: CompressedTransformer | None
    log: dict[str, Any]
    resumed_from: int
    world_size: int


def train_family(
    cfg: CompressedConfig,
    data: Callable[..., Any],
    settings: TrainSettings,
    run_dir: str | os.PathLike,
    *,
    parallel: Parallelism = engine.SERIAL,
    val: Callable[[Any], tuple[int, int]] | None = None,
    data_description: Any = None,
    progress: bool = True,
    stop_after: int | None = None,
    time_limit: float | None = None,
    log_every: int = 10,
    peak_tflops: float | None = None,
) -> FamilyRun:
    """Train ``cfg`` on ``data`` (or resume the run in ``run_dir``), on this process or across torchrun's ranks.

    Args:
        cfg: the member's config (``cfg.seed`` sets the initial weights, identical on every rank).
        data: ``(batch_size, seed) -> (tokens [B, T], targets [B, T])``, deterministic in ``seed``
            (:class:`~phaselens.train.family.data.FamilyData`); called with the global batch size.
        settings: optimiser and schedule; ``batch_size`` is the global batch in sequences.
        run_dir: checkpoints, ``log.json`` and ``metrics.jsonl``; an existing run with the same fingerprint
            resumes (on any world size and micro-batch).
        parallel: precision, activation recompute, micro-batches.
        val: ``model -> (correct, n)`` on this rank's share of a fixed validation set, every
            ``settings.eval_every`` steps (summed over ranks).
        data_description: what identifies ``data`` beyond its batches (recorded in the fingerprint).
        stop_after: stop after this many steps (with a checkpoint), to simulate an interruption.
        time_limit: stop (with a checkpoint) after the first step that ends this many seconds after the call
            began (every rank stops at the same step), e.g. inside a job's wall-clock limit; rerun to resume.
        log_every: steps between the metrics records (:mod:`phaselens.train.metrics`).
        peak_tflops: the GPU's peak, for the MFU in the metrics (None: none computed).

    Returns:
        :class:`FamilyRun`; ``model`` is the whole trained model (fp32, CPU) on rank 0.
    """
    done = engine.run(cfg, data, settings, run_dir, parallel=parallel, val=val, data_description=data_description,
                      progress=progress, stop_after=stop_after, time_limit=time_limit, log_every=log_every,
                      peak_tflops=peak_tflops)
    whole = gather_model(done.model, cfg, done.named, main=done.main) if done.end == settings.steps else None
    return FamilyRun(whole, done.log, done.start, done.world_size)


def gather_model(model: Any, cfg: CompressedConfig, named: list[tuple[str, torch.Tensor]], *,
                 main: bool) -> CompressedTransformer | None:
    """The whole model (fp32, CPU) on the main rank; every rank must call it (it gathers FSDP's shards)."""
    full = {}
    with torch.no_grad():
        for name, p in named:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if main:
                full[name] = t.float().cpu()
    if not main:
        return None
    out = CompressedTransformer(cfg)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for name, t in full.items():
            params[name].copy_(t)
    return out.eval()


def read_log(path: str | os.PathLike) -> dict[str, Any]:
    """A run's loss log (``RUN_DIR/log.json``, or the file itself): ``step``, ``loss``, ``lr``, ``grad_norm``,
    ``tokens``, ``seconds`` (lists, one entry per step) and ``val`` (``[step, accuracy]`` pairs)."""
    import json

    p = Path(path)
    p = p / LOG if p.is_dir() else p
    try:
        if not p.is_file():  # a pipe or a device is never opened
            raise OSError(f"{p} is not a regular file")
        log = json.loads(p.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{p} is not a readable training log ({err}); pass RUN_DIR or RUN_DIR/log.json.") from None
    if not isinstance(log, dict) or log.get("format") != LOG_FORMAT:
        raise InputError(f"{p} is not a phaselens training log (format {LOG_FORMAT}).")
    return log


def tokens_per_second(log: dict[str, Any], last: int = 50) -> float:
    """Throughput over the last ``last`` logged steps (tokens processed per wall second)."""
    s, tok = log["seconds"], log["tokens"]
    if len(s) < 2:
        return math.nan
    i = max(0, len(s) - 1 - last)
    return (tok[-1] - tok[i]) / max(s[-1] - s[i], 1e-9)
