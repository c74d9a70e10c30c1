"""Warnings the DeepSeek-V4 adapter emits about results that may not mean what they seem."""

from __future__ import annotations


class DeepSeekV4Warning(UserWarning):
    """Base class of the adapter's warnings; filter them all with this class."""


class IndexTopKWarning(DeepSeekV4Warning):
    """The CSA indexer keeps fewer entries than exist at the analysed length.

    The model then attends to a top-k subset, and ties in the indexer's scores are broken differently
    by the cached (chunked) and uncached paths, so the two can disagree. The adapter records the
    chosen indices (``adapter.indexer_picks``); ``from_hf(model, index_topk="all")`` removes the
    truncation (and records that the measured model was changed).
    """


class LayerTypesWarning(DeepSeekV4Warning):
    """A checkpoint whose ``layer_types`` came from transformers' default, which matches no released model."""
