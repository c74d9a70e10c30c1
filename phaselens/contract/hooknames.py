"""The hook-name table every model kind implements (docs/hooks.md), hook names that do not exist
explained, and the combined attention pattern of a split layer.

Analyses build names only with the functions below (never string literals), so a model kind that names its
hooks differently fails in one place.

A compressed (or sliding-window) layer has no TransformerLens ``hook_pattern`` ``[batch, head, q_pos,
k_pos]``: its softmax runs over three kinds of key at once (raw keys in the local window, compressed
entries, and the attention sink), and phaselens hooks each part. Asking for ``blocks.L.attn.hook_pattern``
there raises a :class:`~phaselens.errors.HookNameError` that says so. :func:`combined_pattern` joins the
parts into the one distribution the softmax computed (exact: a concatenation, rows sum to 1).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from phaselens.errors import HookNameError


@dataclass(frozen=True)
class HookPoint:
    """A named hook site of a model (``model.hook_sites``; the rows of its kind's table, made by
    :func:`phaselens.models.parts.hook_sites.hook_points`): its name, block (``None`` outside the blocks), kind of
    site (``"z"``, ``"resid_pre"``, ...), shape (e.g. ``"[B, n, H, d]"``), and, for a site whose value the model
    does not compute with, why an edit there is refused (``read_only``; ``""``: a returned tensor edits the
    model)."""

    name: str
    layer: int | None
    site: str
    shape: str
    read_only: str = ""

    @property
    def editable(self) -> bool:
        return not self.read_only


_PATTERN = re.compile(r"^blocks\.(\d+)\.attn\.hook_pattern$")
_KV = re.compile(r"^blocks\.(\d+)\.attn\.hook_[kv]$")


# ---- the table: every hook name an analysis uses ---------------------------------------------------------
def _attn(layer: int, leaf: str) -> str:
    return f"blocks.{int(layer)}.attn.{leaf}"


def z(layer: int) -> str:
    """Per-head attention output before the output projection ``[batch, pos, head, d_head]``."""
    return _attn(layer, "hook_z")


def pattern(layer: int) -> str:
    """Full attention probabilities ``[batch, head, q_pos, k_pos]`` (layers without compression)."""
    return _attn(layer, "hook_pattern")


def pattern_local(layer: int) -> str:
    """Probabilities on the raw keys of the local window ``[batch, head, q_pos, local_window]``."""
    return _attn(layer, "hook_pattern_local")


def pattern_entry(layer: int) -> str:
    """Probabilities on the compressed entries ``[batch, head, q_pos, entry]``."""
    return _attn(layer, "hook_pattern_entry")


def pattern_sink(layer: int) -> str:
    """Probability on the attention sink ``[batch, head, q_pos]``."""
    return _attn(layer, "hook_pattern_sink")


def gate(layer: int, path: str = "kv") -> str:
    """Compressor gate weights ``[batch, entry, slot, kv_head(, d_head)]``: ``path`` ``"kv"`` (K = V, one
    gate), ``"k"`` or ``"v"``."""
    return _attn(layer, "hook_gate" if path == "kv" else f"hook_gate_{path}")


def gates(layer: int, available: Iterable[str]) -> list[tuple[str, str]]:
    """The gate hooks a compressed layer exposes, as ``(path, name)``: ``hook_gate`` (K = V) or
    ``hook_gate_k`` / ``hook_gate_v``."""
    names = set(available)
    if gate(layer) in names:
        return [("kv", gate(layer))]
    return [(p, gate(layer, p)) for p in ("k", "v") if gate(layer, p) in names]


def explain_missing(name: Any, available: Iterable[str]) -> str:
    """Why ``name`` is not a hook of a model with hooks ``available``, and what to use instead."""
    names = list(available)
    m = _PATTERN.match(str(name))
    if m and f"blocks.{m.group(1)}.attn.hook_pattern_local" in names:
        layer = m.group(1)
        parts = [f"blocks.{layer}.attn.hook_pattern_local [batch, head, q_pos, local_window] (raw keys in the "
                 "sliding window; index i is key position q_pos - local_window + 1 + i)"]
        if f"blocks.{layer}.attn.hook_pattern_entry" in names:
            parts.append(f"blocks.{layer}.attn.hook_pattern_entry [batch, head, q_pos, entry] (compressed entries)")
        parts.append(f"blocks.{layer}.attn.hook_pattern_sink [batch, head, q_pos] (the attention sink)")
        kind = "compressed" if len(parts) == 3 else "sliding-window"
        return (f"{name!r} does not exist: layer {layer} is a {kind} layer, whose attention is split into "
                f"{', '.join(parts)}. Together they sum to 1 over keys; "
                f"phaselens.contract.hooknames.combined_pattern(cache, {layer}) joins them into one [batch, head, q_pos, keys] "
                "tensor (see docs/hooks.md).")
    m = _KV.match(str(name))
    if m and f"blocks.{m.group(1)}.attn.hook_kv" in names:
        layer = m.group(1)
        return (f"{name!r} does not exist: on layer {layer} keys and values are one tensor (K = V: a tied "
                f"compressor, or DeepSeek-V4's single latent), blocks.{layer}.attn.hook_kv [batch, pos, kv_head, "
                "d_head]. Read or patch hook_kv: it is the key and the value at once, so "
                "TransformerLens's get_act_patch_attn_head_k_all_pos / _v_all_pos have no separate site here "
                "(patch hook_kv per KV head, or hook_z per head).")
    close = difflib.get_close_matches(str(name), names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return f"{name!r} is not a hook point of this model.{hint} model.hook_dict lists every name (docs/hooks.md)."


class HookDict(dict):
    """A ``{name: hook point}`` dict whose missing names raise :class:`HookNameError` with an explanation."""

    def __missing__(self, name: Any) -> Any:
        raise HookNameError(explain_missing(name, self.keys()))


def combined_pattern(cache: Mapping[str, Any], layer: int) -> Any:
    """The whole attention distribution of ``layer`` from a cache of its pattern hooks.

    ``cache`` maps hook names to tensors (``run_with_cache``'s cache, or a plain dict). On a layer with
    split patterns the result is ``[batch, head, q_pos, local_window + entries + 1]``: the local-window
    probabilities, then one column per compressed entry (none on sliding-window layers), then the sink.
    It is exactly the softmax the layer computed, so each row sums to 1. On a full-attention layer it is
    ``blocks.{layer}.attn.hook_pattern`` itself.
    """
    import torch

    pre = f"blocks.{layer}.attn."
    keys = set(cache.keys())
    if pre + "hook_pattern" in keys:
        return cache[pre + "hook_pattern"]
    if pre + "hook_pattern_local" not in keys or pre + "hook_pattern_sink" not in keys:
        raise HookNameError(
            f"combined_pattern needs {pre}hook_pattern_local, {pre}hook_pattern_sink (and {pre}hook_pattern_entry "
            "on a compressed layer) in the cache; record them, e.g. names_filter=lambda n: 'hook_pattern' in n."
        )
    parts = [cache[pre + "hook_pattern_local"]]
    if pre + "hook_pattern_entry" in keys:
        parts.append(cache[pre + "hook_pattern_entry"])
    parts.append(cache[pre + "hook_pattern_sink"].unsqueeze(-1))
    return torch.cat(parts, dim=-1)
