"""Sharded, resumable training checkpoints: one safetensors file per rank, committed by one atomic pointer.

Layout of ``run_dir/checkpoints``::

    step-000000120/rank0-of-2.safetensors   this rank's shards of the weights and the AdamW moments
    step-000000120/rank1-of-2.safetensors   (``DTensor.to_local()`` under FSDP; whole tensors on one process)
    step-000000120/log.json                 the loss log up to this step (rank 0)
    latest.json                             {"step": 120, "dir": "step-000000120", "world_size": 2, ...}

Every rank writes its file atomically, the ranks meet at a barrier, then rank 0 writes the log and replaces
``latest.json`` in one rename: a kill at any moment leaves ``latest.json`` naming a complete step (a half
written step directory is ignored and removed by the next save). Nothing is pickled (safetensors + JSON; not
``torch.distributed.checkpoint``, whose metadata file is a pickle). Shards are this world size's; resuming
on another world size is refused with a message (the exported model, whole tensors, loads anywhere).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from phaselens.core.errors import CheckpointError
from phaselens.runtime.checkpoints import load_safetensors, read_json, safetensors_metadata
from phaselens.runtime.files import atomic_write_file, atomic_write_text

LATEST = "latest.json"
FORMAT = "phaselens.family_train_state/1"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or optimizer tensor (``DTensor.to_local()``; a plain tensor as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def _rank_file(rank: int, size: int) -> str:
    return f"rank{rank}-of-{size}.safetensors"


def state_tensors(named: Iterable[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's tensors: ``model.NAME`` and ``adam.{exp_avg,exp_avg_sq,step}.NAME`` (CPU, contiguous)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in named:
        out[f"model.{name}"] = local(p).detach()
        st = opt.state.get(p)
        if st:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                out[f"adam.{key}.{name}"] = local(st[key]).detach().reshape(-1 if key != "step" else 1)
    return {k: v.to("cpu", copy=True).contiguous() for k, v in out.items()}


def save(root: Path, step: int, rank: int, size: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
         log: dict[str, Any] | None, barrier: Any) -> None:
    """Write this rank's shard of ``step``; rank 0 (``log`` given) commits it after ``barrier()``."""
    d = _step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "meta": json.dumps({**meta, "step": step, "rank": rank, "world_size": size})}
    atomic_write_file(d / _rank_file(rank, size), lambda tmp: save_file(tensors, str(tmp), metadata=header))
    barrier()
    if rank != 0:
        return
    assert log is not None
    atomic_write_text(d / "log.json", json.dumps(log))
    atomic_write_text(root / LATEST, json.dumps({"format": FORMAT, "step": step, "dir": d.name, "world_size": size,
                                                 "fingerprint": meta["fingerprint"]}))
    for old in root.glob("step-*"):  # earlier steps, and any step a kill left half written
        if old.is_dir() and old.name != d.name:
            shutil.rmtree(old, ignore_errors=True)


def latest(root: Path) -> dict[str, Any] | None:
    """The committed pointer (``latest.json``), or None when no checkpoint exists."""
    if not (root / LATEST).is_file():
        return None
    fix = f"delete {root} to restart from step 0, or pass another run directory."
    meta = read_json(root / LATEST, fix=fix)
    if meta.get("format") != FORMAT or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{root / LATEST} is not a phaselens family checkpoint pointer; {fix}")
    return meta


def load(root: Path, pointer: dict[str, Any], rank: int, size: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors of the committed step and the step's loss log."""
    fix = f"delete {root} to restart from step 0, or pass another run directory."
    if pointer["world_size"] != size:
        raise CheckpointError(
            f"{root} was checkpointed by {pointer['world_size']} process(es) and this run has {size}: sharded "
            f"checkpoints resume on the same world size. Rerun with torchrun --nproc-per-node "
            f"{pointer['world_size']} (or {fix[0].lower() + fix[1:]})")
    d = root / pointer["dir"]
    path = d / _rank_file(rank, size)
    header = safetensors_metadata(path, fix=fix)
    try:
        meta = json.loads(header.get("meta", ""))
    except ValueError:
        raise CheckpointError(f"{path} has damaged metadata; {fix}") from None
    if meta.get("step") != pointer["step"]:
        raise CheckpointError(f"{path} holds step {meta.get('step')}, but {root / LATEST} names {pointer['step']}; {fix}")
    return load_safetensors(path, fix=fix), read_json(d / "log.json", fix=fix)


def restore(tensors: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer,
            where: Path) -> None:
    """Copy ``tensors`` into the parameters (their local shards) and rebuild AdamW's state exactly."""
    fix = f"delete {where} to restart from step 0, or pass another run directory."
    with torch.no_grad():
        for name, p in named:
            saved = tensors.get(f"model.{name}")
            mine = local(p)
            if saved is None or saved.shape != mine.shape:
                raise CheckpointError(f"{where}: parameter {name} is missing or has another shape; {fix}")
            mine.copy_(saved)
            if f"adam.step.{name}" not in tensors:
                continue
            state = {"step": tensors[f"adam.step.{name}"].reshape(()).clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                buf = torch.zeros_like(p)
                local(buf).copy_(tensors[f"adam.{key}.{name}"].view_as(mine))
                state[key] = buf
            opt.state[p] = state
