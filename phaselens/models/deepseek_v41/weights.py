"""Reading a V4.1 checkpoint's sharded safetensors into :class:`DeepSeekV41`, dequantizing as it goes.

Checkpoint names are the reference's (``embed.weight``, ``layers.{l}.attn.wq_a.weight`` with its
``layers.{l}.attn.wq_a.scale``, ``layers.{l}.ffn.experts.{e}.w1.weight``, ...). transformers-style variants
are accepted too (a ``model.`` prefix, ``self_attn``/``mlp``, ``weight_scale_inv``, ``e_score_correction_bias``).
Draft-layer (``mtp.*``) and vision tensors are skipped: the text model does not use them.

A weight stored as FP8 (``float8_e4m3fn``) with a ``.scale`` is dequantized with the config's weight blocks;
a weight stored as packed bytes (``int8`` / ``uint8`` / ``float4_e2m1fn_x2``) with a ``.scale`` is FP4 (one
scale per row and 32 inputs); anything else is copied. Values are then cast to the parameter's dtype (FP8 and
FP4 values times power-of-two scales are exact in bf16).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor, nn

from phaselens.core.errors import CheckpointError
from phaselens.models.deepseek_v41.quant import dequant_fp4_rows, dequant_fp8_blocks

SKIP_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")
_EXPERT = re.compile(r"^blocks\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def normalize(name: str) -> str:
    """A checkpoint tensor name in the reference's spelling."""
    if name.startswith("model."):
        name = name[len("model.") :]
    parts = name.split(".")
    rename = {"self_attn": "attn", "mlp": "ffn", "weight_scale_inv": "scale", "e_score_correction_bias": "bias"}
    return ".".join(rename.get(p, p) for p in parts)


def shard_map(root: Path) -> dict[str, Path]:
    """``{original tensor name: shard file}`` from ``model.safetensors.index.json`` (or the lone shard)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'; the index file is damaged.")
        files = {name: root / f for name, f in weight_map.items()}
        lost = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if lost:
            raise CheckpointError(f"{root} lacks shards {lost} named in model.safetensors.index.json.")
        return files
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{root} has no *.safetensors weights.")
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: shard for k in f.keys()})
    return out


def _target(name: str) -> str:
    """Checkpoint name (normalized) -> this model's parameter name."""
    return "blocks." + name[len("layers.") :] if name.startswith("layers.") else name


def dequantize(weight: Tensor, scale: Tensor | None, block: tuple[int, int], name: str) -> Tensor:
    """One checkpoint tensor as fp32 (or unchanged float dtype when it carries no scale)."""
    if scale is None:
        if weight.dtype == torch.float8_e4m3fn or weight.element_size() == 1:
            raise CheckpointError(f"{name} is stored as {weight.dtype} without a scale tensor; the checkpoint is incomplete.")
        return weight
    if weight.dtype == torch.float8_e4m3fn:
        return dequant_fp8_blocks(weight, scale, block)
    if weight.element_size() == 1:
        return dequant_fp4_rows(weight, scale)
    raise CheckpointError(f"{name} has a scale but dtype {weight.dtype}; expected FP8 or packed FP4.")


def load_weights(model: nn.Module, root: Path, *, skip_engram: bool, n_layers: int | None = None) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``root`` (raises on missing or extra tensors).

    ``n_layers``: tensors of backbone layers at or beyond it are skipped (a truncated model).
    """
    from safetensors import safe_open

    files = shard_map(root)
    names = {normalize(k): k for k in files}
    block = tuple(model.config.weight_block_size)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    unused: list[str] = []
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, object] = {}

        def get(original: str) -> Tensor:
            shard = files[original]
            if shard not in handles:
                handles[shard] = stack.enter_context(safe_open(str(shard), framework="pt"))
            return handles[shard].get_tensor(original)

        for name in sorted(names):
            if name.endswith(".scale") and name[: -len("scale")] + "weight" in names:
                continue  # consumed with its weight
            if name.startswith(SKIP_PREFIXES) or (skip_engram and ".engram." in name):
                continue
            layer = re.match(r"^layers\.(\d+)\.", name)
            if layer and n_layers is not None and int(layer[1]) >= n_layers:
                continue
            target = _target(name)
            expert = _EXPERT.match(target)
            key = f"blocks.{expert[1]}.ffn.experts.{expert[3]}" if expert else target
            if key not in params:
                unused.append(name)
                continue
            scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
            scale = get(names[scale_name]) if scale_name in names else None
            value = dequantize(get(names[name]), scale, block, name)
            param = params[key]
            dest = param[int(expert[2])] if expert else param
            if tuple(value.shape) != tuple(dest.shape):
                raise CheckpointError(
                    f"{name} has shape {tuple(value.shape)} but the config implies {tuple(dest.shape)}; "
                    "config.json and the weights disagree."
                )
            dest.copy_(value.to(device=dest.device, dtype=dest.dtype))
            filled.add(f"{key}[{expert[2]}]" if expert else key)
    if unused:
        raise CheckpointError(
            f"{len(unused)} checkpoint tensors have no place in the text model, e.g. {unused[:5]}; "
            "the checkpoint does not match its config.json."
        )
    missing = [k for k in _expected(params) if k not in filled]
    if missing:
        raise CheckpointError(
            f"{len(missing)} parameters are missing from the checkpoint, e.g. {missing[:5]}; it is incomplete."
        )


def _expected(params: dict[str, nn.Parameter]) -> Iterator[str]:
    for key, p in params.items():
        if re.match(r"^blocks\.\d+\.ffn\.experts\.w[123]$", key):
            yield from (f"{key}[{e}]" for e in range(p.shape[0]))
        else:
            yield key
