"""The compressed transformer's hook-site table (:class:`~phaselens.models.parts.hook_sites.Site` rows; names and
shapes follow ``docs/hooks.md``): the hook points its modules register (TransformerLens ``HookPoint`` s) are
exactly these (tested).

A layer's tags: its attention kind (``"full"``, ``"local"`` or ``"compressed"``), ``"split"`` (local or compressed:
the pattern in parts), ``"tied"`` or ``"untied"`` (K = V or not), and ``"gated"`` (a SwiGLU MLP).
"""

from __future__ import annotations

from collections.abc import Iterable

from phaselens.contract.hooknames import HookPoint
from phaselens.models.parts.hook_sites import Site, block_sites, hook_points, split_pattern

_SINK = ("the sink has no value vector, so its probability is not used after the softmax; edit hook_pattern_local "
         "/ hook_pattern_entry, or hook_z to knock a head out.")
SITES = block_sites("[B, n, D]", {
    "kv": Site("blocks.{l}.attn.hook_kv", "[B, n, Hkv, d]", "tied"),
    "k": Site("blocks.{l}.attn.hook_k", "[B, n, Hkv, d]", "untied"),
    "v": Site("blocks.{l}.attn.hook_v", "[B, n, Hkv, d]", "untied"),
    **{f"{part}{path}": Site(f"blocks.{{l}}.attn.hook_{part}{path}", shape, f"compressed {tied}")
       for path, tied in (("", "tied"), ("_k", "untied"), ("_v", "untied"))
       for part, shape in (("gate", "[B, E_new, W, Hkv(, d)]"), ("entry", "[B, E_new, Hkv, d]"))},
    "pattern": Site("blocks.{l}.attn.hook_pattern", "[B, H, n, keys]", "full"),
    **split_pattern(where="split", sink=_SINK),
}, mlp={f"mlp_{s}": Site(f"blocks.{{l}}.mlp.hook_{s}", "[B, n, d_mlp]", where)
        for s, where in (("pre", ""), ("pre_linear", "gated"), ("post", ""))})


def zoo_hook_points(kinds: Iterable[str], tied: Iterable[bool], gated: bool) -> dict[str, HookPoint]:
    """Every hook point of a model whose layers have attention ``kinds`` and K = V ``tied``, in execution order."""
    tags = [{kind, "tied" if t else "untied", *(("split",) if kind != "full" else ()), *(("gated",) if gated else ())}
            for kind, t in zip(kinds, tied)]
    return hook_points(SITES, tags)
