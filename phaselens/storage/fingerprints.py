"""Fingerprints: a sha256 over everything that determines a resumable computation's numbers.

A result journal stores the fingerprint of what produced it, and a resume with another fingerprint is refused,
so results of two models (or calibrations, tasks, settings) are never mixed. :func:`model_fingerprint`
covers every parameter and buffer (name, shape, dtype and content), the config, the default task and the
adapter's ``analysis_metadata``. Up to ``full_limit`` bytes of tensors (1 GiB) every byte is hashed: 1.7 s
for 1 GiB on a shared 2-core CPU, as fast as a bare sha256 of the same bytes
(``benchmarks/bench_fingerprint.py --mb 1024 --tensors 256``). Above it, each tensor contributes a fixed
strided sample of ``sample`` elements (4096) plus its name, dtype and shape (0.3 ms per tensor), so a
multi-GB model fingerprints in seconds and any edit of a whole tensor or layer (negated, re-scaled, another
checkpoint) changes it; an edit confined to unsampled elements of a huge tensor does not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import numpy as np
import torch

from phaselens.contract.protocol import OBSERVED_METADATA

FULL_LIMIT = 2**30  # bytes of parameters hashed in full
SAMPLE = 4096  # elements per tensor above the limit


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array (no copy for a contiguous CPU tensor; hashlib reads its buffer)."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def _feed_tensor(h: Any, t: torch.Tensor, sample: int | None) -> None:
    h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
    if t.is_meta:  # offloaded weights (device_map): only the shape is known here
        h.update(b"meta")
        return
    if sample is not None and t.numel() > sample:
        step = math.ceil(t.numel() / sample)
        h.update(f"every{step}".encode())
        t = t.detach().reshape(-1)[::step]
    h.update(_tensor_bytes(t))


def feed(h: Any, obj: Any) -> None:
    """Add a canonical encoding of ``obj`` to the hash ``h``: tensors and arrays by dtype, shape and bytes;
    dicts by sorted key; dataclasses and objects with ``to_dict()`` by type name and fields; other values by
    ``repr`` (scalars round-trip exactly)."""
    if isinstance(obj, torch.Tensor):
        _feed_tensor(h, obj, None)
    elif isinstance(obj, np.ndarray):
        if obj.dtype == object:
            feed(h, obj.tolist())
        else:
            h.update(f"A{obj.dtype.str}{obj.shape}".encode())
            h.update(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k in sorted(obj, key=str):
            feed(h, str(k))
            feed(h, obj[k])
    elif isinstance(obj, list | tuple):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            feed(h, v)
    elif isinstance(obj, str):
        data = obj.encode()
        h.update(f"S{len(data)}:".encode() + data)
    elif obj is None or isinstance(obj, bool | int | float | np.generic):
        h.update(f"V{obj!r}".encode())
    elif _is_frame(obj):
        feed(h, {str(c): obj[c].to_numpy() for c in obj.columns})
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        feed(h, type(obj).__qualname__)
        feed(h, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    elif callable(getattr(obj, "to_dict", None)):
        feed(h, type(obj).__qualname__)
        feed(h, obj.to_dict())
    else:
        feed(h, repr(obj))


def _is_frame(obj: Any) -> bool:
    import pandas as pd

    return isinstance(obj, pd.DataFrame)


def fingerprint(**parts: Any) -> str:
    """The sha256 (hex) of named parts, e.g. ``fingerprint(model=model_fingerprint(m), task=task, seed=0)``."""
    h = hashlib.sha256()
    feed(h, parts)
    return h.hexdigest()


def model_fingerprint(model: Any, *, full_limit: int = FULL_LIMIT, sample: int = SAMPLE) -> str:
    """A fingerprint of a model: every parameter and buffer, the config, the default task and the
    adapter's ``analysis_metadata`` (e.g. a phase ensemble's shifts). See the module docstring for sizes."""
    ident = model.identity()
    module = ident.module
    h = hashlib.sha256()
    feed(h, ident.kind)
    feed(h, ident.config)
    task = model.default_task
    feed(h, task.to_dict() if hasattr(task, "to_dict") else None)
    md = model.analysis_metadata
    feed(h, {k: v for k, v in md.items() if k not in OBSERVED_METADATA})  # what the model is, not what it saw
    if module is not None:
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        per = None if total <= full_limit else sample
        feed(h, f"tensors{len(tensors)}/{'full' if per is None else f'sample{per}'}")
        with torch.no_grad():
            for name, t in tensors:
                feed(h, name)
                _feed_tensor(h, t, per)
    return h.hexdigest()


def analysis_fingerprint(model: Any, **parts: Any) -> str:
    """:func:`model_fingerprint` combined with the other inputs of an analysis (task, items, calibration,
    settings), e.g. ``analysis_fingerprint(m, task=task, items=batch.tokens, calibration=cal.z, method="mean")``."""
    return fingerprint(model=model_fingerprint(model), **parts)

