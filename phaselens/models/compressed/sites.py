"""The compressed transformer's hook-site table (:class:`~phaselens.models.parts.hook_sites.Site` rows; names and
shapes follow ``docs/hooks.md``): the hook points its modules register (TransformerLens ``HookPoint`` s) are
exactly these (tested).

A layer's tags: its attention kind (``"full"``, ``"local"`` or ``"compressed"``), ``"split"`` (local or compressed:
the pattern in parts), ``"tied"`` or ``"untied"`` (K = V or not), and ``"gated"`` (a SwiGLU MLP).
"""

from __future__ import annotations

from collections.abc import Iterable

from phaselens.contract.hooknames import HookPoint
from phaselens.models.parts.hook_sites import Site, hook_points

_SINK = ("the sink has no value vector, so its probability is not used after the softmax; edit hook_pattern_local "
         "/ hook_pattern_entry, or hook_z to knock a head out.")
SITES: dict[str, Site] = {
    "resid_pre": Site("blocks.{l}.hook_resid_pre", "[B, n, D]"),
    "q": Site("blocks.{l}.attn.hook_q", "[B, n, H, d]"),
    "kv": Site("blocks.{l}.attn.hook_kv", "[B, n, Hkv, d]", "tied"),
    "k": Site("blocks.{l}.attn.hook_k", "[B, n, Hkv, d]", "untied"),
    "v": Site("blocks.{l}.attn.hook_v", "[B, n, Hkv, d]", "untied"),
    "gate": Site("blocks.{l}.attn.hook_gate", "[B, E_new, W, Hkv(, d)]", "compressed tied"),
    "entry": Site("blocks.{l}.attn.hook_entry", "[B, E_new, Hkv, d]", "compressed tied"),
    "gate_k": Site("blocks.{l}.attn.hook_gate_k", "[B, E_new, W, Hkv(, d)]", "compressed untied"),
    "entry_k": Site("blocks.{l}.attn.hook_entry_k", "[B, E_new, Hkv, d]", "compressed untied"),
    "gate_v": Site("blocks.{l}.attn.hook_gate_v", "[B, E_new, W, Hkv(, d)]", "compressed untied"),
    "entry_v": Site("blocks.{l}.attn.hook_entry_v", "[B, E_new, Hkv, d]", "compressed untied"),
    "pattern": Site("blocks.{l}.attn.hook_pattern", "[B, H, n, keys]", "full"),
    "pattern_local": Site("blocks.{l}.attn.hook_pattern_local", "[B, H, n, L]", "split"),
    "pattern_entry": Site("blocks.{l}.attn.hook_pattern_entry", "[B, H, n, E]", "compressed"),
    "pattern_sink": Site("blocks.{l}.attn.hook_pattern_sink", "[B, H, n]", "split", _SINK),
    "z": Site("blocks.{l}.attn.hook_z", "[B, n, H, d]"),
    "attn_out": Site("blocks.{l}.hook_attn_out", "[B, n, D]"),
    "resid_mid": Site("blocks.{l}.hook_resid_mid", "[B, n, D]"),
    "mlp_pre": Site("blocks.{l}.mlp.hook_pre", "[B, n, d_mlp]"),
    "mlp_pre_linear": Site("blocks.{l}.mlp.hook_pre_linear", "[B, n, d_mlp]", "gated"),
    "mlp_post": Site("blocks.{l}.mlp.hook_post", "[B, n, d_mlp]"),
    "mlp_out": Site("blocks.{l}.hook_mlp_out", "[B, n, D]"),
    "resid_post": Site("blocks.{l}.hook_resid_post", "[B, n, D]"),
}


def zoo_hook_points(kinds: Iterable[str], tied: Iterable[bool], gated: bool) -> dict[str, HookPoint]:
    """Every hook point of a model whose layers have attention ``kinds`` and K = V ``tied``, in execution order."""
    tags = [{kind, "tied" if t else "untied", *(("split",) if kind != "full" else ()), *(("gated",) if gated else ())}
            for kind, t in zip(kinds, tied)]
    return hook_points(SITES, tags)
