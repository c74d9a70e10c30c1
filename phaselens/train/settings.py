"""What a training run is made of, shared by the zoo and the family: its settings and its data.

A run is a pure function of its :class:`TrainSettings` and its data: the batch of step ``s`` comes from the
seed pair ``(settings.seed, s)`` (:func:`batch`), so no random-number state needs saving, and
:func:`data_fingerprint` identifies the data by a few of its batches.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phaselens.core.checks import MAX_SEED
from phaselens.errors import ConfigError, InputError
from phaselens.runtime.budget import check_threads
from phaselens.storage.fingerprints import fingerprint


class EmptyTargetsWarning(UserWarning):
    """A training batch whose targets are all ``-100``: it has no loss, and its step is skipped."""


@dataclass(frozen=True)
class TrainSettings:
    """Optimiser and schedule of a training run (AdamW, linear warm-up then cosine decay to 10%)."""

    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 250
    threads: int | None = None
    curriculum: str = ""  # a description of any step-dependent data (part of the run's fingerprint)

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("batch_size", 1), ("warmup", 0), ("seed", 0), ("checkpoint_every", 1),
                          ("eval_every", 1)):
            value = getattr(self, name)
            top = MAX_SEED if name == "seed" else None  # torch's generators take 64 bits
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low or \
                    (top is not None and value > top):
                within = f"in {low}..{top:,} (2^63 - 1)" if top is not None else f">= {low}"
                raise ConfigError(f"TrainSettings.{name} must be an int {within}, got {value!r}.")
            object.__setattr__(self, name, int(value))
        if self.threads is not None:
            if not isinstance(self.threads, numbers.Integral) or isinstance(self.threads, bool) or self.threads < 1:
                raise ConfigError(f"TrainSettings.threads must be a positive int (CPU threads) or None (torch's "
                                  f"default), got {self.threads!r}.")
            try:  # torch/OpenMP abort the process on a count they cannot start
                object.__setattr__(self, "threads", check_threads(self.threads, name="TrainSettings.threads"))
            except InputError as err:
                raise ConfigError(str(err)) from None
        for name, positive in (("lr", True), ("grad_clip", True), ("weight_decay", False)):
            value = getattr(self, name)
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < 0 or (positive and value == 0):
                raise ConfigError(f"TrainSettings.{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                                  f"got {value!r}.")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.curriculum, str):
            raise ConfigError(f"TrainSettings.curriculum must be a string, got {self.curriculum!r}.")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch(batch_fn: Callable[..., Any], settings: TrainSettings, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: ``batch_fn(batch_size, seed[, step])``, checked."""
    seed = settings.seed * 1_000_003 + step
    if getattr(batch_fn, "uses_step", False):
        out = batch_fn(settings.batch_size, seed, step)
    else:
        out = batch_fn(settings.batch_size, seed)
    try:
        tokens, targets = out
    except (TypeError, ValueError):
        raise InputError(f"batch_fn must return (tokens [B, T], targets [B, T]), got {type(out).__name__}.") from None
    if not (isinstance(tokens, torch.Tensor) and isinstance(targets, torch.Tensor)) or tokens.dim() != 2 \
            or tokens.shape != targets.shape or tokens.is_floating_point() or targets.is_floating_point():
        raise InputError(
            "batch_fn must return integer tensors tokens and targets of one shape [B, T]; got "
            f"{getattr(tokens, 'shape', type(tokens).__name__)} and {getattr(targets, 'shape', type(targets).__name__)}."
        )
    return tokens, targets


def data_fingerprint(batch_fn: Callable[..., Any], settings: TrainSettings) -> str:
    """A fingerprint of the training data: the batches of a few fixed steps (first, quartiles, last), so a
    resume with another task or batch function is refused."""
    n = settings.steps
    steps = sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1}) if getattr(batch_fn, "uses_step", False) else [0, n - 1]
    return fingerprint(**{f"step{s}": batch(batch_fn, settings, s) for s in steps})


def batch_split(batch_size: int, ranks: int, micro_batch: int | None) -> tuple[int, int]:
    """``(rows per rank, rows per forward)`` of a global batch over ``ranks`` ranks, as the trainer splits it;
    a :class:`ConfigError` (the trainer's message) when it does not split evenly. The run checks it before
    building the model, and the plan for each GPU count, so a plan never shows a split the run refuses."""
    share, rem = divmod(batch_size, ranks)
    if share == 0:
        raise ConfigError(f"the global batch ({batch_size} sequences) is smaller than the {ranks} rank(s): each rank "
                          f"needs at least one sequence; use --batch-size {ranks} or a multiple of it (or fewer GPUs).")
    micro = micro_batch or share
    if rem or share % micro:
        raise ConfigError(f"the global batch ({batch_size} sequences) must split evenly over {ranks} rank(s) "
                          f"and then into micro-batches of {micro}; choose a batch size that is a multiple of "
                          f"{ranks * micro}.")
    return share, micro
