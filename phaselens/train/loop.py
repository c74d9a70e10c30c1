"""Deterministic, resumable training of a :class:`CompressedTransformer` on a token-level task.

A run is a pure function of its :class:`TrainSettings`: the model starts from ``cfg.seed``, and the batch
of step ``s`` comes from the seed pair ``(settings.seed, s)``, so no random-number state needs saving.
Every ``checkpoint_every`` steps the weights, the AdamW moments and the loss curve are written in one
atomic file replace (safetensors, the metadata in its header; never pickle); a run killed at any moment
resumes from its last checkpoint and ends bit-identical to an uninterrupted run (same thread count).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from phaselens.core.errors import CheckpointError, ConfigError, InputError, OutputError
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.compressed.transformer import CompressedTransformer
from phaselens.runtime.budget import check_threads
from phaselens.runtime.checkpoints import load_safetensors, safetensors_metadata
from phaselens.runtime.files import write_owned_file
from phaselens.runtime.fingerprints import fingerprint, model_fingerprint
from phaselens.runtime.reading import peek_json, peek_json_object

STATE_WEIGHTS = "train_state.safetensors"
STATE_JSON = "train_state.json"


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
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
                raise ConfigError(f"TrainSettings.{name} must be an int >= {low}, got {value!r}.")
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


@dataclass
class TrainResult:
    model: CompressedTransformer
    losses: list[float]
    val_acc: list[tuple[int, float]]
    seconds: float | None  # wall time of all runs so far (None: resumed from a state that kept no time)
    resumed_from: int


def _state_tensors(model: CompressedTransformer, opt: torch.optim.AdamW) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                out[f"adam.exp_avg.{names[id(p)]}"] = st["exp_avg"]
                out[f"adam.exp_avg_sq.{names[id(p)]}"] = st["exp_avg_sq"]
                out[f"adam.step.{names[id(p)]}"] = torch.as_tensor(st["step"], dtype=torch.float64).reshape(1)
    return {k: v.contiguous() for k, v in out.items()}


def _atomic_save(run_dir: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """One atomic replace: the run's metadata travels inside the safetensors header, so weights and meta can
    never disagree; ``train_state.json`` is a readable copy written afterwards (a kill between the two leaves
    the copy one checkpoint behind, which resuming ignores)."""
    text = json.dumps(meta)
    write_owned_file(run_dir / STATE_WEIGHTS, lambda tmp: save_file(
        tensors, str(tmp), metadata={"phaselens_train_state": text}), by="training run", proves=_is_state,
        record=False)
    write_owned_file(run_dir / STATE_JSON, lambda tmp: tmp.write_text(text, encoding="utf-8"), by="training run",
                     proves=_is_state_copy, record=False)


def _is_state(path: Path) -> bool:
    """A training state phaselens wrote: its safetensors header carries the run's metadata."""
    try:
        return "phaselens_train_state" in safetensors_metadata(path, fix="")
    except CheckpointError:
        return False


def _is_state_copy(path: Path) -> bool:
    """The JSON copy of a training state: a JSON object with its writer's keys (``step`` first)."""
    meta = peek_json(path)
    return isinstance(meta, dict) and list(meta)[:3] == ["step", "losses", "val_acc"] \
        and isinstance(meta["step"], int) and not isinstance(meta["step"], bool)


_PARTS = {
    "config": "the model config differs",
    "settings": "the TrainSettings differ",
    "data": "batch_fn gives other batches (another task, or a batch_fn not deterministic in its seed)",
    "init": "the initial weights differ (cfg.seed or init_fn)",
}


def _restore(run_dir: Path, model: CompressedTransformer, opt: torch.optim.AdamW, expect: dict) -> dict | None:
    if not (run_dir / STATE_WEIGHTS).is_file():
        return None
    fix = (f"delete {run_dir / STATE_WEIGHTS} and {run_dir / STATE_JSON} to restart from step 0, or pass another "
           "run_dir.")
    header = safetensors_metadata(run_dir / STATE_WEIGHTS, fix=fix).get("phaselens_train_state")
    try:
        meta = json.loads(header)
        stored = dict(meta.get("fingerprint") or {})
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{run_dir / STATE_WEIGHTS} has damaged metadata ({err}); {fix}") from None
    differ = [_PARTS[k] for k in expect if stored.get(k) != expect[k]]
    if differ:
        raise CheckpointError(
            f"{run_dir} holds a run with different settings: {'; '.join(differ)}. Remove it or use another "
            "run_dir."
        )
    tensors = load_safetensors(run_dir / STATE_WEIGHTS, fix=fix)
    if "meta.step" not in tensors or int(tensors["meta.step"].item()) != step:
        raise CheckpointError(f"{run_dir}: weights and metadata disagree on the step; {fix}")
    try:
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    except RuntimeError as err:
        raise CheckpointError(f"{run_dir / STATE_WEIGHTS} does not fit the model ({str(err)[:200]}); {fix}") from None
    params = dict(model.named_parameters())
    for name, p in params.items():
        if f"adam.exp_avg.{name}" in tensors:
            opt.state[p] = {
                "exp_avg": tensors[f"adam.exp_avg.{name}"].clone(),
                "exp_avg_sq": tensors[f"adam.exp_avg_sq.{name}"].clone(),
                "step": torch.tensor(float(tensors[f"adam.step.{name}"].item())),
            }
    return meta


def _batch(batch_fn: Callable[..., Any], settings: TrainSettings, step: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _data_fingerprint(batch_fn: Callable[..., Any], settings: TrainSettings) -> str:
    """A fingerprint of the training data: the batches of a few fixed steps (first, quartiles, last), so a
    resume with another task or batch function is refused."""
    n = settings.steps
    steps = sorted({0, n // 4, n // 2, (3 * n) // 4, n - 1}) if getattr(batch_fn, "uses_step", False) else [0, n - 1]
    return fingerprint(**{f"step{s}": _batch(batch_fn, settings, s) for s in steps})


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
) -> TrainResult:
    """Train from scratch, or resume the run in ``run_dir``.

    Args:
        cfg: the model config (``cfg.seed`` sets the initial weights).
        batch_fn: ``(batch_size, seed) -> (tokens [B, T], targets [B, T])``; ``targets[b, t]`` is the token
            to predict from position t, or -100 where no loss is taken. It must be deterministic in ``seed``.
            A callable with ``uses_step = True`` is called as ``(batch_size, seed, step)`` (curricula).
        settings: optimiser, schedule and checkpointing.
        run_dir: where checkpoints live; an existing run with the same settings resumes.
        val_fn: optional validation accuracy, run every ``settings.eval_every`` steps (for the progress bar).
        stop_after: stop (with a checkpoint) after this many steps; used to simulate interruptions.
        init_fn: called on the freshly built model before training (e.g. to plant and freeze parameters).
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputError(f"run_dir {run_dir} is a file; pass a directory (it is created if missing).")
    if stop_after is not None and (not isinstance(stop_after, numbers.Integral) or stop_after < 0):
        raise ConfigError(f"stop_after must be a non-negative int or None, got {stop_after!r}.")
    run_dir.mkdir(parents=True, exist_ok=True)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    model = CompressedTransformer(cfg).train()
    if init_fn is not None:
        init_fn(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.lr, weight_decay=settings.weight_decay)
    settings_fp = dataclasses.asdict(settings) | {"threads": None}
    if not settings.curriculum:  # runs written before curricula existed carry no such key
        settings_fp.pop("curriculum")
    run_fp = {"config": cfg.to_dict(), "settings": settings_fp, "data": _data_fingerprint(batch_fn, settings),
              "init": model_fingerprint(model)}
    meta = _restore(run_dir, model, opt, run_fp)
    start = meta["step"] if meta else 0
    losses: list[float] = meta["losses"] if meta else []
    val_acc: list[tuple[int, float]] = [tuple(x) for x in meta["val_acc"]] if meta else []
    prior_s: float | None = meta.get("seconds") if meta else 0.0
    t0 = time.perf_counter()
    bar = _progress(settings.steps, start, progress)
    end = settings.steps if stop_after is None else min(settings.steps, stop_after)
    try:
        for step in range(start, end):
            tokens, targets = _batch(batch_fn, settings, step)
            for group in opt.param_groups:
                group["lr"] = settings.lr_at(step)
            if not bool((targets != -100).any()):
                # the mean loss would be 0/0 = NaN and its NaN gradients would poison every weight
                warnings.warn(EmptyTargetsWarning(
                    f"step {step}: every target of the batch is -100 (ignored), so there is no loss; the step is "
                    "skipped (loss recorded as NaN). Check that batch_fn marks the positions to train on."
                ), stacklevel=2)
                losses.append(float("nan"))
            else:
                logits = model(tokens)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
                opt.step()
                losses.append(round(float(loss.detach()), 6))
            done = step + 1
            if val_fn is not None and (done % settings.eval_every == 0 or done == settings.steps):
                model.eval()
                val_acc.append((done, float(val_fn(model))))
                model.train()
            if done % settings.checkpoint_every == 0 or done == end:
                tensors = _state_tensors(model, opt)
                tensors["meta.step"] = torch.tensor([done])
                _atomic_save(run_dir, tensors, {"step": done, "losses": losses, "val_acc": val_acc,
                                                "fingerprint": run_fp, "seconds": _total(prior_s, t0)})
            if bar is not None:
                bar.update(1)
                post = {"loss": f"{losses[-1]:.3f}"}
                if val_acc:
                    post["val_acc"] = f"{val_acc[-1][1]:.3f}"
                bar.set_postfix(post)
    finally:
        if bar is not None:
            bar.close()
    return TrainResult(model.eval(), losses, val_acc, _total(prior_s, t0), start)


def saved_step(run_dir: str | os.PathLike) -> int | None:
    """The step of the checkpoint a run in ``run_dir`` would resume from, or ``None`` if there is none.

    Reads the small JSON copy of the run's metadata (no torch work): for messages such as "resuming from step N".
    """
    path = Path(run_dir) / STATE_JSON
    if not path.is_file():
        return None
    step = peek_json_object(path).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _total(prior_s: float | None, t0: float) -> float | None:
    return None if prior_s is None else prior_s + time.perf_counter() - t0


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from phaselens.runtime.progress import progress_bar

    return progress_bar(stage="train", unit="step", total=total, initial=initial, leave=True)
