"""The DeepSeek-V4 adapter's hook-site table (:class:`~phaselens.models.parts.hook_sites.Site` rows; names and
shapes follow ``docs/hooks.md``): where each site sits is :mod:`.torch_hooks`' and :mod:`.nnsight_backend`'s.

A layer's tags: ``"compressed"`` (a CSA or HCA layer: compressor sites and entries) and ``"csa"`` (an indexer).
"""

from __future__ import annotations

from phaselens.contract.hooknames import HookPoint
from phaselens.models.deepseek_v4.geometry import LayerGeometry
from phaselens.models.parts.hook_sites import Site, block_sites, hook_points, split_pattern

_DERIVED = ("its value is derived from the attention and not used by the model; knock heads out at "
            "blocks.{l}.attn.hook_z instead.")
SITES = block_sites("[B, n, hc_mult, D]", {
    "kv": Site("blocks.{l}.attn.hook_kv", "[B, n, 1, d]"),
    "indexer_topk": Site("blocks.{l}.attn.hook_indexer_topk", "[B, n, k]", "csa"),
    "gate": Site("blocks.{l}.attn.hook_gate", "[B, E_new, W, 1, d]", "compressed"),
    "payload": Site("blocks.{l}.attn.hook_payload", "[B, E_new, W, 1, d]", "compressed"),
    "entry": Site("blocks.{l}.attn.hook_entry", "[B, E_new, 1, d]", "compressed"),
    **split_pattern(_DERIVED),
})
# Sites that are one module's input or output: nnsight reaches them directly (and remotely).
MODULE_SITES = frozenset(
    {"embed", "resid_pre", "q", "kv", "indexer_topk", "z", "attn_out", "resid_mid", "mlp_out", "resid_post"}
)
PATTERN_SITES = frozenset({"pattern_local", "pattern_entry", "pattern_sink"})
COMPRESSOR_SITES = frozenset({"gate", "payload", "entry"})


def v4_hook_points(geometry: list[LayerGeometry]) -> dict[str, HookPoint]:
    """Every hook point of a model with layers ``geometry``, in execution order."""
    return hook_points(SITES, [{g.kind, *(("compressed",) if g.compressed else ())} for g in geometry])


def site_order(point: HookPoint) -> tuple[int, int]:
    """Execution order of ``point`` (layer, position inside the block): nnsight must visit sites in this order."""
    return (-1 if point.layer is None else point.layer, ["embed", *SITES].index(point.site))
