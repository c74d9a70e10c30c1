"""The dtype computations run in: at least fp32, as DeepSeek-V4 (and V4.1) normalise, softmax and mix
low-precision inputs in fp32."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to at least fp32: bf16 / fp16 / fp32 -> fp32, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name metadata and reprs use (JSON has no torch types)."""
    return str(dtype).removeprefix("torch.")
