"""Model replicas on groups of GPUs: which GPUs a torchrun rank owns, and a ``device_map`` over them.

A model too large for one GPU (DeepSeek-V4-Flash, DeepSeek-V4.1-Flash) runs as one *replica* per rank, each spread over
``gpus_per_replica`` GPUs of its node. Local rank ``r`` owns GPUs ``r*k .. r*k+k-1`` (``k`` =
``gpus_per_replica``), so ``torchrun --nproc-per-node G/k`` uses all ``G`` GPUs of a node once::

    gpus = replica_gpus(2)                               # LOCAL_RANK 1 of 4 on an 8-GPU node -> [2, 3]
    meta = ...                                           # the model on the meta device (shapes only)
    model = phaselens.load("hf:/data/DeepSeek-V4-Flash", dtype=torch.bfloat16,
                           device_map=replica_device_map(meta, gpus))

:func:`replica_device_map` cuts the model's decoder layers (its largest ``ModuleList``) and the modules
around them into ``k`` contiguous runs of about equal bytes, in execution order: embeddings on the first
GPU, final norm and unembedding on the last.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from phaselens.errors import InputError


def local_rank() -> int:
    """``LOCAL_RANK`` from torchrun's environment (0 when absent)."""
    text = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(text)
    except ValueError:
        raise InputError(f"LOCAL_RANK={text!r} is not an integer; it is set by torchrun, leave it alone.") from None


def replica_gpus(gpus_per_replica: int = 1, *, rank: int | None = None, n_gpus: int | None = None) -> list[int]:
    """The GPU indices of this rank's replica: ``[r*k, ..., r*k + k - 1]`` for local rank ``r``.

    Args:
        gpus_per_replica: ``k``, GPUs one model copy needs.
        rank: the local rank (default ``LOCAL_RANK``); n_gpus: GPUs visible on this node (default
            ``torch.cuda.device_count()``).

    Raises:
        InputError: the group would run past the node's GPUs (too many processes per node for ``k``).
    """
    if isinstance(gpus_per_replica, bool) or not isinstance(gpus_per_replica, int) or gpus_per_replica < 1:
        raise InputError(f"gpus_per_replica must be an integer >= 1, got {gpus_per_replica!r}.")
    r = local_rank() if rank is None else int(rank)
    if n_gpus is None:
        import torch

        n_gpus = torch.cuda.device_count()
    k = gpus_per_replica
    if r < 0 or (r + 1) * k > n_gpus:
        raise InputError(
            f"local rank {r} with {k} GPU(s) per replica needs GPUs {r * k}..{(r + 1) * k - 1}, but this node has "
            f"{n_gpus}; run at most {n_gpus // k} process(es) per node (torchrun --nproc-per-node {max(1, n_gpus // k)})."
        )
    return list(range(r * k, (r + 1) * k))


def _bytes(module: Any, recurse: bool = True) -> int:
    """Bytes a device map puts on GPUs: every tensor except those of modules marked ``host_resident`` (kept in
    host memory by the loader's device maps: DeepSeek-V4.1's Engram tables)."""
    mods = module.modules() if recurse else [module]
    seen: dict[int, int] = {}
    for m in mods:
        if not getattr(type(m), "host_resident", False):
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _units(model: Any) -> list[tuple[str, int]]:
    """``(name, bytes)`` of the pieces a device map places, in execution order: every decoder layer, and
    around them the modules and loose tensors of the modules that lead to the layer list (GPU bytes:
    host-resident tables are not counted, see :func:`_bytes`)."""
    import torch

    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n]
    if not lists:
        raise InputError(f"{type(model).__name__} has no list of layers (a torch.nn.ModuleList) to spread over GPUs.")
    path, layers = max(lists, key=lambda nm: _bytes(nm[1]))
    out: list[tuple[str, int]] = []

    def walk(module: Any, prefix: str) -> None:
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out.append((prefix + name, t.numel() * t.element_size()))
        for name, child in module.named_children():
            full = prefix + name
            if full == path:
                out.extend((f"{full}.{i}", _bytes(layer)) for i, layer in enumerate(layers))
            elif path.startswith(full + "."):
                walk(child, full + ".")
            else:
                out.append((full, _bytes(child)))

    walk(model, "")
    return out


def replica_device_map(model: Any, gpus: Sequence[int]) -> dict[str, int]:
    """A ``device_map`` (module or tensor name -> GPU index) that spreads ``model`` over ``gpus``.

    ``model`` may live on the meta device (only names, shapes and dtypes are read); a phaselens adapter is
    unwrapped to the transformers model it holds. The pieces (decoder layers and the modules around them)
    keep their execution order and are cut into ``len(gpus)`` contiguous runs of about equal bytes: a piece
    goes to run ``floor(k * midpoint / total)`` where ``midpoint`` is the bytes before it plus half its own.
    Pass the result as ``from_pretrained(device_map=...)`` (``phaselens.load("hf:...", device_map=...)``).
    """
    gpus = [int(g) for g in gpus]
    if not gpus or len(set(gpus)) != len(gpus):
        raise InputError(f"gpus must be distinct GPU indices, at least one; got {list(gpus)!r}.")
    from phaselens.contract.protocol import module_of

    module = module_of(model)
    if module is None:
        raise InputError(f"{type(model).__name__} holds no torch module to spread over GPUs.")
    units = _units(module)
    return {name: gpus[part] for (name, _), part in zip(units, split_units([b for _, b in units], len(gpus)))}


def split_units(sizes: Sequence[int], k: int) -> list[int]:
    """The run (``0..k-1``) of each piece of ``sizes`` bytes, in order: ``floor(k * midpoint / total)``."""
    total = sum(sizes) or 1
    out, before = [], 0
    for size in sizes:
        out.append(min(k - 1, int(k * (before + size / 2) / total)))
        before += size
    return out


def rank_device(gpus_per_replica: int = 1) -> str:
    """``"cuda:G"`` (the first GPU of this rank's replica) when CUDA is available, else ``"cpu"``."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{replica_gpus(gpus_per_replica)[0]}"


def meta_model(path: str | os.PathLike) -> Any:
    """The transformers model of the local checkpoint directory ``path`` on the meta device (no weights
    read, no memory): what :func:`replica_device_map` needs before loading. For any source (DeepSeek-V4.1
    included) use :func:`phaselens.models.sources.meta_model`."""
    import warnings
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise InputError(f"no config.json in {root}; pass a local transformers checkpoint directory.")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
