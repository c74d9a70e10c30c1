"""transformers' packed FP8 / FP4 modules, as the adapter meets them on CUDA.

On CUDA, ``from_pretrained`` of a released DeepSeek-V4 keeps its weights as stored:
``transformers.integrations.finegrained_fp8`` puts ``FP8Linear`` / ``FP8GroupedLinear`` (E4M3 ``weight`` with
block scales ``weight_scale_inv``) and ``FP8Experts`` (FP4 codes in ``int8``, per-row scales) in place, whose
kernels multiply the packed weights directly. Such a ``weight`` holds codes, not numbers: the adapter must never
use it as a dense tensor. Where it needs a projection's numbers (``numerics="reference"`` recomputes the
compressors' ``kv_proj`` / ``gate_proj`` in fp32) it asks :func:`dense_weight`, which decodes packed weights
(:func:`phaselens.models.parts.packed.dequantize`) and passes dense ones through.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from phaselens.models.parts.packed import FP4_ROWS, PackedFormat, as_bytes, dequantize


def is_packed(module: nn.Module) -> bool:
    """Whether ``module.weight`` holds FP8 / FP4 codes with scales (transformers' finegrained-fp8 modules)."""
    weight = getattr(module, "weight", None)
    return (weight is not None and getattr(module, "weight_scale_inv", None) is not None
            and weight.element_size() == 1)


def weight_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of ``module``'s products: its weight's, or ``default`` (the model dtype) when packed."""
    return default if is_packed(module) else module.weight.dtype


def dense_weight(module: nn.Module, dtype: torch.dtype) -> Tensor:
    """``module``'s weight ``[out, in]`` as numbers in ``dtype`` (decoded when packed)."""
    if not is_packed(module):
        return module.weight.to(dtype)
    weight, scale = module.weight, module.weight_scale_inv
    if weight.dtype == torch.float8_e4m3fn:
        block = getattr(module, "block_size", None)
        if block is None:  # one scale for the whole tensor
            return (weight.to(torch.float32) * scale.float()).to(dtype)
        return dequantize(as_bytes(weight), as_bytes(scale), PackedFormat("fp8", tuple(block)), dtype)
    return dequantize(as_bytes(weight), as_bytes(scale), FP4_ROWS, dtype)


def expert_weight(module: nn.Module, name: str, expert: int, dtype: torch.dtype) -> Tensor:
    """Expert ``expert``'s ``name`` matrix (``gate_up_proj`` / ``down_proj``) of an experts module as numbers in
    ``dtype``: decoded when ``FP8Experts`` keeps it packed (FP4 codes or FP8 blocks with ``{name}_scale_inv``)."""
    weight = getattr(module, name)
    scale = getattr(module, f"{name}_scale_inv", None)
    if scale is None or weight.element_size() != 1:
        return weight[expert].to(dtype)
    if weight.dtype == torch.float8_e4m3fn:
        fmt = PackedFormat("fp8", tuple(module.block_size))
    else:
        fmt = FP4_ROWS
    return dequantize(as_bytes(weight[expert]), as_bytes(scale[expert]), fmt, dtype)
