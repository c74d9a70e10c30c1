"""Checkpoints: ``model.safetensors`` + ``config.json`` (+ optional ``card.json``). Never pickle. The weights' header
records each tensor's sha256 (:mod:`phaselens.storage.checksums`), checked when the model is loaded.

Writes go through :func:`phaselens.storage.writing.atomic_write_dir`: a new directory appears in one rename, an
existing one is updated through a committed record that
:func:`~phaselens.models.compressed.loader.load_model` completes after a kill, and a
directory holding files phaselens did not write is refused unless ``overwrite=True`` (which still replaces
only the checkpoint's own files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from phaselens.errors import InputError, PhaseLensError
from phaselens.storage.checksums import stamped
from phaselens.storage.reading import peek_json_object
from phaselens.storage.resumable import safetensors_metadata
from phaselens.storage.writing import DirKind, atomic_write_dir

if TYPE_CHECKING:
    from phaselens.models.compressed.config import CompressedConfig

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "card.json"
FORMAT = "phaselens.compressed_transformer/1"
CHECKPOINT_FILES = (WEIGHTS, CONFIG, CARD)


def is_phaselens_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint phaselens wrote (its config or weights carry phaselens's format)."""
    if peek_json_object(path / CONFIG).get("format") == FORMAT:
        return True
    try:
        return safetensors_metadata(path / WEIGHTS, fix="").get("format") == FORMAT
    except PhaseLensError:
        return False


def checkpoint_kind(extra: tuple[str, ...] = ()) -> DirKind:
    """The :class:`DirKind` of checkpoint directories (plus ``extra`` files, e.g. a zoo model's eval batch)."""
    names = CHECKPOINT_FILES + tuple(extra)

    def legacy(path: Path) -> frozenset[str]:  # a checkpoint saved before manifests existed
        return frozenset(n for n in names if (path / n).exists()) if is_phaselens_checkpoint(path) else frozenset()

    return DirKind("model checkpoint", legacy)


def tied_names(cfg: CompressedConfig) -> tuple[str, ...]:
    """State-dict names that alias another parameter and are not stored (the tied unembedding)."""
    return ("unembed.weight",) if cfg.tie_embeddings else ()


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``, refusing one this machine does not have (an :class:`InputError`
    that names the fix) instead of failing deep inside torch."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise InputError(f"device={device!r} is not a device ({err}); use 'cpu', 'cuda', 'cuda:0' or 'mps'.") from None
    if dev.type == "meta":
        raise InputError(f"device={device!r} holds shapes without values, so nothing could be computed or loaded; "
                         "use 'cpu' or 'cuda' (a dry run needs no device: specialization_map(..., plan=True)).")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device={device!r}, but torch sees no CUDA GPU on this machine "
                             "(torch.cuda.is_available() is False); use device='cpu'.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"device={device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s); "
                             f"use an index below {torch.cuda.device_count()}.")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise InputError(f"device={device!r}, but MPS is not available on this machine; use device='cpu'.")
    return dev


def save_model(
    model: torch.nn.Module, path: str | os.PathLike, *, metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Write the checkpoint directory ``path`` (see the module docstring for what is replaced)."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    for name in tied_names(model.config):
        state.pop(name)  # stored once, under the name it is tied to (safetensors refuses shared tensors)
    config = {"format": FORMAT, "config": model.config.to_dict()}
    if model.default_task is not None and hasattr(model.default_task, "to_dict"):
        config["default_task"] = model.default_task.to_dict()

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS), metadata=stamped({"format": FORMAT}, state))
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        if metadata is not None:
            (tmp / CARD).write_text(json.dumps(metadata, indent=2, sort_keys=True))

    atomic_write_dir(Path(path), write, kind=checkpoint_kind(), overwrite=overwrite)
