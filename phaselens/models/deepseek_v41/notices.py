"""Warnings the DeepSeek-V4.1 model emits about results that may not mean what they seem (its index-top-k
warning is every kind's :class:`phaselens.models.parts.index_topk.IndexTopKWarning`)."""

from __future__ import annotations


class DeepSeekV41Warning(UserWarning):
    """Base class of the V4.1 model's own warnings; filter them all with this class."""


class EngramDroppedWarning(DeepSeekV41Warning):
    """The checkpoint's Engram lookups were dropped on request: the loaded model is not the released one."""


class KernelFallbackWarning(DeepSeekV41Warning):
    """transformers' FP8/FP4 kernel could not run; packed weights are dequantized inside the forward instead
    (the same numbers as ``kernels="torch"``)."""
