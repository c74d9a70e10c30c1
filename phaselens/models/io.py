"""Checkpoints: ``model.safetensors`` + ``config.json`` (+ optional ``card.json``). Never pickle.

Writes go through :func:`phaselens.files.atomic_write_dir`: a new directory appears in one rename, an
existing one is updated through a committed journal that :func:`load_model` completes after a kill, and a
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

from phaselens.checkpointing import load_safetensors, read_json, safetensors_metadata
from phaselens.errors import CheckpointError, InputError, OutputError, PhaseLensError
from phaselens.files import DirKind, atomic_write_dir, recover_dir
from phaselens.models.config import CompressedConfig

if TYPE_CHECKING:
    from phaselens.models.transformer import CompressedTransformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "card.json"
FORMAT = "phaselens.compressed_transformer/1"
CHECKPOINT_FILES = (WEIGHTS, CONFIG, CARD)


def is_phaselens_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a checkpoint phaselens wrote (its config or weights carry phaselens's format)."""
    try:
        if json.loads((path / CONFIG).read_text()).get("format") == FORMAT:
            return True
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return safetensors_metadata(path / WEIGHTS, fix="").get("format") == FORMAT
    except PhaseLensError:
        return False


def checkpoint_kind(extra: tuple[str, ...] = ()) -> DirKind:
    """The :class:`DirKind` of checkpoint directories (plus ``extra`` files, e.g. a zoo model's eval batch)."""
    names = CHECKPOINT_FILES + tuple(extra)

    def owned(path: Path) -> frozenset[str]:
        return frozenset(n for n in names if (path / n).exists()) if is_phaselens_checkpoint(path) else frozenset()

    return DirKind("model checkpoint", owned)


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
    model: CompressedTransformer, path: str | os.PathLike, *, metadata: dict[str, Any] | None = None,
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
        save_file(state, str(tmp / WEIGHTS), metadata={"format": FORMAT})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        if metadata is not None:
            (tmp / CARD).write_text(json.dumps(metadata, indent=2, sort_keys=True))

    atomic_write_dir(Path(path), write, kind=checkpoint_kind(), overwrite=overwrite)


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> CompressedTransformer:
    from phaselens.models.transformer import CompressedTransformer

    path = Path(path)
    dev = resolve_device(device)
    if path.is_dir():
        try:
            recover_dir(path)  # finish a save that a kill interrupted
        except (OSError, OutputError) as err:
            raise CheckpointError(f"{path} holds an interrupted save that could not be completed ({err}); "
                                  "make the directory writable and load again.") from None
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise CheckpointError(
            f"{path} is not a phaselens checkpoint: it needs {CONFIG} and {WEIGHTS} "
            "(write one with model.save(path))."
        )
    fix = "save the model again (model.save(path, overwrite=True)) or restore the file from a backup."
    raw = read_json(path / CONFIG, fix=fix)
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{path / CONFIG} has format {raw.get('format')!r}; expected {FORMAT!r}.")
    extra = sorted(set(raw) - {"format", "config", "default_task"})
    if extra:
        raise CheckpointError(f"{path / CONFIG} has unknown key(s) {extra}.")
    if not isinstance(raw.get("config"), dict):
        raise CheckpointError(f"{path / CONFIG} needs a 'config' object, got {type(raw.get('config')).__name__}; {fix}")
    try:
        cfg = CompressedConfig.from_dict(raw["config"])
    except PhaseLensError as err:  # ConfigError, or PhaseGeometryError from the compressor's stride/window
        raise CheckpointError(f"{path / CONFIG}: {err}") from None
    model = CompressedTransformer(cfg)
    tensors = load_safetensors(path / WEIGHTS, fix=fix)
    expected = model.state_dict()
    for name in tied_names(cfg):
        expected.pop(name)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{path / WEIGHTS} is missing tensor(s) {missing[:5]} for this config.")
    if unexpected:
        raise CheckpointError(f"{path / WEIGHTS} has unexpected tensor(s) {unexpected[:5]} for this config.")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"tensor {name!r} in {path / WEIGHTS} has shape {tuple(tensor.shape)}, "
                f"but the config needs {tuple(expected[name].shape)}."
            )
    model.load_state_dict(tensors, strict=not tied_names(cfg))
    if raw.get("default_task") is not None:
        from phaselens.tasks import task_from_dict

        try:
            model.default_task = task_from_dict(raw["default_task"])
        except (PhaseLensError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path / CONFIG}: default_task cannot be rebuilt ({err}); {fix}") from None
    if (path / CARD).is_file():
        model.metadata = read_json(path / CARD, fix=fix)
    return model.to(dev).eval()
