"""Checksums of safetensors payloads: every safetensors file phaselens writes records, in its own header, the
sha256 of each tensor it holds, and every reader checks them before a weight is used.

safetensors checks that a file's header parses and that its data exactly covers the file, but not the data
itself: a file whose tail was zeroed (a disk or copy fault) keeps its size and loads. The header's
``phaselens.sha256`` entry (a JSON object, tensor name -> sha256 of its dtype, shape and bytes) closes that
gap; a mismatch is a :class:`~phaselens.errors.CheckpointError` naming the file and the damaged tensors.
A file written before checksums existed has no entry and is read as before.

Each digest is of the tensor, not of the file's layout, so it is the same from torch and numpy and does not
depend on how a safetensors version orders the data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from phaselens.errors import CheckpointError

KEY = "phaselens.sha256"


def listed(names: list[str], shown: int = 4) -> str:
    """``names`` for a message: the first ``shown``, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{', '.join(names[:shown])}{more}"


def _raw(t: Any) -> tuple[str, tuple[int, ...], Any]:
    """``(dtype name, shape, bytes)`` of a torch tensor or a numpy array, the bytes as a flat uint8 view."""
    if isinstance(t, np.ndarray):
        a = np.ascontiguousarray(t)  # (a 0-d array comes back 1-d: the shape is the original's)
        return str(a.dtype), tuple(t.shape), a.reshape(-1).view(np.uint8)
    import torch

    x = t.detach().to("cpu").contiguous()
    flat = x.reshape(-1)
    return str(x.dtype).removeprefix("torch."), tuple(x.shape), flat.view(torch.uint8).numpy()


def tensor_sha256(t: Any) -> str:
    """The sha256 of one tensor: its dtype name, its shape and its bytes (C order)."""
    dtype, shape, data = _raw(t)
    h = hashlib.sha256(f"{dtype}{list(shape)}".encode())
    h.update(memoryview(data))
    return h.hexdigest()


def stamped(metadata: Mapping[str, str], tensors: Mapping[str, Any]) -> dict[str, str]:
    """``metadata`` plus the checksum entry of ``tensors``: what a writer passes to safetensors' ``save_file``."""
    return {**metadata, KEY: json.dumps({name: tensor_sha256(t) for name, t in sorted(tensors.items())})}


def recorded(path: str | os.PathLike, metadata: Mapping[str, str], *, fix: str) -> dict[str, str] | None:
    """The digests a file's header records (``None``: written before checksums); a damaged entry raises."""
    if KEY not in metadata:
        return None
    try:
        digests = json.loads(metadata[KEY])
    except (ValueError, RecursionError):
        digests = None
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise CheckpointError(f"{path} is damaged: its header's checksum entry ({KEY}) is not a JSON object of "
                              f"sha256 digests; {fix}")
    return digests


def verify(path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str], *, fix: str) -> None:
    """Check ``tensors`` (all of the file at ``path``, as read) against the digests its header records.

    Raises:
        CheckpointError: naming ``path`` and the tensors whose bytes, dtype or shape changed (or that are
            missing or extra), ending with ``fix``.
    """
    digests = recorded(path, metadata, fix=fix)
    if digests is None:
        return
    _compare(path, digests, {name: tensor_sha256(t) for name, t in tensors.items()}, fix)


def verify_file(path: str | os.PathLike, *, fix: str) -> None:
    """Check every tensor of the safetensors file ``path`` against its recorded digests, one tensor at a time
    (memory: the largest tensor), for readers that take slices of a file instead of all of it."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        digests = recorded(path, f.metadata() or {}, fix=fix)
        if digests is None:
            return
        _compare(path, digests, {name: tensor_sha256(f.get_tensor(name)) for name in f.keys()}, fix)


def _compare(path: str | os.PathLike, digests: Mapping[str, str], now: Mapping[str, str], fix: str) -> None:
    bad = sorted(n for n in set(digests) & set(now) if digests[n] != now[n])
    missing, extra = sorted(set(digests) - set(now)), sorted(set(now) - set(digests))
    if not (bad or missing or extra):
        return
    parts = [f"{len(names)} tensor(s) {what} ({listed(names)})" for what, names in (
        ("no longer match their sha256", bad), ("are missing", missing), ("were added", extra)) if names]
    raise CheckpointError(f"{Path(path)} is damaged: {'; '.join(parts)} since phaselens wrote it (its header "
                          f"records each tensor's sha256); {fix}")
