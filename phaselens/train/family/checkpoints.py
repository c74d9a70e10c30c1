"""Sharded, resumable training checkpoints: one safetensors file per rank, committed by one atomic pointer.

Layout of ``run_dir/checkpoints``::

    step-000000120/rank0-of-2.safetensors   this rank's shards of the weights and the AdamW moments
    step-000000120/rank1-of-2.safetensors   (``DTensor.to_local()`` under FSDP; whole tensors on one process)
    step-000000120/log.json                 the loss log up to this step (rank 0)
    latest.json                             {"step": 120, "dir": "step-000000120", "world_size": 2, ...}

Every rank writes its file atomically, the ranks meet at a barrier, then rank 0 writes the log and replaces
``latest.json`` in one rename: a kill at any moment leaves ``latest.json`` naming a complete step (a half
written step directory is ignored and removed by the next save).

The ownership rule of :mod:`phaselens.runtime.files` holds here too: a rank file is phaselens's by its own
header, ``log.json`` and ``latest.json`` by the folder's manifest (or, for ``latest.json``, its format stamp).
The clean-up removes only those files, from folders named exactly ``step-NNNNNNNNN``, and a folder only once
it is empty: a user's ``step-keep/`` or a note inside a step folder stays. Nothing is pickled (safetensors + JSON; not
``torch.distributed.checkpoint``, whose metadata file is a pickle). Shards are this world size's; resuming
on another world size is refused with a message (the exported model, whole tensors, loads anywhere).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from phaselens.core.errors import CheckpointError, OutputError
from phaselens.runtime import manifest as mf
from phaselens.runtime.checkpoints import load_safetensors, read_json, safetensors_metadata
from phaselens.runtime.files import owns_file, write_owned_file
from phaselens.runtime.oserrors import writing
from phaselens.runtime.reading import peek_json_object

LATEST = "latest.json"
LOG = "log.json"
FORMAT = "phaselens.family_train_state/1"
BY = "training run"
_STEP = re.compile(r"step-\d{9}")
_RANK = re.compile(r"rank\d+-of-\d+\.safetensors")


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
    with writing(d):
        d.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "meta": json.dumps({**meta, "step": step, "rank": rank, "world_size": size})}
    write_owned_file(d / _rank_file(rank, size), lambda tmp: save_file(tensors, str(tmp), metadata=header), by=BY,
                     proves=_is_rank_file, record=False)  # ranks share the folder: the header is the proof
    barrier()
    if rank != 0:
        return
    assert log is not None
    write_log(d / LOG, log)
    text = json.dumps({"format": FORMAT, "step": step, "dir": d.name, "world_size": size,
                       "fingerprint": meta["fingerprint"]})
    write_owned_file(root / LATEST, lambda tmp: tmp.write_text(text, encoding="utf-8"), by=BY, proves=_is_pointer)
    for old in root.iterdir():  # earlier steps, and any step a kill left half written
        if old.name != d.name and _STEP.fullmatch(old.name) and old.is_dir() and not old.is_symlink():
            _remove_own(old)


def write_log(path: Path, log: dict[str, Any]) -> None:
    """Write a loss log to ``path`` under the ownership rule (a ``log.json`` of the user's is never replaced)."""
    text = json.dumps(log)
    write_owned_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), by=BY)


def _is_rank_file(path: Path) -> bool:
    try:
        return safetensors_metadata(path, fix="").get("format") == FORMAT
    except CheckpointError:
        return False


def _is_pointer(path: Path) -> bool:
    return peek_json_object(path).get("format") == FORMAT


def _remove_own(d: Path) -> None:
    """Remove what phaselens wrote in the step folder ``d`` (rank files by their header, files its manifest
    lists unchanged), then ``d`` if nothing else is left; a file of the user's keeps the folder."""
    owned = mf.owned_by(d, BY)
    for f in d.iterdir():
        if f.name in owned or (_RANK.fullmatch(f.name) and mf.is_plain_file(f) and _is_rank_file(f)):
            f.unlink(missing_ok=True)
    manifest = d / mf.MANIFEST
    rest = [f.name for f in d.iterdir() if f != manifest]
    if not rest:
        manifest.unlink(missing_ok=True)
        os.rmdir(d)
    elif manifest.exists():
        mf.update(d, drop=tuple(n for n in owned if not (d / n).exists()))


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before the first step, a run directory whose files phaselens would have to overwrite: a
    ``log.json`` or ``checkpoints/latest.json`` that phaselens did not write (or that is not a regular file),
    or a ``--runs`` path that is a file. ``--force`` does not change this: these files are the user's."""
    for where in (run_dir, *run_dir.parents):
        if where.exists() and not where.is_dir():
            raise OutputError(f"the run directory {run_dir} lies under the file {where}; point --runs at a folder.")
    for path, proves in ((run_dir / LOG, None), (run_dir / "checkpoints" / LATEST, _is_pointer)):
        if os.path.lexists(path) and not owns_file(path, BY, proves):
            raise OutputError(f"{path} exists and phaselens did not write it (its manifest does not list it "
                              "unchanged), so training would overwrite it; move that file, or pass another "
                              "--runs folder. Nothing was trained.")


def latest(root: Path) -> dict[str, Any] | None:
    """The committed pointer (``latest.json``), or None when no checkpoint exists."""
    if not (root / LATEST).is_file():
        return None
    fix = f"delete {root} to restart from step 0, or pass another run directory."
    meta = read_json(root / LATEST, fix=fix)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{root / LATEST} is not a phaselens family checkpoint pointer; {fix}")
    step, folder, size, fp = (meta.get(k) for k in ("step", "dir", "world_size", "fingerprint"))
    bad = [k for k, ok in (("step", _count(step, 0)), ("world_size", _count(size, 1)), ("fingerprint", isinstance(fp, str)),
                           ("dir", isinstance(folder, str) and _STEP.fullmatch(folder) is not None
                            and _count(step, 0) and folder == _step_dir(root, step).name)) if not ok]
    if bad:  # a pointer is data: it never names a folder outside checkpoints/ or a step it does not hold
        raise CheckpointError(f"{root / LATEST} is damaged: its {', '.join(bad)} is missing or malformed "
                              f"(step {step!r}, dir {str(folder)[:40]!r}, world_size {size!r}); {fix}")
    return meta


def _count(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


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
    return load_safetensors(path, fix=fix), read_json(d / LOG, fix=fix)


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
