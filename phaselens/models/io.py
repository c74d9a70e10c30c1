"""Checkpoints: ``model.safetensors`` + ``config.json`` (+ optional ``card.json``). Never pickle.

Writes are atomic: files go to a temporary directory beside the target, which is then renamed into
place, so an interrupted save never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from phaselens.errors import CheckpointError, ConfigError
from phaselens.models.config import CompressedConfig

if TYPE_CHECKING:
    from phaselens.models.transformer import CompressedTransformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "card.json"
FORMAT = "phaselens.compressed_transformer/1"


def atomic_write_dir(target: Path, write: Any) -> None:
    """Call ``write(tmpdir)`` and then move ``tmpdir`` to ``target``, replacing it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_model(model: CompressedTransformer, path: str | os.PathLike, *, metadata: dict[str, Any] | None = None) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    config = {"format": FORMAT, "config": model.config.to_dict()}
    if model.default_task is not None and hasattr(model.default_task, "to_dict"):
        config["default_task"] = model.default_task.to_dict()

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": FORMAT})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        if metadata is not None:
            (tmp / CARD).write_text(json.dumps(metadata, indent=2, sort_keys=True))

    atomic_write_dir(Path(path), write)


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> CompressedTransformer:
    from phaselens.models.transformer import CompressedTransformer

    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise CheckpointError(
            f"{path} is not a phaselens checkpoint: it needs {CONFIG} and {WEIGHTS} "
            "(write one with model.save(path))."
        )
    try:
        raw = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path / CONFIG} is not valid JSON: {err}") from None
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{path / CONFIG} has format {raw.get('format')!r}; expected {FORMAT!r}.")
    extra = sorted(set(raw) - {"format", "config", "default_task"})
    if extra:
        raise CheckpointError(f"{path / CONFIG} has unknown key(s) {extra}.")
    try:
        cfg = CompressedConfig.from_dict(raw["config"])
    except ConfigError as err:
        raise CheckpointError(f"{path / CONFIG}: {err}") from None
    model = CompressedTransformer(cfg)
    tensors = load_file(str(path / WEIGHTS))
    expected = model.state_dict()
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
    model.load_state_dict(tensors, strict=True)
    if "default_task" in raw:
        from phaselens.tasks import task_from_dict

        model.default_task = task_from_dict(raw["default_task"])
    if (path / CARD).is_file():
        model.metadata = json.loads((path / CARD).read_text())
    return model.to(device).eval()
