"""Warnings the DeepSeek-V4 adapter emits about results that may not mean what they seem; the index-top-k
warning is the one every kind emits, :class:`phaselens.models.parts.index_topk.IndexTopKWarning`."""

from __future__ import annotations


class DeepSeekV4Warning(UserWarning):
    """Base class of the adapter's own warnings; filter them all with this class."""


class LayerTypesWarning(DeepSeekV4Warning):
    """A checkpoint whose ``layer_types`` came from transformers' default, which matches no released model."""
