"""The hook-site table every model kind declares, the one dispatch of user hooks, and the one check of what a
hook returns.

A kind's table maps a site (``"z"``) to a :class:`Site`: its name template, its shape, which layers have it, and,
for a site whose value the model does not compute with, why an edit there is refused. :func:`hook_points` turns
a table and each layer's tags into ``{name: HookPoint}`` in execution order (``model.hook_sites`` on every kind).

A hook is ``fn(tensor, *, hook) -> tensor | None``. Every kind runs its hooks through :func:`call_hooks`, and what
a hook returns is checked by :func:`check_hook_return` alone: ``None`` (the hook read), or a tensor of exactly the
given shape, dtype and device (its replacement); anything else is an :class:`~phaselens.errors.InputError`
naming the hook point, what was expected and what came back (never a broadcast, a silent dtype promotion or a raw
error three layers later). A read-only site accepts no replacement but the value itself.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from phaselens.contract.hooknames import HookPoint
from phaselens.errors import InputError

HookFn = Callable[..., Tensor | None]


@dataclass(frozen=True)
class Site:
    """One row of a kind's hook-site table.

    Attributes:
        template: the hook name, ``{l}`` the layer (``"blocks.{l}.attn.hook_z"``).
        shape: e.g. ``"[B, n, H, d]"`` (docs/hooks.md).
        where: the tags a layer needs to have the site, space-separated (``""``: every layer).
        read_only: why an edit there is refused (``""``: the site is editable).
    """

    template: str
    shape: str
    where: str = ""
    read_only: str = ""


EMBED = HookPoint("hook_embed", None, "embed", "[B, n, D]")


def block_sites(resid: str, attention: Mapping[str, Site], *, before: Mapping[str, Site] | None = None,
                mlp: Mapping[str, Site] | None = None, **replace: Site) -> dict[str, Site]:
    """A kind's table, in execution order: the rows every kind's blocks have (TransformerLens's residual sites,
    ``hook_q``, ``hook_z`` and the sublayer outputs; ``resid``: the residual's shape) around its own ``attention``
    rows (and ``before`` the block, ``mlp`` inside its MLP); ``replace`` overrides a shared row."""
    def row(site: str, shape: str) -> Site:
        return replace.get(site, Site(f"blocks.{{l}}.hook_{site}", shape))

    return {**(before or {}), "resid_pre": row("resid_pre", resid),
            "q": replace.get("q", Site("blocks.{l}.attn.hook_q", "[B, n, H, d]")), **attention,
            "z": replace.get("z", Site("blocks.{l}.attn.hook_z", "[B, n, H, d]")), "attn_out": row("attn_out", "[B, n, D]"),
            "resid_mid": row("resid_mid", resid), **(mlp or {}), "mlp_out": row("mlp_out", "[B, n, D]"),
            "resid_post": row("resid_post", resid)}


def hook_points(table: Mapping[str, Site], tags: Sequence[Collection[str]]) -> dict[str, HookPoint]:
    """``{name: HookPoint}`` of a model whose layer ``l`` has the tags ``tags[l]``, in execution order
    (``hook_embed`` first)."""
    points = {EMBED.name: EMBED}
    for layer, have in enumerate(tags):
        for site, row in table.items():
            if set(row.where.split()) <= set(have):
                name = row.template.format(l=layer)
                points[name] = HookPoint(name, layer, site, row.shape, row.read_only)
    return points


def split_pattern(read_only: str = "", *, where: str = "", sink: str | None = None) -> dict[str, Site]:
    """The rows of one softmax over the local window, the compressed entries and the sink (docs/hooks.md) on the
    layers tagged ``where`` (entries: on ``"compressed"`` ones); ``read_only``: why the three refuse edits, ``sink``:
    why the sink alone does."""
    return {"pattern_local": Site("blocks.{l}.attn.hook_pattern_local", "[B, H, n, L]", where, read_only),
            "pattern_entry": Site("blocks.{l}.attn.hook_pattern_entry", "[B, H, n, E]", f"{where} compressed",
                                  read_only),
            "pattern_sink": Site("blocks.{l}.attn.hook_pattern_sink", "[B, H, n]", where,
                                 read_only if sink is None else sink)}


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype} on {value.device}"
    shape = getattr(value, "shape", None)  # numpy arrays and the like
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    if isinstance(value, list | tuple | dict):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"{reprlib.repr(value)[:80]} (of type {type(value).__name__})"  # bounded, whatever the object


def check_hook_return(name: str, given: Tensor, out: Any, read_only: str = "") -> None:
    """``out``, what the hook on ``name`` returned for ``given``, must be ``None`` (the hook only read) or a
    tensor of ``given``'s shape, dtype and device (its replacement); at a read-only site (``read_only``: why) only
    ``given`` itself or an equal copy. Else an :class:`InputError` naming both."""
    if out is None or out is given:
        return
    same = isinstance(out, Tensor) and out.shape == given.shape and out.dtype == given.dtype \
        and out.device == given.device
    if same and (not read_only or torch.equal(out, given)):
        return
    if same:  # a replacement of the right kind at a site that takes none
        raise InputError(f"{name} is read-only: {read_only} Return None from the hook to read it.")
    also = f" Besides, {name} is read-only: {read_only}" if read_only else ""
    raise InputError(
        f"the hook on {name} returned {_describe(out)}; a hook returns None (to read the value) or a tensor of "
        f"shape {tuple(given.shape)}, dtype {given.dtype} on {given.device} (to replace it): e.g. edit a copy "
        f"and return it, cast with .to(value.dtype), or return None.{also}"
    )


def call_hooks(point: Any, fns: Sequence[HookFn], tensor: Tensor, hook: Any) -> tuple[Tensor, bool]:
    """The one dispatch: run ``fns`` in order on ``tensor`` at ``point`` (a hook point with a ``name`` and, where
    it is read-only, a ``read_only`` reason), each called as ``fn(tensor, hook=hook)`` and its return checked.

    Returns ``(tensor, replaced)``: the last replacement (a hook that returns the tensor it was given counts as one
    at an editable site: it may have edited it in place), or ``tensor`` itself.
    """
    why = getattr(point, "read_only", "") or ""
    replaced = False
    for fn in fns:
        out = fn(tensor, hook=hook)
        check_hook_return(point.name, tensor, out, why)
        if out is not None and not why:
            tensor, replaced = out, True
    return tensor, replaced
