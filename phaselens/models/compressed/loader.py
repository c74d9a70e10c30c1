"""Loading a checkpoint that :func:`~phaselens.models.compressed.io.save_model` wrote into a
:class:`~phaselens.models.compressed.transformer.CompressedTransformer` (finishing an interrupted save first)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from phaselens.errors import CheckpointError, OutputError, PhaseLensError
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.compressed.io import CARD, CONFIG, FORMAT, WEIGHTS, resolve_device, tied_names
from phaselens.models.compressed.transformer import CompressedTransformer
from phaselens.storage.resumable import check_floating, check_tensor_names, load_safetensors, read_json
from phaselens.storage.writing import recover_dir


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> CompressedTransformer:
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
    for name in tied_names(cfg):  # stored once, under the name it is tied to
        expected.pop(name)
    check_tensor_names({k: v.shape for k, v in expected.items()}, {k: v.shape for k, v in tensors.items()},
                       where=f"{path / WEIGHTS}", fix=f"config.json and the weights disagree; {fix}")
    check_floating(tensors, where=f"{path / WEIGHTS}", fix=fix)  # an int32 rewrite is refused, never cast
    # the saved dtype comes back (a bf16 model saved is a bf16 model loaded, not fp32)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model = model.to(next(iter(dtypes)))
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
