"""The DeepSeek-V4 adapter's hook-site table (:class:`~phaselens.models.parts.hook_sites.Site` rows; names and
shapes follow ``docs/hooks.md``): where each site sits is :mod:`.torch_hooks`' and :mod:`.nnsight_backend`'s.

A layer's tags: ``"compressed"`` (a CSA or HCA layer: compressor sites and entries) and ``"csa"`` (an indexer).
"""

from __future__ import annotations

from phaselens.contract.hooknames import HookPoint
from phaselens.models.deepseek_v4.geometry import LayerGeometry
from phaselens.models.parts.hook_sites import Site, hook_points

_DERIVED = ("its value is derived from the attention and not used by the model; knock heads out at "
            "blocks.{l}.attn.hook_z instead.")
SITES: dict[str, Site] = {
    "resid_pre": Site("blocks.{l}.hook_resid_pre", "[B, n, hc_mult, D]"),
    "q": Site("blocks.{l}.attn.hook_q", "[B, n, H, d]"),
    "kv": Site("blocks.{l}.attn.hook_kv", "[B, n, 1, d]"),
    "indexer_topk": Site("blocks.{l}.attn.hook_indexer_topk", "[B, n, k]", "csa"),
    "gate": Site("blocks.{l}.attn.hook_gate", "[B, E_new, W, 1, d]", "compressed"),
    "payload": Site("blocks.{l}.attn.hook_payload", "[B, E_new, W, 1, d]", "compressed"),
    "entry": Site("blocks.{l}.attn.hook_entry", "[B, E_new, 1, d]", "compressed"),
    "pattern_local": Site("blocks.{l}.attn.hook_pattern_local", "[B, H, n, L]", read_only=_DERIVED),
    "pattern_entry": Site("blocks.{l}.attn.hook_pattern_entry", "[B, H, n, E]", "compressed", _DERIVED),
    "pattern_sink": Site("blocks.{l}.attn.hook_pattern_sink", "[B, H, n]", read_only=_DERIVED),
    "z": Site("blocks.{l}.attn.hook_z", "[B, n, H, d]"),
    "attn_out": Site("blocks.{l}.hook_attn_out", "[B, n, D]"),
    "resid_mid": Site("blocks.{l}.hook_resid_mid", "[B, n, hc_mult, D]"),
    "mlp_out": Site("blocks.{l}.hook_mlp_out", "[B, n, D]"),
    "resid_post": Site("blocks.{l}.hook_resid_post", "[B, n, hc_mult, D]"),
}
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
