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
from typing import Any

import torch
from torch import Tensor, nn

from phaselens.contract.hooknames import HookPoint
from phaselens.contract.protocol import HookFn
from phaselens.errors import HookNameError, UnsupportedModelError
from phaselens.models.causal_lm.layout import Layout
from phaselens.models.parts.adapter_hooks import HookRun, module_hook, remove_all
from phaselens.models.parts.hook_sites import Site, block_sites, hook_points
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


def _per_head(x: Tensor, d: int) -> Tensor:
    return x.view(*x.shape[:-1], -1, d)


def _site_hook(module: nn.Module, pre: bool, point: HookPoint, fns: list[HookFn], run: HookRun,
               d: int | None = None) -> Any:
    """The torch hook of a site that is ``module``'s first input (``pre``) or (first) output, viewed per head
    when ``d`` is given; its handle."""

    def get(x: Any) -> Tensor:
        value = x[0] if isinstance(x, tuple) else x
        return _per_head(value, d) if d is not None and value.dim() == 3 else value  # a QK-norm's is per head

    def put(x: Any, new: Tensor) -> Any:
        new = new.reshape((x[0] if isinstance(x, tuple) else x).shape)
        return (new, *x[1:]) if isinstance(x, tuple) else new

    return module_hook(module, "input" if pre else "output", get, put if point.editable else None,
                       lambda t: run.hooks(point, fns, t)[0])


def _fused_hook(layout: Layout, layer: int, sites: dict[str, tuple[HookPoint, list[HookFn]]], run: HookRun
                ) -> Callable:
    """GPT-2's ``c_attn``: one output ``[B, n, (H + 2 Hkv) d]`` split into q, k, v per head."""
    d, H, Hkv = layout.d_head, layout.n_heads, layout.n_kv_heads
    sizes = (H * d, Hkv * d, Hkv * d)

    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> Tensor:
        parts = list(out.split(sizes, dim=-1))
        for i, site in enumerate(("q", "k", "v")):
            if site in sites:
                point, fns = sites[site]
                parts[i] = run.hooks(point, fns, _per_head(parts[i], d))[0].reshape(parts[i].shape)
        return torch.cat(parts, dim=-1)

    return hook


def _register(layout: Layout, layer: int, point: HookPoint, fns: list[HookFn], run: HookRun, d: int | None = None
              ) -> Any:
    """Register the torch hook of one site of ``layer``; its handle."""
    site = point.site
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
    return _site_hook(module, pre, point, fns, run, d)


@contextmanager
def installed(layout: Layout, points: dict[str, HookPoint], resolved: dict[str, list[HookFn]], run: HookRun
              ) -> Iterator[dict[int, Callable[[Tensor], Tensor]]]:
    """Register the torch hooks of ``resolved`` for the forwards inside the block; yields the pattern taps
    ``{id(attention module): fn(probs) -> the probabilities to go on with}`` for :func:`.attention.borrowed`."""
    handles: list[Any] = []
    taps: dict[int, Callable[[Tensor], Tensor]] = {}
    with ExitStack() as stack:
        stack.callback(remove_all, handles)  # registered first: runs last, even if installing fails
        fused: dict[int, dict[str, tuple[HookPoint, list[HookFn]]]] = {}
        for name, fns in resolved.items():
            point = points[name]
            if point.site == "embed":
                handles.append(_site_hook(layout.embed, False, point, fns, run))
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
            else:
                d = layout.d_head if point.site in ("z", "q", "k", "v") else None
                handles.append(_register(layout, layer, point, fns, run, d))
        for layer, sites in fused.items():
            handles.append(layout.fused[layer].register_forward_hook(_fused_hook(layout, layer, sites, run)))
        yield taps


def _batch_of(run: HookRun) -> Callable:
    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> None:
        run.batch = out.shape[0]

    return hook


def _pos_hook(point: HookPoint, fns: list[HookFn], run: HookRun) -> Callable:
    """GPT-2's ``wpe`` output ``[1, n, D]`` shown as ``[B, n, D]`` (TransformerLens's shape); the model goes on with
    what the hooks return (``[B, n, D]`` broadcasts into the sum with the token embedding)."""

    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> Tensor:
        shown = out.expand(run.batch, *out.shape[1:]).clone() if out.shape[0] != run.batch else out
        return run.hooks(point, fns, shown)[0]

    return hook


def _tap(point: HookPoint, fns: list[HookFn], run: HookRun) -> Callable[[Tensor], Tensor]:
    return lambda probs: run.hooks(point, fns, probs)[0]


def check_fired(resolved: dict[str, list[HookFn]], run: HookRun, what: str) -> None:
    """Every hooked name fired during the forward, or an :class:`UnsupportedModelError` naming those that did not."""
    missing = [n for n in resolved if n not in run.fired]
    if missing:
        raise UnsupportedModelError(
            f"{missing[:4]}{' ...' if len(missing) > 4 else ''} did not fire during the forward of {what}: the modules "
            "they sit on did not run (replaced in place by another library, e.g. a TransformerLens bridge, or an "
            "attention that bypasses transformers' attention interface). Pass the unwrapped transformers model "
            "(phaselens.load(model, stride=...) unwraps a TransformerLens bridge and an nnsight envoy)."
        )
