"""``phaselens.load``: one entry point for checkpoints, the zoo, and local transformers models."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from phaselens.core.errors import CheckpointError


def load(source: str | os.PathLike, *, device: str = "cpu", **kwargs: Any) -> Any:
    """Load a model.

    Args:
        source: ``"zoo:NAME"`` (a model shipped in the package; a bare zoo name works too), ``"hf:PATH"``
            (a local checkpoint directory, never downloaded: DeepSeek-V4 through transformers, or
            DeepSeek-V4.1, ``model_type`` ``deepseek_v41``, through phaselens' own implementation), or a
            directory written by ``model.save``.
        device: where to put the model.
        kwargs: only for ``hf:`` (V4: ``dtype``, ``device_map``, ``layer_types``, ``index_topk``, ``chunk``, ...;
            V4.1: ``dtype``, ``quantize``, ``index_topk``, ``analysis_stride``, ``engram``).

    Example:
        >>> model = phaselens.load("zoo:w8s4")  # doctest: +SKIP
    """
    from phaselens.models.compressed.io import resolve_device

    resolve_device(device)  # a GPU this machine lacks is an InputError here, not an AssertionError in torch
    text = str(source)
    if not text.startswith(("zoo:", "hf:")) and not Path(text).exists():
        from phaselens.models.zoo import list_models

        # a bare name with no path separator is meant as a zoo name: a ZooError then lists the names
        if text in list_models() or not any(sep in text for sep in ("/", "\\", ".")):
            text = f"zoo:{text}"
    if kwargs and not text.startswith("hf:"):
        from phaselens.core.errors import InputError

        raise InputError(
            f"load({text!r}) takes no {sorted(kwargs)}: keyword arguments apply to 'hf:PATH' sources only; "
            "convert a phaselens model afterwards (e.g. model.double(), model.to('cuda'))."
        )
    if text.startswith("zoo:"):
        from phaselens.models.zoo import load_zoo_model

        return load_zoo_model(text[4:], device=device)
    if text.startswith("hf:"):
        from phaselens.models.deepseek_v41 import is_v41_checkpoint, load_v41

        if is_v41_checkpoint(text[3:]):  # transformers has no deepseek_v41: phaselens' own implementation
            return load_v41(text[3:], device=device, **kwargs)
        from phaselens.models.deepseek_v4 import load_hf

        return load_hf(text[3:], device=device, **kwargs)
    path = Path(text)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; pass a directory written by model.save(path), or 'zoo:NAME'.")
    from phaselens.models.compressed.loader import load_model

    return load_model(path, device=device)
