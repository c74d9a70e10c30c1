"""Warnings every model kind may emit about results that may not mean what they seem."""

from __future__ import annotations


class IndexTopKWarning(UserWarning):
    """A sparse indexer kept fewer compressed entries than are visible at the analysed length (or, in
    DeepSeek-V4.1, the candidate filter dropped visible entries).

    The model then attends to a top-k subset, and ties in the indexer's scores may be broken differently by the
    cached (chunked) and uncached paths, so the two can disagree. The DeepSeek-V4 adapter records the chosen
    indices (``adapter.indexer_picks``). Loading with ``index_topk="all"`` (``from_transformers(model, index_topk="all")``,
    ``load(..., index_topk="all")``) keeps every visible entry, and records that the measured model was changed.
    """
