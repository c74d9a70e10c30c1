"""The adapter's hook names, their shapes, and how user hooks are matched and called.

Names and shapes follow ``docs/hooks.md`` (TransformerLens conventions, extended for compression). A hook
is ``fn(tensor, *, hook) -> tensor | None``: ``hook.name`` is the hook name; returning a tensor of the same
shape replaces the activation (pattern hooks are read-only).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from phaselens.contract.hooknames import HookPoint
from phaselens.contract.protocol import HookContext, hook_context
from phaselens.core.errors import InputError
from phaselens.models.deepseek_v4.geometry import LayerGeometry

HookFn = Callable[..., Tensor | None]

# site -> (name template, shape, editable, which layers have it)
_SITES: dict[str, tuple[str, str, bool, str]] = {
    "resid_pre": ("blocks.{l}.hook_resid_pre", "[B, n, hc_mult, D]", True, "all"),
    "q": ("blocks.{l}.attn.hook_q", "[B, n, H, d]", True, "all"),
    "kv": ("blocks.{l}.attn.hook_kv", "[B, n, 1, d]", True, "all"),
    "indexer_topk": ("blocks.{l}.attn.hook_indexer_topk", "[B, n, k]", True, "csa"),
    "gate": ("blocks.{l}.attn.hook_gate", "[B, E_new, W, 1, d]", True, "compressed"),
    "payload": ("blocks.{l}.attn.hook_payload", "[B, E_new, W, 1, d]", True, "compressed"),
    "entry": ("blocks.{l}.attn.hook_entry", "[B, E_new, 1, d]", True, "compressed"),
    "pattern_local": ("blocks.{l}.attn.hook_pattern_local", "[B, H, n, L]", False, "all"),
    "pattern_entry": ("blocks.{l}.attn.hook_pattern_entry", "[B, H, n, E]", False, "compressed"),
    "pattern_sink": ("blocks.{l}.attn.hook_pattern_sink", "[B, H, n]", False, "all"),
    "z": ("blocks.{l}.attn.hook_z", "[B, n, H, d]", True, "all"),
    "attn_out": ("blocks.{l}.hook_attn_out", "[B, n, D]", True, "all"),
    "resid_mid": ("blocks.{l}.hook_resid_mid", "[B, n, hc_mult, D]", True, "all"),
    "mlp_out": ("blocks.{l}.hook_mlp_out", "[B, n, D]", True, "all"),
    "resid_post": ("blocks.{l}.hook_resid_post", "[B, n, hc_mult, D]", True, "all"),
}
# Sites that are one module's input or output: nnsight reaches them directly (and remotely).
MODULE_SITES = frozenset(
    {"embed", "resid_pre", "q", "kv", "indexer_topk", "z", "attn_out", "resid_mid", "mlp_out", "resid_post"}
)
PATTERN_SITES = frozenset({"pattern_local", "pattern_entry", "pattern_sink"})
COMPRESSOR_SITES = frozenset({"gate", "payload", "entry"})


def site_order(point: HookPoint) -> tuple[int, int]:
    """Execution order of ``point`` (layer, position inside the block): nnsight must visit sites in this order."""
    sites = ["embed", *_SITES]
    return (-1 if point.layer is None else point.layer, sites.index(point.site))


def context_for(point: HookPoint, query_start: int = 0, first_entry: int | None = None) -> HookContext:
    """What a hook function receives as ``hook``: a :class:`~phaselens.contract.protocol.HookContext` for ``point``.

    ``query_start`` is the cache slot of position 0 of this call (0 for an unchunked forward; the first
    slot of the query chunk under chunked prefill). ``first_entry`` is the index of the first new entry
    for ``hook_gate`` / ``hook_payload`` / ``hook_entry`` (``None`` elsewhere). A wrapper's row shift
    (phase repair) comes from :func:`phaselens.contract.protocol.call_state`.
    """
    return hook_context(point, point.name, point.layer, query_start=query_start, first_entry=first_entry)


def hook_points(geometry: list[LayerGeometry]) -> dict[str, HookPoint]:
    """Every hook point of a model, in execution order."""
    points = {"hook_embed": HookPoint("hook_embed", None, "embed", "[B, n, D]", True)}
    for g in geometry:
        for site, (template, shape, editable, where) in _SITES.items():
            if where == "csa" and g.kind != "csa" or where == "compressed" and not g.compressed:
                continue
            name = template.format(l=g.layer)
            points[name] = HookPoint(name, g.layer, site, shape, editable)
    return points


def call_hooks(fns: list[HookFn], tensor: Tensor, hook: HookContext) -> tuple[Tensor, bool]:
    """Run ``fns`` in order on ``tensor``; each may return a replacement of the same shape.

    Returns ``(tensor, replaced)``. A hook that returns the tensor it was given counts as a replacement on
    editable sites (it may have edited it in place) and as a read on read-only ones.
    """
    replaced = False
    for fn in fns:
        out = fn(tensor, hook=hook)
        if out is None or (out is tensor and not hook.point.editable):  # TL-style `return tensor` reads only
            continue
        if not hook.point.editable:
            raise InputError(
                f"{hook.name} is read-only on the DeepSeek-V4 adapter (its value is derived, not used by the "
                "model); return None from the hook. Knock heads out at blocks.{l}.attn.hook_z instead."
            )
        if not isinstance(out, Tensor) or out.shape != tensor.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise InputError(
                f"a hook on {hook.name} returned {got}; return None or a tensor of shape "
                f"{tuple(tensor.shape)}."
            )
        tensor, replaced = out, True
    return tensor, replaced
