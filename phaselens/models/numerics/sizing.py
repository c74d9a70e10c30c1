"""Bytes, for memory estimates: of one element of a dtype, and of what a module holds."""

from __future__ import annotations

import torch
from torch import nn


def item_size(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype`` (``torch.float8_e4m3fn``: 1, ``torch.bfloat16``: 2, ...)."""
    return torch.empty((), dtype=dtype).element_size()


def held_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` as held (packed bytes as bytes; a meta-device module
    counts the same as a materialised one)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
