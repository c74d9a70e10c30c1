"""DeepSeek-V4.1's hook-site table (:class:`~phaselens.models.parts.hook_sites.Site` rows; ``docs/deepseek_v41.md``
lists them): the hook points its modules register (TransformerLens ``HookPoint`` s) are exactly these (tested).

A layer's tags follow its :class:`~.config.LayerRole`: ``"engram"`` (an Engram lookup before it),
``"kv_source"`` (gated too when its ratio is above 1: ``"gated"``), ``"candidate_source"``, ``"index_source"``
and ``"compressed"``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from phaselens.contract.hooknames import HookPoint
from phaselens.models.deepseek_v41.config import LayerRole
from phaselens.models.parts.hook_sites import Site, block_sites, hook_points, split_pattern

_AFTER = "it is read after the output is computed; knock heads out at hook_z, or edit hook_kv / hook_entry."
SITES = block_sites("[B, n, hc_mult, D]", {
    "kv": Site("blocks.{l}.attn.hook_kv", "[B, n, 1, d]"),
    "gate": Site("blocks.{l}.attn.hook_gate", "[B, E_new, r, 1, d]", "kv_source gated"),
    "payload": Site("blocks.{l}.attn.hook_payload", "[B, E_new, r, 1, d]", "kv_source"),
    "entry": Site("blocks.{l}.attn.hook_entry", "[B, E_new, 1, d]", "kv_source"),
    "candidates": Site("blocks.{l}.attn.hook_candidates", "[B, n, E]", "candidate_source"),
    "indexer_topk": Site("blocks.{l}.attn.hook_indexer_topk", "[B, n, k]", "index_source"),
    **split_pattern(_AFTER),
}, before={f"engram_{s}": Site(f"blocks.{{l}}.engram.hook_{s}", shape, "engram") for s, shape in (
    ("rows", "[B, n, C]"), ("key", "[B, n, hc_mult, D]"), ("value", "[B, n, D]"), ("gate", "[B, n, hc_mult]"),
    ("out", "[B, n, hc_mult, D]"))})


def v41_hook_points(roles: Sequence[LayerRole], engram_layers: Collection[int]) -> dict[str, HookPoint]:
    """Every hook point of a model of layer ``roles`` with Engram before ``engram_layers``, in execution order."""
    flags = ("is_kv_source", "kv_source"), ("is_candidate_source", "candidate_source"), \
        ("is_index_source", "index_source"), ("compressed", "compressed")
    tags = [{tag for attr, tag in flags if getattr(r, attr)} | ({"engram"} if r.layer in engram_layers else set())
            | ({"gated"} if r.ratio > 1 else set()) for r in roles]
    return hook_points(SITES, tags)
