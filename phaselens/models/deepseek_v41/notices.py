"""Warnings the DeepSeek-V4.1 model emits about results that may not mean what they seem."""

from __future__ import annotations


class DeepSeekV41Warning(UserWarning):
    """Base class of the V4.1 model's warnings; filter them all with this class."""


class IndexTopKWarning(DeepSeekV41Warning):
    """An indexer kept fewer entries than are visible, or the candidate filter dropped visible entries.

    The model then attends to a subset of its compressed entries, and ties in the indexer's scores may be
    broken differently by cached and uncached runs. ``load(..., index_topk="all")`` keeps every visible entry
    and lifts the candidate filter (and records that the measured model was changed).
    """


class EngramDroppedWarning(DeepSeekV41Warning):
    """The checkpoint's Engram lookups were dropped on request: the loaded model is not the released one."""


class KernelFallbackWarning(DeepSeekV41Warning):
    """transformers' FP8/FP4 kernel could not run; packed weights are dequantized inside the forward instead
    (the same numbers as ``kernels="torch"``)."""
