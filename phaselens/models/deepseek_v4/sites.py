"""The DeepSeek-V4 adapter's hook-site table (:class:`~phaselens.models.parts.hook_sites.Site` rows; names and
shapes follow ``docs/hooks.md``): where each site sits is :mod:`.torch_hooks`' and :mod:`.nnsight_backend`'s.

A layer's tags: ``"compressed"`` (a CSA or HCA layer: compressor sites and entries) and ``"csa"`` (an indexer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

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
# Sites that are one module's input or output (nnsight reaches them directly, and remotely): the module's path
# from the causal-LM root and which of the two the site is; both backends read this table.
MODULE_SITES = {
    "embed": ("model.embed_tokens", "output"),
    "resid_pre": ("model.layers.{l}", "input"),
    "q": ("model.layers.{l}.self_attn.q_b_norm", "output"),
    "kv": ("model.layers.{l}.self_attn.kv_norm", "output"),
    "indexer_topk": ("model.layers.{l}.self_attn.compressor.indexer", "output"),
    "z": ("model.layers.{l}.self_attn.o_a_proj", "input"),
    "attn_out": ("model.layers.{l}.self_attn", "output"),
    "resid_mid": ("model.layers.{l}.ffn_hc", "input"),
    "mlp_out": ("model.layers.{l}.mlp", "output"),
    "resid_post": ("model.layers.{l}", "output"),
}
PATTERN_SITES = frozenset({"pattern_local", "pattern_entry", "pattern_sink"})
COMPRESSOR_SITES = frozenset({"gate", "payload", "entry"})


def v4_hook_points(geometry: list[LayerGeometry]) -> dict[str, HookPoint]:
    """Every hook point of a model with layers ``geometry``, in execution order."""
    return hook_points(SITES, [{g.kind, *(("compressed",) if g.compressed else ())} for g in geometry])


def site_order(point: HookPoint) -> tuple[int, int]:
    """Execution order of ``point`` (layer, position inside the block): nnsight must visit sites in this order."""
    return (-1 if point.layer is None else point.layer, ["embed", *SITES].index(point.site))


def module_view(site: str, n_heads: int) -> tuple[Callable[[Any], Tensor], Callable[[Any, Tensor], Any]]:
    """``(get, put)`` for a module site: ``get(x)`` is the hooks' view of the module's input or output ``x``
    (``q`` ``[B, n, H, d]`` from ``[B, H, n, d]``, ``kv`` ``[B, n, 1, d]``, ``z`` per head ``[B, n, H, d]``,
    ``attn_out`` the first of the outputs); ``put(x, value)`` is what replaces ``x``."""
    views: dict[str, tuple[Callable[[Any], Tensor], Callable[[Any, Tensor], Any]]] = {
        "attn_out": (lambda out: out[0], lambda out, v: (v, *out[1:])),
        "q": (lambda out: out.transpose(1, 2), lambda out, v: v.transpose(1, 2)),
        "kv": (lambda out: out.unsqueeze(2), lambda out, v: v.squeeze(2)),
        # o_a_proj's input [B, n, groups, heads_per_group * d]: heads are contiguous within a group
        "z": (lambda x: x.reshape(*x.shape[:2], n_heads, -1), lambda x, v: v.reshape(x.shape)),
    }
    return views.get(site, (lambda x: x, lambda _x, v: v))
