"""The one training loop of phaselens: the zoo (one process, CPU) and the paper's family (one process or
``torchrun`` ranks with FSDP2) both run :func:`run`.

The batch of step ``s`` is the same global batch on every world size (:func:`~phaselens.train.settings.batch`,
built on every rank); rank ``r`` trains rows ``r*B/N .. (r+1)*B/N - 1`` in micro-batches. Two objectives:

- ``"sum"`` (the family): each rank's loss is its share of the *global* mean (its summed cross-entropy over
  the global number of trained positions, times N to undo FSDP's gradient averaging), the logits computed at
  the trained positions only, so the gradient is the single-process one up to reduction order;
- ``"mean"`` (the zoo): one forward of the whole batch and ``F.cross_entropy`` over every position (``-100``
  ignored), exactly the zoo's loop before the two were merged (its shipped models are bit-identical to it).

One checkpoint format (:mod:`phaselens.train.family.checkpoints`: per-rank safetensors committed by an atomic
``latest.json``; nothing pickled), resharded on load to any world size; one loss log (``log.json``, written at
each checkpoint); one metrics file written every ``log_every`` steps (:mod:`phaselens.train.metrics`: loss, grad
norm, lr, tokens/s, TFLOP/s, MFU and peak memory, also on the progress bar); rank 0 alone writes and prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from phaselens.errors import CheckpointError, ConfigError, OutputError
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.compressed.transformer import CompressedTransformer
from phaselens.parallel.world import process_world
from phaselens.storage.fingerprints import fingerprint, model_fingerprint
from phaselens.train import metrics as mx
from phaselens.train.family import checkpoints as ckpt
from phaselens.train.settings import EmptyTargetsWarning, TrainSettings, batch, batch_split, data_fingerprint

LOG = ckpt.LOG
LOG_FORMAT = "phaselens.train_log/1"

PARTS = {
    "config": "the model config differs",
    "settings": "the TrainSettings differ",
    "data": "batch_fn gives other batches (another task, or a batch_fn not deterministic in its seed)",
    "described": "the data's description differs",
    "init": "the initial weights differ (cfg.seed or init_fn)",
    "precision": "the precision differs",
}


@dataclass(frozen=True)
class Parallelism:
    """How a run uses its devices. Only ``precision`` is part of the run's fingerprint: micro-batches and
    recomputation change rounding only, so a run resumes with other ones (as on another GPU count).

    Args:
        precision: ``"fp32"``, or ``"bf16"`` (compute in bf16 with fp32 master weights and fp32 gradient
            reduction; meant for GPUs).
        recompute_activations: recompute each block's activations in the backward pass (less memory).
        micro_batch: rows per forward on each rank (gradient accumulation); ``None``: the rank's whole share.
    """

    precision: Literal["fp32", "bf16"] = "fp32"
    recompute_activations: bool = False
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}.")
        if self.micro_batch is not None and (not isinstance(self.micro_batch, int) or self.micro_batch < 1):
            raise ConfigError(f"micro_batch must be a positive int or None, got {self.micro_batch!r}.")


SERIAL = Parallelism()  # one process, fp32, no recomputation, whole batches


@dataclass
class Run:
    """What :func:`run` returns on every rank: the live (possibly sharded) model and its named parameters,
    the loss log, where the run started and ended."""

    model: Any
    named: list[tuple[str, torch.Tensor]]
    log: dict[str, Any]
    start: int
    end: int
    world_size: int
    main: bool


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_sum(values: list[float], where: torch.device) -> list[float]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(t)
    return t.tolist()


def _shard(model: CompressedTransformer, par: Parallelism, size: int, where: torch.device) -> None:
    """Activation recompute of every block, then FSDP2 over the ranks (blocks first, then the root)."""
    if par.recompute_activations:
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)
    if size == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(where.type, (size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if par.precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def new_log(settings: TrainSettings, size: int) -> dict[str, Any]:
    return {"format": LOG_FORMAT, "world_size": size, "batch_size": settings.batch_size, "step": [], "loss": [],
            "lr": [], "grad_norm": [], "tokens": [], "seconds": [], "val": []}


def _check_fingerprint(run_dir: Path, stored: Any, expect: dict[str, str]) -> None:
    if stored == expect:
        return
    stored = stored if isinstance(stored, dict) else {}
    differ = [PARTS[k] for k in expect if stored.get(k) != expect[k]]
    raise CheckpointError(f"{run_dir} holds a run with other settings: {'; '.join(differ)}. Remove it or use "
                          "another run directory.")


def run(cfg: CompressedConfig, data: Callable[..., Any], settings: TrainSettings, run_dir: str | os.PathLike, *,
        parallel: Parallelism = Parallelism(), val: Callable[[Any], tuple[float, float]] | None = None,
        data_description: Any = None, progress: bool = True, stop_after: int | None = None,
        time_limit: float | None = None, init_fn: Callable[[CompressedTransformer], None] | None = None,
        objective: Literal["sum", "mean"] = "sum", on: torch.device | None = None, log_every: int = 10,
        peak_tflops: float | None = None) -> Run:
    """Train ``cfg`` on ``data`` (or resume the run in ``run_dir``) on this process or across torchrun's ranks.

    ``val``: ``model -> (correct, n)`` on this rank's share, every ``settings.eval_every`` steps (summed over
    ranks). ``init_fn``: called on the fresh model before its fingerprint (to plant and freeze weights).
    ``on``: the device (default: the current CUDA device, else the CPU). ``log_every``: steps between metrics
    records. ``peak_tflops``: the device's peak, for the MFU in the metrics (None: no MFU).
    See :func:`phaselens.train.family.trainer.train_family` for the other arguments.
    """
    import numbers

    world = process_world()
    rank, size = world.rank, world.size
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise OutputError(f"run directory {run_dir} is a file; pass a directory (it is created if missing).")
    if stop_after is not None and (not isinstance(stop_after, numbers.Integral) or stop_after < 0):
        raise ConfigError(f"stop_after must be a non-negative int or None, got {stop_after!r}.")
    ckpt.check_run_dir(run_dir)  # a log.json or latest.json of the user's is refused before the first step
    share, micro = batch_split(settings.batch_size, size, parallel.micro_batch)  # the plan's own check
    if objective == "mean" and (size > 1 or micro != share):
        raise ConfigError("the zoo's objective ('mean') trains one whole batch per step on one process.")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    where = on or device()
    model = CompressedTransformer(cfg)
    if init_fn is not None:
        init_fn(model)
    init_fp = model_fingerprint(model)
    model = model.to(where).train()
    _shard(model, parallel, size, where)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named if p.requires_grad], lr=settings.lr,
                            weight_decay=settings.weight_decay)
    settings_fp = dataclasses.asdict(settings) | {"threads": None}
    # what changes the loss curve; not the world size, micro-batches or recomputation, which change rounding
    # only (a run resumes on whatever GPUs a preempted job gets back)
    run_fp = {"config": fingerprint(c=cfg.to_dict()), "settings": fingerprint(s=settings_fp),
              "data": data_fingerprint(data, settings), "described": fingerprint(d=data_description),
              "init": init_fp, "precision": parallel.precision}
    root = run_dir / "checkpoints"
    pointer = ckpt.latest(root)
    log = new_log(settings, size)
    if pointer is not None:
        _check_fingerprint(run_dir, pointer.get("fingerprint"), run_fp)
        tensors, log = ckpt.load(root, pointer, rank, size, {n: tuple(p.shape) for n, p in named})
        log["world_size"] = size  # the log says where the run goes on; the pointer said where it was
        ckpt.restore(tensors, named, opt, root)
    start = int(pointer["step"]) if pointer else 0
    end = settings.steps if stop_after is None else min(settings.steps, stop_after)
    prior_s = log["seconds"][-1] if log["seconds"] else 0.0
    meter = mx.Meter(run_dir, cfg, model, start, log_every, peak_tflops, where) if world.main else None
    bar = _progress(settings.steps, start, progress and world.main)
    amp = torch.autocast(where.type, dtype=torch.bfloat16) if parallel.precision == "bf16" and size == 1 \
        else contextlib.nullcontext()
    t0 = time.perf_counter()
    try:
        for step in range(start, end):
            tokens, targets = batch(data, settings, step)
            count = int((targets != -100).sum())
            step_tokens = tokens.numel()  # the global batch's (rows may be shorter during a warm-up)
            lr = settings.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            if count == 0 and world.main:  # rank 0 speaks for every rank (they skip the same step)
                # the mean loss would be 0/0 = NaN and its NaN gradients would poison every weight
                warnings.warn(EmptyTargetsWarning(
                    f"step {step}: every target of the batch is -100 (ignored), so there is no loss; the step is "
                    "skipped (loss recorded as NaN). Check that batch_fn marks the positions to train on."
                ), stacklevel=3)
            if count == 0:
                loss, norm = float("nan"), float("nan")
            else:
                mine = slice(rank * share, (rank + 1) * share)
                loss, norm = _step(model, opt, tokens[mine].to(where), targets[mine].to(where), count, micro, size,
                                   settings, amp, objective, where)
            done = step + 1
            elapsed = prior_s + time.perf_counter() - t0
            seen = (log["tokens"][-1] if log["tokens"] else 0) + step_tokens
            for key, value in (("step", done), ("loss", loss), ("lr", lr), ("grad_norm", norm), ("tokens", seen),
                               ("seconds", round(elapsed, 3))):
                log.setdefault(key, []).append(value)
            if val is not None and (done % settings.eval_every == 0 or done == settings.steps):
                model.eval()
                with torch.no_grad():
                    correct, n = all_sum([float(x) for x in val(model)], where)
                model.train()
                log["val"].append([done, correct / max(n, 1)])
            if done < end and time_limit is not None and _out_of_time(t0, time_limit, where):
                end = done  # every rank stops here, with a checkpoint
            if done % settings.checkpoint_every == 0 or done == end:
                ckpt.save(root, done, rank, size, ckpt.state_tensors(named, opt),
                          {"fingerprint": run_fp, "config": cfg.to_dict()}, log if world.main else None, barrier)
                if world.main:
                    ckpt.write_log(run_dir / LOG, log)
            if meter is not None:
                record = meter.step(done, loss, norm, lr, step_tokens, tokens.shape[1], count / len(tokens),
                                    last=done == end)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(mx.postfix(record or meter.last, log))
            if done == end:
                break
    finally:
        if bar is not None:
            bar.close()
    return Run(model, named, log, start, end, size, world.main)


def _step(model: Any, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor, count: int,
          micro: int, size: int, settings: TrainSettings, amp: Any, objective: str,
          where: torch.device) -> tuple[float, float]:
    """One optimizer step over this rank's rows; ``(global mean loss, gradient norm before clipping)``."""
    if objective == "mean":  # the zoo's step, unchanged: one forward, the mean over every position
        opt.zero_grad(set_to_none=True)
        with amp:
            logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        return float(loss.detach()), float(norm)
    local_sum = torch.zeros((), dtype=torch.float64, device=where)
    n_micro = len(tokens) // micro
    for i in range(n_micro):
        rows = slice(i * micro, (i + 1) * micro)
        if size > 1:
            model.set_requires_gradient_sync(i == n_micro - 1)
        with amp:
            loss_sum = model(tokens[rows], targets=targets[rows], return_type="loss", reduction="sum")
        (loss_sum * (size / count)).backward()
        local_sum += loss_sum.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return all_sum([float(local_sum)], where)[0] / count, float(norm)


def _out_of_time(t0: float, limit: float, where: torch.device) -> bool:
    """Whether any rank has used ``limit`` seconds (the ranks agree through one all-reduce)."""
    return all_sum([float(time.perf_counter() - t0 >= limit)], where)[0] > 0


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from phaselens.parallel.progress import progress_bar

    return progress_bar(stage="train", unit="step", total=total, initial=initial, leave=True)
