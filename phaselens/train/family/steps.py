"""The step folders of a training run's ``checkpoints``: their names, which of them are intact, and the
earlier step a damaged one leaves to resume from.

Each commit keeps the step it replaces (:func:`phaselens.train.family.checkpoints.save`), so a step damaged
on disk (its rank files carry each tensor's sha256, :mod:`phaselens.storage.checksums`) leaves an intact one
to resume from. Which step that is, is said in the error; the user chooses it by removing the damaged folder:
a ``latest.json`` that names a folder that is gone then resumes from the newest intact earlier step, with a
warning (:func:`fallback`).
"""

from __future__ import annotations

import json
import numbers
import re
import warnings
from pathlib import Path
from typing import Any

from phaselens.errors import CheckpointError, InputError
from phaselens.storage import manifest as mf
from phaselens.storage.checksums import verify_file
from phaselens.storage.resumable import read_json, safetensors_metadata

LATEST = "latest.json"
LOG = "log.json"
FORMAT = "phaselens.family_train_state/1"
BY = "training run"
STEP = re.compile(r"step-\d{9}")
RANK = re.compile(r"rank(\d+)-of-(\d+)\.safetensors")


class StepFallbackWarning(UserWarning):
    """A run resumes (or loads) from an earlier step because the folder ``latest.json`` names is gone."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def rank_file(rank: int, size: int) -> str:
    return f"rank{rank}-of-{size}.safetensors"


def parse_step(step: Any) -> int:
    """A step given by a user: an int, or a string ``"2"``, ``"step-2"`` or ``"step-000000002"``.

    Raises:
        InputError: anything else (a bool, a negative or non-integral number, another string).
    """
    if isinstance(step, numbers.Integral) and not isinstance(step, bool) and int(step) >= 0:
        return int(step)
    if isinstance(step, str):
        m = re.fullmatch(r"\s*(?:step-)?(\d{1,18})\s*", step)
        if m:
            return int(m.group(1))
    raise InputError(f"step={step!r} is not a training step: pass a non-negative int such as step=1200 (or the "
                     "string '1200' or a step folder's name, 'step-000001200').")


def header_meta(path: Path, fix: str) -> dict[str, Any]:
    """The ``meta`` a rank file's header records (its step, rank, world size, fingerprint, config)."""
    header = safetensors_metadata(path, fix=fix)
    try:
        meta = json.loads(header.get("meta", ""))
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} has damaged metadata; {fix}")
    return meta


def read_step_log(d: Path, fix: str) -> dict[str, Any]:
    """The loss log of the step folder ``d``, checked against the sha256 its folder's manifest recorded."""
    rec = mf.read_manifest(d)[0].get(LOG)
    if rec is not None and rec.get("by") == BY and (d / LOG).is_file() and not mf.proven(d, LOG, rec):
        raise CheckpointError(f"{d / LOG} is damaged: its bytes no longer match the sha256 that phaselens recorded "
                              f"in {d / mf.MANIFEST} when it wrote the file; {fix}")
    return read_json(d / LOG, fix=fix)


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step-NNNNNNNNN`` folder of ``root``, newest first."""
    try:
        found = [(int(p.name[5:]), p) for p in root.iterdir() if STEP.fullmatch(p.name) and p.is_dir()]
    except OSError:
        return []
    return sorted(found, reverse=True)


def world_size(d: Path) -> int | None:
    """The world size of the rank files in the step folder ``d`` (from ``rank0-of-W``), or None."""
    sizes = sorted(int(m.group(2)) for p in d.glob("rank0-of-*.safetensors") if (m := RANK.fullmatch(p.name)))
    return sizes[0] if len(sizes) == 1 else None


def intact(d: Path, step: int) -> int | None:
    """The world size of the step folder ``d`` if it is a complete, undamaged step ``step`` (every rank file
    present, of that step, every tensor matching its sha256, and a readable loss log); otherwise None."""
    size = world_size(d)
    if size is None:
        return None
    try:
        for r in range(size):
            path = d / rank_file(r, size)
            if header_meta(path, "").get("step") != step:
                return None
            verify_file(path, fix="")
        read_step_log(d, "")
    except (CheckpointError, OSError):
        return None
    return size


def intact_before(root: Path, step: int) -> tuple[int, Path, int] | None:
    """``(step, folder, world size)`` of the newest intact step of ``root`` before ``step``, or None."""
    for s, d in step_folders(root):
        if s < step and (size := intact(d, s)) is not None:
            return s, d, size
    return None


def earlier_fix(root: Path, step: int, damaged: Path, *, resume: bool) -> str:
    """What to do when step ``step`` (folder ``damaged``) is damaged: use the newest intact earlier step, if
    one is kept, else start over."""
    found = intact_before(root, step)
    if found is None:
        return (f"no earlier intact step is kept: delete {root} to restart from step 0." if resume else
                "no earlier intact step is kept: restore the file from a backup, or train again.")
    s, d, _ = found
    if resume:
        return (f"step {s} ({d}) is intact: delete {damaged} and run again to resume from step {s}, or delete "
                f"{root} to restart from step 0.")
    return f"step {s} ({d}) is intact: phaselens.train.load_checkpoint({str(root.parent)!r}, step={s}) loads it."


def fallback(root: Path, pointer: dict[str, Any]) -> dict[str, Any]:
    """``pointer`` itself when the folder it names exists; otherwise (the user removed a damaged step) the
    pointer of the newest intact earlier step, with a :class:`StepFallbackWarning`.

    Raises:
        CheckpointError: the folder is gone and no intact earlier step is left.
    """
    d = root / pointer["dir"]
    if d.exists():
        return pointer
    found = intact_before(root, pointer["step"])
    if found is None:
        raise CheckpointError(f"{root / LATEST} names step {pointer['step']}, but {d} is gone and no intact earlier "
                              f"step is kept; delete {root} to restart from step 0.")
    s, folder, size = found
    warnings.warn(StepFallbackWarning(
        f"{root / LATEST} names step {pointer['step']}, but {d} is gone: resuming from step {s} ({folder}), the "
        "newest intact earlier step."), stacklevel=3)
    return {**pointer, "step": s, "dir": folder.name, "world_size": size}
