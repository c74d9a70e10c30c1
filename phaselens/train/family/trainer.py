"""Training of a family member on one process or across ranks (``torchrun``) with FSDP2.

One code path for every world size:

- **One process** (``python -m phaselens train ...``): the plain model, no FSDP, no process group.
- **torchrun** (``torchrun --nproc-per-node N -m phaselens train ...``): every block and then the root are
  sharded with ``torch.distributed.fsdp.fully_shard`` over a 1-D mesh of the ranks (NCCL on GPUs, gloo on CPU;
  FSDP2 runs on CPU with gloo in torch 2.13, which ``tests/train/family/test_train.py`` exercises).

The batch of step ``s`` is the same global batch on every world size (``data(batch_size, seed)`` with the
seed of step ``s``, built on every rank); rank ``r`` trains rows ``r*B/N .. (r+1)*B/N - 1`` in micro-batches.
Each rank's loss is its share of the *global* mean (its summed cross-entropy over the global number of
trained positions, times N to undo FSDP's gradient averaging), so the gradient is the single-process one up
to floating-point reduction order. Options: bf16 mixed precision (FSDP's ``MixedPrecisionPolicy`` with fp32
gradient reduction; autocast on one process) and activation checkpointing of every block
(``torch.distributed._composable.checkpoint``, which keeps module names, so hook names do not change).

A run resumes from its last checkpoint (:mod:`phaselens.train.family.checkpoints`) bit-identically to an
uninterrupted run on the same world size: the weights, AdamW's moments and the loss log are restored, and
the data depends only on the step. At the end the whole model is gathered and rank 0 writes it as
``model.safetensors`` + ``config.json`` (+ ``card.json``), which :func:`phaselens.load` reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from phaselens.core.errors import ConfigError, InputError, OutputError
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.compressed.transformer import CompressedTransformer
from phaselens.runtime.fingerprints import fingerprint, model_fingerprint
from phaselens.runtime.world import process_world
from phaselens.train.family import checkpoints as ckpt
from phaselens.train.family.plan import batch_split
from phaselens.train.loop import TrainSettings

LOG = ckpt.LOG
LOG_FORMAT = "phaselens.train_log/1"


@dataclass(frozen=True)
class Parallelism:
    """How a run uses its devices; part of the run's fingerprint (each choice changes the numerics).

    Args:
        precision: ``"fp32"``, or ``"bf16"`` (compute in bf16 with fp32 master weights and fp32 gradient
            reduction; meant for GPUs).
        activation_checkpointing: recompute each block's activations in the backward pass (less memory).
        micro_batch: rows per forward on each rank (gradient accumulation); ``None``: the rank's whole share.
    """

    precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}.")
        if self.micro_batch is not None and (not isinstance(self.micro_batch, int) or self.micro_batch < 1):
            raise ConfigError(f"micro_batch must be a positive int or None, got {self.micro_batch!r}.")


@dataclass
class FamilyRun:
    """What :func:`train_family` returns on every rank (``model`` is the unsharded model on rank 0 only)."""

    model: CompressedTransformer | None
    log: dict[str, Any]
    resumed_from: int
    world_size: int


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _all_sum(values: list[float], device: torch.device) -> list[float]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def _shard(model: CompressedTransformer, par: Parallelism, size: int, device: torch.device) -> None:
    """Activation checkpointing of every block, then FSDP2 over the ranks (blocks first, then the root)."""
    if par.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)
    if size == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if par.precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _global_batch(data: Callable[..., Any], settings: TrainSettings, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from phaselens.train.loop import _batch

    return _batch(data, settings, step)


def _new_log(settings: TrainSettings, size: int) -> dict[str, Any]:
    return {"format": LOG_FORMAT, "world_size": size, "batch_size": settings.batch_size, "step": [], "loss": [],
            "lr": [], "tokens": [], "seconds": [], "val": []}


def train_family(
    cfg: CompressedConfig,
    data: Callable[..., Any],
    settings: TrainSettings,
    run_dir: str | os.PathLike,
    *,
    parallel: Parallelism = Parallelism(),
    val: Callable[[Any], tuple[int, int]] | None = None,
    data_description: Any = None,
    progress: bool = True,
    stop_after: int | None = None,
    time_limit: float | None = None,
) -> FamilyRun:
    """Train ``cfg`` on ``data`` (or resume the run in ``run_dir``), on this process or across torchrun's ranks.

    Args:
        cfg: the member's config (``cfg.seed`` sets the initial weights, identical on every rank).
        data: ``(batch_size, seed) -> (tokens [B, T], targets [B, T])``, deterministic in ``seed``
            (:class:`~phaselens.train.family.data.FamilyData`); called with the global batch size.
        settings: optimiser and schedule; ``batch_size`` is the global batch in sequences.
        run_dir: checkpoints and ``log.json``; an existing run with the same fingerprint resumes.
        parallel: precision, activation checkpointing, micro-batches.
        val: ``model -> (correct, n)`` on this rank's share of a fixed validation set, every
            ``settings.eval_every`` steps (summed over ranks).
        data_description: what identifies ``data`` beyond its batches (recorded in the fingerprint).
        stop_after: stop after this many steps (with a checkpoint), to simulate an interruption.
        time_limit: stop (with a checkpoint) after the first step that ends this many seconds after the call
            began (every rank stops at the same step), e.g. inside a job's wall-clock limit; rerun to resume.

    Returns:
        :class:`FamilyRun`; ``model`` is the whole trained model (fp32, CPU) on rank 0.
    """
    world = process_world()
    rank, size = world.rank, world.size
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputError(f"run directory {run_dir} is a file; pass a directory (it is created if missing).")
    ckpt.check_run_dir(run_dir)  # a log.json or latest.json of the user's is refused before the first step
    share, micro = batch_split(settings.batch_size, size, parallel.micro_batch)  # the plan's own check
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = _device()
    model = CompressedTransformer(cfg)
    init_fp = model_fingerprint(model)
    model = model.to(device).train()
    _shard(model, parallel, size, device)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], lr=settings.lr, weight_decay=settings.weight_decay)

    from phaselens.train.loop import _data_fingerprint

    settings_fp = dataclasses.asdict(settings) | {"threads": None}
    # what changes the loss curve; not the world size, micro-batches or recomputation, which change rounding
    # only (a run resumes on whatever GPUs a preempted job gets back)
    run_fp = fingerprint(config=cfg.to_dict(), settings=settings_fp, data=_data_fingerprint(data, settings),
                         described=data_description, init=init_fp, precision=parallel.precision)
    root = run_dir / "checkpoints"
    pointer = ckpt.latest(root)
    log = _new_log(settings, size)
    if pointer is not None:
        if pointer.get("fingerprint") != run_fp:
            from phaselens.core.errors import CheckpointError

            raise CheckpointError(f"{run_dir} holds a run with other settings (config, training settings, data, "
                                  "initial weights or precision differ); remove it or use another run directory.")
        tensors, log = ckpt.load(root, pointer, rank, size, {n: tuple(p.shape) for n, p in named})
        if pointer["world_size"] != size:
            log["world_size"] = size  # the log says where the run goes on; the pointer said where it was
        ckpt.restore(tensors, named, opt, root)
    start = int(pointer["step"]) if pointer else 0
    end = settings.steps if stop_after is None else min(settings.steps, stop_after)
    prior_s = log["seconds"][-1] if log["seconds"] else 0.0
    bar = _progress(settings.steps, start, progress and world.main)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if parallel.precision == "bf16" and size == 1 \
        else contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        for step in range(start, end):
            ts = time.perf_counter()
            tokens, targets = _global_batch(data, settings, step)
            count = int((targets != -100).sum())
            step_tokens = tokens.numel()  # the global batch's (rows may be shorter during a warm-up)
            mine = slice(rank * share, (rank + 1) * share)
            tokens, targets = tokens[mine].to(device), targets[mine].to(device)
            lr = settings.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            local_sum = torch.zeros((), dtype=torch.float64, device=device)
            n_micro = share // micro
            for i in range(n_micro):
                rows = slice(i * micro, (i + 1) * micro)
                if size > 1:
                    model.set_requires_gradient_sync(i == n_micro - 1)
                with amp:
                    loss_sum = model(tokens[rows], targets=targets[rows], return_type="loss", reduction="sum")
                (loss_sum * (size / max(count, 1))).backward()
                local_sum += loss_sum.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = _all_sum([float(local_sum)], device)[0] / max(count, 1)
            done = step + 1
            elapsed = prior_s + time.perf_counter() - t0
            seen = (log["tokens"][-1] if log["tokens"] else 0) + step_tokens
            for key, value in (("step", done), ("loss", loss), ("lr", lr), ("tokens", seen),
                               ("seconds", round(elapsed, 3))):
                log[key].append(value)
            if val is not None and (done % settings.eval_every == 0 or done == settings.steps):
                model.eval()
                with torch.no_grad():
                    correct, n = _all_sum([float(x) for x in val(model)], device)
                model.train()
                log["val"].append([done, correct / max(n, 1)])
            if done < end and time_limit is not None and _out_of_time(t0, time_limit, device):
                end = done  # every rank stops here, with a checkpoint
            if done % settings.checkpoint_every == 0 or done == end:
                ckpt.save(root, done, rank, size, ckpt.state_tensors(named, opt), {"fingerprint": run_fp},
                          log if world.main else None, _barrier)
                if world.main:
                    ckpt.write_log(run_dir / LOG, log)
            if bar is not None:
                bar.update(1)
                post = {"loss": f"{loss:.4f}", "tok/s": f"{step_tokens / max(time.perf_counter() - ts, 1e-9):,.0f}"}
                if log["val"]:
                    post["val_acc"] = f"{log['val'][-1][1]:.3f}"
                bar.set_postfix(post)
            if done == end:
                break
    finally:
        if bar is not None:
            bar.close()
    whole = gather_model(model, cfg, named, main=world.main) if end == settings.steps else None
    return FamilyRun(whole, log, start, size)


def _out_of_time(t0: float, limit: float, device: torch.device) -> bool:
    """Whether any rank has used ``limit`` seconds (the ranks agree through one all-reduce)."""
    return _all_sum([float(time.perf_counter() - t0 >= limit)], device)[0] > 0


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


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from phaselens.runtime.progress import progress_bar

    return progress_bar(stage="train", unit="step", total=total, initial=initial, leave=True)


def read_log(path: str | os.PathLike) -> dict[str, Any]:
    """A run's loss log (``RUN_DIR/log.json``, or the file itself): ``step``, ``loss``, ``lr``, ``tokens``,
    ``seconds`` (lists, one entry per step) and ``val`` (``[step, accuracy]`` pairs)."""
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
