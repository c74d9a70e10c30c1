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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from phaselens.errors import CheckpointError, ConfigError
from phaselens.models.config import CompressedConfig
from phaselens.models.transformer import CompressedTransformer

STATE_WEIGHTS = "train_state.safetensors"
STATE_JSON = "train_state.json"


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
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("steps and batch_size must be >= 1 and lr > 0.")
        if self.checkpoint_every < 1:
            raise ConfigError("checkpoint_every must be >= 1.")

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
    never disagree; ``train_state.json`` is a readable copy written afterwards."""
    tmp_w = run_dir / f".{STATE_WEIGHTS}.tmp"
    save_file(tensors, str(tmp_w), metadata={"phaselens_train_state": json.dumps(meta)})
    os.replace(tmp_w, run_dir / STATE_WEIGHTS)
    tmp_j = run_dir / f".{STATE_JSON}.tmp"
    tmp_j.write_text(json.dumps(meta))
    os.replace(tmp_j, run_dir / STATE_JSON)


def _restore(run_dir: Path, model: CompressedTransformer, opt: torch.optim.AdamW, expect: dict) -> dict | None:
    if not (run_dir / STATE_WEIGHTS).is_file():
        return None
    with safe_open(str(run_dir / STATE_WEIGHTS), framework="pt") as f:
        header = (f.metadata() or {}).get("phaselens_train_state")
    # Runs written before the metadata moved into the weights file keep it in the JSON copy only.
    meta = json.loads(header) if header else json.loads((run_dir / STATE_JSON).read_text())
    stored = meta.get("fingerprint") or {}
    if stored.get("settings", {}).get("curriculum", None) == "":  # written before empty curricula were dropped
        stored["settings"].pop("curriculum")
    if stored != expect:
        raise CheckpointError(
            f"{run_dir} holds a run with different settings; remove it or use another output directory."
        )
    tensors = load_file(str(run_dir / STATE_WEIGHTS))
    if int(tensors["meta.step"].item()) != meta["step"]:
        raise CheckpointError(f"{run_dir}: weights and JSON disagree on the step; delete the directory and retrain.")
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    params = dict(model.named_parameters())
    for name, p in params.items():
        if f"adam.exp_avg.{name}" in tensors:
            opt.state[p] = {
                "exp_avg": tensors[f"adam.exp_avg.{name}"].clone(),
                "exp_avg_sq": tensors[f"adam.exp_avg_sq.{name}"].clone(),
                "step": torch.tensor(float(tensors[f"adam.step.{name}"].item())),
            }
    return meta


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
    fingerprint = {"config": cfg.to_dict(), "settings": settings_fp}
    meta = _restore(run_dir, model, opt, fingerprint)
    start = meta["step"] if meta else 0
    losses: list[float] = meta["losses"] if meta else []
    val_acc: list[tuple[int, float]] = [tuple(x) for x in meta["val_acc"]] if meta else []
    prior_s: float | None = meta.get("seconds") if meta else 0.0
    t0 = time.perf_counter()
    bar = _progress(settings.steps, start, progress)
    end = settings.steps if stop_after is None else min(settings.steps, stop_after)
    try:
        for step in range(start, end):
            seed = settings.seed * 1_000_003 + step
            if getattr(batch_fn, "uses_step", False):
                tokens, targets = batch_fn(settings.batch_size, seed, step)
            else:
                tokens, targets = batch_fn(settings.batch_size, seed)
            for group in opt.param_groups:
                group["lr"] = settings.lr_at(step)
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
                                                "fingerprint": fingerprint, "seconds": _total(prior_s, t0)})
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
    try:
        return int(json.loads(path.read_text())["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _total(prior_s: float | None, t0: float) -> float | None:
    return None if prior_s is None else prior_s + time.perf_counter() - t0


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from phaselens.progress import progress_bar

    return progress_bar(stage="train", unit="step", total=total, initial=initial, leave=True)
