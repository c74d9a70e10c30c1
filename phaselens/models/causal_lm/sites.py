"""Hook names of a transformers causal LM, and the torch hooks that reach them for one forward.

Where each site sits (``layer`` = the decoder block, ``attn`` its attention module; see :mod:`.layout`):

* ``hook_embed``: output of the token embedding; ``hook_pos_embed`` (GPT-2): the learned position embedding's
  output, ``[B, n, D]`` as TransformerLens gives it (the ``[1, n, D]`` table rows repeated over the batch); ``blocks.{l}.hook_resid_pre`` / ``hook_resid_post``: input /
  output of ``layer``; ``hook_resid_mid`` (read-only): input of the norm before the MLP;
* ``attn.hook_q`` / ``hook_k`` / ``hook_v``: the projections' outputs viewed per head (``[B, n, H, d]``,
  ``[B, n, Hkv, d]``), before RoPE; Qwen3's ``hook_q`` / ``hook_k`` are the QK-norms' outputs (as phaselens's
  own Qwen3 backbone names them); GPT-2's fused ``c_attn`` output is split into the three;
* ``attn.hook_pattern``: the probabilities ``[B, H, n, keys]`` inside the attention (see :mod:`.attention`);
* ``attn.hook_z``: the **input of the output projection** (``o_proj`` / ``c_proj``) viewed per head,
  ``[B, n, H, d]``: a knockout written here is what the projection computes with;
* ``hook_attn_out``: the attention module's output ``[B, n, D]``; ``hook_mlp_out``: the MLP's output.

Every handle is registered inside :func:`installed` and removed in its ``finally``, whatever raises. A hook
name that was asked for and did not fire (a module replaced by another library, an attention that bypasses
transformers' attention interface) is an :class:`~phaselens.errors.UnsupportedModelError`, never a
reading the model did not produce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from phaselens.contract.hooknames import HookPoint
from phaselens.contract.protocol import HookFn, hook_context
from phaselens.errors import HookNameError, UnsupportedModelError
from phaselens.models.causal_lm.layout import Layout
from phaselens.models.parts.hook_sites import Site, block_sites, call_hooks, hook_points
from phaselens.models.parts.tl_hf import mlp_parts, neuron_tags

# in execution order within a block; a layer's tags: "mlp" (it has one), "norm2" (a norm before it, pre-norm)
SITES = block_sites("[B, n, D]", {
    "k": Site("blocks.{l}.attn.hook_k", "[B, n, Hkv, d]"),
    "v": Site("blocks.{l}.attn.hook_v", "[B, n, Hkv, d]"),
    "pattern": Site("blocks.{l}.attn.hook_pattern", "[B, H, n, keys]"),
}, resid_mid=Site("blocks.{l}.hook_resid_mid", "[B, n, D]", "norm2", "an edit there would not reach the residual "
                  "stream on a transformers model; edit hook_attn_out or hook_resid_post instead."),
    mlp={"mlp_pre": Site("blocks.{l}.mlp.hook_pre", "[B, n, d_mlp]", "neurons"),  # the activation's input
         "mlp_pre_linear": Site("blocks.{l}.mlp.hook_pre_linear", "[B, n, d_mlp]", "neurons gated"),  # up_proj's output
         "mlp_post": Site("blocks.{l}.mlp.hook_post", "[B, n, d_mlp]", "neurons")},  # down_proj's input
    mlp_out=Site("blocks.{l}.hook_mlp_out", "[B, n, D]", "mlp"))
_ENTRY_SITES = ("hook_pattern_local", "hook_pattern_entry", "hook_pattern_sink", "hook_gate", "hook_entry",
                "hook_payload")


def causal_hook_points(layout: Layout) -> dict[str, HookPoint]:
    """Every hook point of the model, in execution order."""
    tags = [{*(("mlp",) if layout.mlp[i] is not None else ()), *(("norm2",) if layout.norm2[i] is not None else ()),
             *neuron_tags(layout.mlp[i])} for i in range(layout.n_layers)]
    points = hook_points(SITES, tags)
    if layout.pos_embed is None:
        return points
    first, rest = next(iter(points.items())), list(points.items())[1:]
    return dict([first, ("hook_pos_embed", HookPoint("hook_pos_embed", None, "pos_embed", "[B, n, D]")), *rest])


def no_entries(name: Any) -> None:
    """A compressed-layer name (entries, gates, the split pattern) is a :class:`HookNameError` saying that this
    model has none."""
    if any(str(name).endswith(s) or f".{s}_" in str(name) for s in _ENTRY_SITES):
        raise HookNameError(
            f"{name!r} does not exist: this is a full-attention model analysed at a stride phaselens was given; "
            "it has no compressed entries, gates or local window. Its attention is blocks.{l}.attn.hook_pattern "
            "[batch, head, q_pos, k_pos]."
        )


@dataclass
class Run:
    """One hooked forward: the cache slot of its row 0, and the names that fired."""

    query_start: int = 0
    fired: set[str] = field(default_factory=set)
    batch: int = 1  # the batch size, read from the token embedding (GPT-2's position hook shows it)


def run_hooks(point: HookPoint, fns: list[HookFn], tensor: Tensor, run: Run) -> Tensor:
    """``fns`` on ``tensor`` through the one dispatch: the tensor the model goes on with (``tensor`` itself, or
    the last replacement).

    The caller puts the returned tensor back into the computation even when no hook replaced it (a per-head view
    is still a new tensor object), so that gradients with respect to the hooked tensor flow, as in TransformerLens.
    """
    run.fired.add(point.name)
    ctx = hook_context(point, point.name, point.layer, query_start=run.query_start)
    return call_hooks(point, fns, tensor, ctx)[0]


def _per_head(x: Tensor, d: int) -> Tensor:
    return x.view(*x.shape[:-1], -1, d)


def _out_hook(point: HookPoint, fns: list[HookFn], run: Run, d: int | None = None) -> Callable:
    """A forward hook on a module whose (first) output is the site (viewed per head when ``d`` is given)."""

    def hook(_m: nn.Module, _args: tuple, out: Any) -> Any:
        value = out[0] if isinstance(out, tuple) else out
        shown = _per_head(value, d) if d is not None and value.dim() == 3 else value  # a QK-norm's is per head
        new = run_hooks(point, fns, shown, run).reshape(value.shape)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return hook


def _in_hook(point: HookPoint, fns: list[HookFn], run: Run, d: int | None = None) -> Callable:
    """A forward pre-hook (with kwargs) on a module whose first input is the site."""

    def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        value = args[0] if args else kwargs["hidden_states"]
        shown = _per_head(value, d) if d is not None else value
        new = run_hooks(point, fns, shown, run)
        if not point.editable:
            return None
        new = new.reshape(value.shape)
        return ((new, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": new})

    return hook


def _fused_hook(layout: Layout, layer: int, sites: dict[str, tuple[HookPoint, list[HookFn]]], run: Run) -> Callable:
    """GPT-2's ``c_attn``: one output ``[B, n, (H + 2 Hkv) d]`` split into q, k, v per head."""
    d, H, Hkv = layout.d_head, layout.n_heads, layout.n_kv_heads
    sizes = (H * d, Hkv * d, Hkv * d)

    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> Tensor:
        parts = list(out.split(sizes, dim=-1))
        for i, site in enumerate(("q", "k", "v")):
            if site in sites:
                point, fns = sites[site]
                parts[i] = run_hooks(point, fns, _per_head(parts[i], d), run).reshape(parts[i].shape)
        return torch.cat(parts, dim=-1)

    return hook


def _register(layout: Layout, layer: int, site: str, hook: Any) -> Any:
    """Register the torch hook of one site of ``layer``; its handle."""
    block, attn = layout.layers[layer], layout.attn[layer]
    q, k, v = layout.qkv[layer]
    where: dict[str, tuple[nn.Module | None, bool]] = {  # site -> (module, pre-hook?)
        "resid_pre": (block, True), "resid_post": (block, False), "attn_out": (attn, False),
        "z": (layout.out_proj[layer], True), "resid_mid": (layout.norm2[layer], True),
        "mlp_out": (layout.mlp[layer], False),
        "q": (layout.q_norm[layer] or q, False), "k": (layout.k_norm[layer] or k, False), "v": (v, False),
    }
    parts = mlp_parts(layout.mlp[layer]) or {}
    where.update({"mlp_pre": (parts.get("act"), True), "mlp_pre_linear": (parts.get("in"), False),
                  "mlp_post": (parts.get("out"), True)})
    module, pre = where[site]
    if module is None:
        raise UnsupportedModelError(f"layer {layer} has no module for hook site {site!r}.")
    return module.register_forward_pre_hook(hook, with_kwargs=True) if pre else module.register_forward_hook(hook)


@contextmanager
def installed(layout: Layout, points: dict[str, HookPoint], resolved: dict[str, list[HookFn]], run: Run
              ) -> Iterator[dict[int, Callable[[Tensor], Tensor]]]:
    """Register the torch hooks of ``resolved`` for the forwards inside the block; yields the pattern taps
    ``{id(attention module): fn(probs) -> the probabilities to go on with}`` for :func:`.attention.borrowed`."""
    handles: list[Any] = []
    taps: dict[int, Callable[[Tensor], Tensor]] = {}
    with ExitStack() as stack:
        stack.callback(_remove, handles)  # registered first: runs last, even if installing fails
        fused: dict[int, dict[str, tuple[HookPoint, list[HookFn]]]] = {}
        for name, fns in resolved.items():
            point = points[name]
            if point.site == "embed":
                handles.append(layout.embed.register_forward_hook(_out_hook(point, fns, run)))
                continue
            if point.site == "pos_embed":  # the token embedding runs first: it gives the batch size
                handles.append(layout.embed.register_forward_hook(_batch_of(run)))
                handles.append(layout.pos_embed.register_forward_hook(_pos_hook(point, fns, run)))
                continue
            layer = int(point.layer)  # type: ignore[arg-type]
            if point.site == "pattern":
                taps[id(layout.attn[layer])] = _tap(point, fns, run)
            elif point.site in ("q", "k", "v") and layout.fused[layer] is not None:
                fused.setdefault(layer, {})[point.site] = (point, fns)
            elif point.site in ("z", "q", "k", "v"):
                hook = (_in_hook if point.site == "z" else _out_hook)(point, fns, run, layout.d_head)
                handles.append(_register(layout, layer, point.site, hook))
            elif point.site in ("resid_pre", "resid_mid", "mlp_pre", "mlp_post"):
                handles.append(_register(layout, layer, point.site, _in_hook(point, fns, run)))
            else:
                handles.append(_register(layout, layer, point.site, _out_hook(point, fns, run)))
        for layer, sites in fused.items():
            handles.append(layout.fused[layer].register_forward_hook(_fused_hook(layout, layer, sites, run)))
        yield taps


def _batch_of(run: Run) -> Callable:
    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> None:
        run.batch = out.shape[0]

    return hook


def _pos_hook(point: HookPoint, fns: list[HookFn], run: Run) -> Callable:
    """GPT-2's ``wpe`` output ``[1, n, D]`` shown as ``[B, n, D]`` (TransformerLens's shape); the model goes on with
    what the hooks return (``[B, n, D]`` broadcasts into the sum with the token embedding)."""

    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> Tensor:
        shown = out.expand(run.batch, *out.shape[1:]).clone() if out.shape[0] != run.batch else out
        return run_hooks(point, fns, shown, run)

    return hook


def _tap(point: HookPoint, fns: list[HookFn], run: Run) -> Callable[[Tensor], Tensor]:
    return lambda probs: run_hooks(point, fns, probs, run)


def check_fired(resolved: dict[str, list[HookFn]], run: Run, what: str) -> None:
    """Every hooked name fired during the forward, or an :class:`UnsupportedModelError` naming those that did not."""
    missing = [n for n in resolved if n not in run.fired]
    if missing:
        raise UnsupportedModelError(
            f"{missing[:4]}{' ...' if len(missing) > 4 else ''} did not fire during the forward of {what}: the modules "
            "they sit on did not run (replaced in place by another library, e.g. a TransformerLens bridge, or an "
            "attention that bypasses transformers' attention interface). Pass the unwrapped transformers model "
            "(phaselens.load(model, stride=...) unwraps a TransformerLens bridge and an nnsight envoy)."
        )


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
