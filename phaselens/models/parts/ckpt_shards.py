"""A checkpoint directory's safetensors shards, found and checked from their headers and
``model.safetensors.index.json`` alone (no tensor data read): what the DeepSeek-V4 and V4.1 loaders (and
``phaselens plan``) refuse before anything is built. Never pickle, never a download."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from phaselens.errors import CheckpointError, UnsupportedModelError
from phaselens.storage.resumable import read_json

PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
FIX_SHARD = "download this shard again (or convert it again from the release)"
FIX_INDEX = ("restore model.safetensors.index.json from the checkpoint's source (download it again), or delete it: "
             "the shards' own headers are then read")


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """``path`` as a local checkpoint directory with its ``config.json`` (a :class:`CheckpointError` otherwise)."""
    root = Path(path).expanduser()
    if not root.is_dir() or not (root / "config.json").is_file():
        raise CheckpointError(
            f"no checkpoint at {root} (a directory with config.json and *.safetensors weights is needed); "
            "phaselens never downloads: fetch the weights first, then phaselens.load('hf:/that/directory')."
        )
    return root


def header(shard: Path) -> dict:
    """The JSON header of a safetensors file: ``{name: {"dtype", "shape", "data_offsets"}}``."""
    if not shard.is_file():  # a named pipe or a device is never opened
        raise CheckpointError(f"{shard} is not a regular file; put the checkpoint's safetensors shards there.")
    try:
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as err:
        raise CheckpointError(f"{shard} is not a readable safetensors file ({err}); {FIX_SHARD}.") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{shard}'s header is a JSON {type(header).__name__}, not an object; {FIX_SHARD}.")
    return header


def shard_map(root: Path) -> dict[str, Path]:
    """``{original tensor name: shard file}`` from ``model.safetensors.index.json`` (or the shards' headers).

    Raises:
        CheckpointError: a damaged index, a shard it names that is missing, no weights at all.
        UnsupportedModelError: pickled weights only (unpickling can run arbitrary code).
    """
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, fix=FIX_INDEX + ".").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object; the index file is damaged: {FIX_INDEX}.")
        bad = [f"{k!r}: {f!r}" for k, f in weight_map.items()
               if not isinstance(f, str) or not f or Path(f).is_absolute() or ".." in Path(f).parts]
        if bad:
            raise CheckpointError(f"{index} maps tensors to {bad[:3]}, which are not shard file names inside {root}; "
                                  f"the index file is damaged: {FIX_INDEX}.")
        files = {name: root / f for name, f in weight_map.items()}
        lost = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if lost:
            raise CheckpointError(
                f"{root} lacks shards {lost[:5]}{' (and more)' if len(lost) > 5 else ''} named in "
                "model.safetensors.index.json; the download is incomplete. Download the missing shards into "
                f"{root} (e.g. `huggingface-cli download REPO --local-dir {root}` fetches only what is missing); "
                "phaselens never downloads."
            )
        return files
    shards = sorted(root.glob("*.safetensors"))
    pickled = sorted(p.name for pat in PICKLED for p in root.glob(pat)) if not shards else []
    if pickled:
        raise UnsupportedModelError(
            f"{root} has no *.safetensors weights, only pickled ones ({', '.join(pickled[:3])}): phaselens loads "
            "safetensors only, because unpickling can run arbitrary code. Convert the weights once in a trusted "
            "environment (e.g. model.save_pretrained(dir, safe_serialization=True)) or download the safetensors "
            "release."
        )
    if not shards:
        raise CheckpointError(f"{root} has no *.safetensors weights; download the checkpoint's shards there.")
    return {k: shard for shard in shards for k in header(shard) if k != "__metadata__"}
