"""``device_map`` for DeepSeek-V4.1, with transformers/accelerate conventions.

* ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"``: accelerate's
  ``infer_auto_device_map`` over the visible GPUs and the CPU, never splitting a layer (``Block``), with
  ``max_memory`` (``{0: "70GiB", "cpu": "200GiB"}``) as its budget; ``"balanced"`` spreads evenly
  (``get_balanced_memory``), as transformers does for ``"auto"``.
* a dict ``{module or parameter name: device}`` (``""`` is the whole model), e.g. from
  :func:`phaselens.parallel.replicas.replica_device_map`; devices are GPU indices, ``"cuda:N"``, ``"cpu"`` or
  ``torch.device``. Every tensor needs a device, the longest matching name decides.
* a single device (``"cpu"``, ``"cuda:1"``, ``0``).

The model is built on the meta device, each tensor is allocated on its device (packed tensors at their packed
size), filled from the shards, then accelerate's ``dispatch_model`` adds the hooks that move each layer's
inputs to its device. As in accelerate, modules mapped to ``"cpu"`` next to GPUs are *offloaded*: they live in
CPU memory and run on the first GPU. Anything wrong raises :class:`~phaselens.errors.DeviceMapError` naming the
fix; ``"disk"`` is refused (the packed model is what fits, not a disk copy of it).

**Engram's tables stay in host memory.** Every map keeps the modules marked ``host_resident`` (the
:class:`~phaselens.models.deepseek_v41.engram.EngramTable` of each Engram layer: 98 GB at the released size)
on the CPU, unless the map names the table itself (``"blocks.1.engram.embed": 3``). accelerate never sees them:
they are left out of ``"auto"``'s sizing and hidden while its hooks are attached, so neither the hooks nor
``infer_auto_device_map`` move or offload them. A lookup gathers its rows on the host and sends only those rows
to the layer's GPU (``rows_per_token x row_bytes`` per token and Engram layer:
:func:`~phaselens.models.deepseek_v41.engram.engram_traffic`); the rest of the layer sits on its GPU as placed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from phaselens.errors import DeviceMapError
from phaselens.models.numerics.sizing import held_bytes

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
NO_SPLIT = ["Block"]


def _device(value: Any, key: str) -> str | int:
    """A device map value checked against this machine: an int GPU index or ``"cpu"``."""
    n = torch.cuda.device_count()
    if isinstance(value, torch.device):
        value = str(value)
    if isinstance(value, str) and value == "disk":
        raise DeviceMapError(
            f"device_map[{key!r}] = 'disk': phaselens does not offload DeepSeek-V4.1 to disk. Use GPUs and CPU "
            "memory (device_map='auto' with max_memory), a node with more GPU memory (see `phaselens plan`), or "
            "n_layers= for a truncated model.")
    if isinstance(value, str) and value == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", value) if isinstance(value, str) else None
    value = value if m is None else int(m[1] or 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DeviceMapError(f"device_map[{key!r}] = {value!r} is not a device; use a GPU index (0), 'cuda:0' "
                             "or 'cpu'.")
    if value >= n:
        raise DeviceMapError(
            f"device_map[{key!r}] = GPU {value}, but this machine has {n} CUDA device(s); use GPUs "
            f"0..{n - 1}, 'cpu', or device_map='auto'." if n else
            f"device_map[{key!r}] = GPU {value}, but this machine has no CUDA device; use 'cpu' or "
            "device_map='auto'.")
    return value


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]


def _owner(name: str, keys: list[str]) -> str | None:
    """The longest key that is ``name`` or a module prefix of it (``""`` matches everything)."""
    return max((key for key in keys if key == "" or _under(name, [key])), key=len, default=None)


def host_modules(model: nn.Module) -> list[str]:
    """Names of the modules device maps keep in host memory (``host_resident``: Engram's tables)."""
    return [n for n, m in model.named_modules() if getattr(type(m), "host_resident", False)]


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@contextmanager
def hidden_host_tensors(model: nn.Module) -> Iterator[list[str]]:
    """Detach the tensors of :func:`host_modules` while accelerate sizes or hooks the rest (put back after)."""
    names = host_modules(model)
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in map(model.get_submodule, names)]
    for m, _, _ in saved:
        m._parameters.clear()
        m._buffers.clear()
    try:
        yield names
    finally:
        for m, params, buffers in saved:
            m._parameters.update(params)
            m._buffers.update(buffers)


def resolve(model: nn.Module, device_map: Any, *, max_memory: Any = None) -> dict[str, str | int]:
    """A checked ``{name: device}`` for ``model`` (on the meta device) from any accepted ``device_map``, with
    Engram's tables in host memory (``"cpu"``) unless the map names them."""
    placed = _resolve(model, device_map, max_memory)
    hosts = {n: "cpu" for n in host_modules(model) if not any(_under(k, [n]) for k in placed if k)}
    return {**placed, **hosts}


def _resolve(model: nn.Module, device_map: Any, max_memory: Any) -> dict[str, str | int]:
    if isinstance(device_map, str) and device_map in STRATEGIES:
        return _infer(model, device_map, max_memory)
    if max_memory is not None:
        raise DeviceMapError("max_memory applies to device_map='auto' / 'balanced' / 'sequential'; with an explicit "
                             "map, drop max_memory or pass device_map='auto'.")
    if isinstance(device_map, str | int | torch.device) and not isinstance(device_map, bool):
        return {"": _device(device_map, "")}
    if not isinstance(device_map, dict) or not device_map:
        raise DeviceMapError(
            f"device_map must be 'auto', 'balanced', 'sequential', a device ('cpu', 'cuda:0', 0) or a non-empty "
            f"dict {{module name: device}}, got {device_map!r}.")
    placed = {str(k): _device(v, str(k)) for k, v in device_map.items()}
    modules = {n for n, _ in model.named_modules()}
    tensors = set(_names(model))
    bad = [k for k in placed if k not in modules and k not in tensors]
    if bad:
        tops = [n for n, _ in model.named_children()]
        blocks = getattr(model, "blocks", None)
        example = [t for t in tops if t != "blocks"] + ([f"blocks.0 .. blocks.{len(blocks) - 1}"] if blocks else [])
        raise DeviceMapError(f"device_map names {bad[:3]}, which are not modules or tensors of this model; use "
                             f"'' (everything), {', '.join(example)}, or any submodule name.")
    keys = list(placed)
    loose = [n for n in _names(model) if _owner(n, keys) is None]
    if loose:
        raise DeviceMapError(f"device_map gives no device to {len(loose)} tensors, e.g. {loose[:3]}; add their "
                             "modules (or '' for everything else) to the map.")
    return placed


def _infer(model: nn.Module, strategy: str, max_memory: Any) -> dict[str, str | int]:
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map

    try:
        with hidden_host_tensors(model):  # host tables: not the GPUs' to hold
            if strategy in ("auto", "balanced", "balanced_low_0") and torch.cuda.device_count() > 1:
                budget = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=NO_SPLIT,
                                             low_zero=strategy == "balanced_low_0")
            else:
                budget = get_max_memory(max_memory)
            placed = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=NO_SPLIT)
            need = held_bytes(model)
    except (ValueError, TypeError, KeyError) as err:
        raise DeviceMapError(f"max_memory={max_memory!r} cannot be used ({err}); give bytes or strings such as "
                             "{0: '70GiB', 'cpu': '200GiB'}.") from None
    if "disk" in placed.values():
        room = ", ".join(f"{k}: {v / 2**30:.1f} GiB" for k, v in budget.items())
        raise DeviceMapError(
            f"the model ({need / 2**30:.1f} GiB of weights as loaded) does not fit in "
            f"{room}: give more max_memory, use more GPUs (`phaselens plan DIR --gpu-memory ...` "
            "says how many), or load fewer layers (n_layers=).")
    return {k: _device(v, k) for k, v in placed.items()}


def materialize(model: nn.Module, placed: dict[str, str | int]) -> None:
    """Allocate every (meta) parameter and buffer on its device, uninitialised. Tables placed in host memory
    gather through the host path (``staged``) even on a CPU-only machine, so a CPU run checks the code a GPU
    run takes."""
    keys = list(placed)
    for name in host_modules(model):
        model.get_submodule(name).staged = placed[_owner(name + ".weight", keys)] == "cpu"  # type: ignore[index]
    for module_name, module in list(model.named_modules()):
        prefix = f"{module_name}." if module_name else ""
        for kind in ("_parameters", "_buffers"):
            store = getattr(module, kind)
            for name, t in list(store.items()):
                if t is None:
                    continue
                dev = placed[_owner(prefix + name, keys)]  # type: ignore[index]
                empty = torch.empty_like(t, device=torch.device("cuda", dev) if isinstance(dev, int) else dev)
                store[name] = nn.Parameter(empty, requires_grad=t.requires_grad) if kind == "_parameters" else empty


def dispatch(model: nn.Module, placed: dict[str, str | int]) -> nn.Module:
    """accelerate's ``dispatch_model``: hooks that move each placed module's inputs to its device (always
    attached, so one code path serves one device and many). Sets ``model.hf_device_map`` (the whole map).

    Engram's tables are hidden from accelerate meanwhile: its hooks would otherwise copy a table to its layer's
    GPU (or offload it and copy it back on every call); they stay where :func:`materialize` put them."""
    from accelerate import dispatch_model

    with hidden_host_tensors(model) as hosts:
        out = dispatch_model(model, device_map={k: v for k, v in placed.items() if not _under(k, hosts)},
                             force_hooks=True)
    model.hf_device_map = dict(placed)
    return out


def input_device(model: nn.Module) -> torch.device:
    """Where the token ids go: the embedding's execution device (its weights may be offloaded)."""
    hook = getattr(model.embed, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
    return model.embed.weight.device
