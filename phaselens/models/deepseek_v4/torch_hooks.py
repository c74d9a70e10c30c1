"""Torch-hook backend: puts the adapter's hook points on a transformers DeepSeek-V4 model for one forward.

Every handle is registered inside :func:`torch_sites` and removed in its ``finally``, whatever raises
(including ``KeyboardInterrupt``); the attention tap is restored the same way. Nothing stays on the model
between forwards.

Where each site sits (``model.model.layers[l]`` = ``layer``, ``layer.self_attn`` = ``attn``):

* ``hook_embed``: output of ``embed_tokens``; ``hook_resid_pre`` / ``hook_resid_post``: input / output of
  ``layer``, and ``hook_resid_mid``: input of ``layer.ffn_hc`` (all the hyper-connection streams
  ``[B, n, hc_mult, D]``);
* ``attn.hook_q``: output of ``attn.q_b_norm`` (after the norm, before RoPE); ``attn.hook_kv``: output of
  ``attn.kv_norm`` (before RoPE);
* ``attn.hook_z``: input of the grouped output projection ``attn.o_a_proj``, viewed per head (after the
  conjugate RoPE); ``hook_attn_out``: ``attn``'s output; ``hook_mlp_out``: ``layer.mlp``'s output;
* ``attn.hook_indexer_topk``: output of ``attn.compressor.indexer``;
* ``attn.hook_gate`` / ``hook_payload`` / ``hook_entry``: rebuilt from ``compressor.kv_proj`` /
  ``compressor.gate_proj`` (see :mod:`.gates`) when the compressor returns; editing the gates or payloads
  recomputes the new rows, editing the entries replaces them (in the returned rows and in the cache);
* ``attn.hook_pattern_*``: from the attention tap (see :mod:`.patterns`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from phaselens.contract.hooknames import HookPoint
from phaselens.contract.protocol import HookFn
from phaselens.models.deepseek_v4 import gates
from phaselens.models.deepseek_v4.patterns import attention_tap, split
from phaselens.models.deepseek_v4.sites import COMPRESSOR_SITES, MODULE_SITES, PATTERN_SITES, module_view
from phaselens.models.parts.adapter_hooks import HookRun, module_hook, remove_all


class CompressorTap:
    """Hooks around one layer's compressor: snapshot the cache, catch the projections, rebuild the gates."""

    def __init__(
        self, module: nn.Module, layer: int, fns: dict[str, tuple[HookPoint, list[HookFn]]], run: HookRun
    ) -> None:
        self.module, self.layer, self.fns, self.run = module, layer, fns, run
        self.before = gates.Snapshot()
        self.cache: Any = None
        self.kv: Tensor | None = None
        self.gate: Tensor | None = None
        self.n_entries = 0  # every entry the attention of this call sees (read by the pattern tap)

    def install(self, handles: list[Any]) -> None:
        m = self.module
        handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
        if self.fns:
            handles.append(m.kv_proj.register_forward_hook(lambda _m, _a, out: setattr(self, "kv", out)))
            handles.append(m.gate_proj.register_forward_hook(lambda _m, _a, out: setattr(self, "gate", out)))
        handles.append(m.register_forward_hook(self._post))

    def _pre(self, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        self.cache = args[3] if len(args) > 3 else kwargs.get("cache", kwargs.get("past_key_values"))
        self.before = gates.snapshot(self.cache, self.layer)

    def _post(self, module: nn.Module, _args: tuple, out: tuple[Tensor, Any]) -> tuple[Tensor, Any] | None:
        compressed, bias = out[0], out[1]
        total = int(compressed.shape[2])
        self.n_entries = total
        if not self.fns:
            return None
        assert self.kv is not None and self.gate is not None
        w = gates.windows(module, self.kv, self.gate, self.before)
        new = w.n_entries
        if total != (
            w.first_entry + new if self.cache is not None else new
        ):  # our layout must match the model's
            raise RuntimeError(
                f"layer {self.layer}: rebuilt {new} new entries from entry {w.first_entry}, but the "
                "compressor "
                f"returned {total}; this transformers version lays out the compressor differently."
            )

        def run(site: str, tensor: Tensor) -> tuple[Tensor, bool]:
            if site not in self.fns:
                return tensor, False
            point, fns = self.fns[site]
            return self.run.hooks(point, fns, tensor, w.first_entry)

        alpha, edited_alpha = run("gate", w.alpha)
        payload, edited_payload = run("payload", w.payload)
        rows = None
        if edited_alpha or edited_payload:
            rows = gates.finish(module, gates.pool(alpha, payload), w.first_entry).to(compressed.dtype)
        current = rows if rows is not None else compressed[:, 0, total - new :]
        entry, edited_entry = run("entry", current.unsqueeze(2))
        if edited_entry:
            rows = entry.squeeze(2).to(compressed.dtype)
        if rows is None:
            return None
        full = torch.cat([compressed[:, :, : total - new], rows.unsqueeze(1)], dim=2)
        if self.cache is not None:  # later chunks and decode steps read the edited rows too
            self.cache.layers[self.layer].compressed_kv["compressor"] = full[:, 0]
        return full, bias


def _module_site(model: nn.Module, point: HookPoint, fns: list[HookFn], run: HookRun, n_heads: int) -> Any:
    """Register the torch hook of one module site (:data:`.sites.MODULE_SITES`); return its handle."""
    path, handle = MODULE_SITES[point.site]
    get, put = module_view(point.site, n_heads)
    return module_hook(model.get_submodule(path.format(l=point.layer)), handle, get, put,
                       lambda t: run.hooks(point, fns, t)[0])


@contextmanager
def torch_sites(
    model: nn.Module,
    points: dict[str, HookPoint],
    resolved: dict[str, list[HookFn]],
    run: HookRun,
    *,
    skip: frozenset[str] = frozenset(),
    record_topk: dict[int, Tensor] | None = None,
    topk_layers: tuple[int, ...] = (),
    record_fragile: dict[int, tuple[int, int]] | None = None,
) -> Iterator[None]:
    """Install the hooks of ``resolved`` (except sites in ``skip``) for the forwards inside the block.

    ``record_topk``: a dict that receives the indexer picks ``[B, n, k]`` of ``topk_layers``;
    ``record_fragile``: one that receives their :func:`fragile_picks` counts.
    """
    handles: list[Any] = []
    with ExitStack() as stack:
        stack.callback(remove_all, handles)  # registered first, so it runs last, even if installing fails
        config = model.config
        per_layer: dict[int, dict[str, tuple[HookPoint, list[HookFn]]]] = {}
        for name, fns in resolved.items():
            point = points[name]
            if point.site in skip:
                continue
            if point.site in COMPRESSOR_SITES or point.site in PATTERN_SITES:
                per_layer.setdefault(point.layer, {})[point.site] = (point, fns)
            else:
                handles.append(_module_site(model, point, fns, run, int(config.num_attention_heads)))
        taps = {}
        for layer, site_fns in per_layer.items():
            attn = model.model.layers[layer].self_attn
            comp = None
            if attn.compressor is not None:
                comp = CompressorTap(
                    attn.compressor, layer, {s: v for s, v in site_fns.items() if s in COMPRESSOR_SITES}, run
                )
                comp.install(handles)
            patterns = {s: v for s, v in site_fns.items() if s in PATTERN_SITES}
            if patterns:
                taps[id(attn)] = _pattern_tap(patterns, comp, run, int(config.sliding_window))
        for layer in topk_layers if record_topk is not None else ():
            indexer = model.model.layers[layer].self_attn.compressor.indexer
            handles.append(indexer.register_forward_hook(_recorder(record_topk, layer)))
        eps = float(torch.finfo(model.get_input_embeddings().weight.dtype).eps)
        for layer in topk_layers if record_fragile is not None else ():
            indexer = model.model.layers[layer].self_attn.compressor.indexer
            handles.append(indexer.scorer.register_forward_hook(_fragile_recorder(record_fragile, layer, indexer, run, eps)))
        if taps:
            stack.enter_context(attention_tap(taps))
        yield


def _pattern_tap(
    patterns: dict[str, tuple[HookPoint, list[HookFn]]], comp: CompressorTap | None, run: HookRun, window: int
):
    def tap(module: nn.Module, query: Tensor, key: Tensor, mask: Tensor | None, scaling: float) -> None:
        s = split(
            query,
            key,
            mask,
            module.sinks,
            scaling,
            n_entries=comp.n_entries if comp is not None else 0,
            query_start=run.query_start,
            window=window,
        )
        for site, value in (("pattern_local", s.local), ("pattern_entry", s.entry), ("pattern_sink", s.sink)):
            if site in patterns:
                point, fns = patterns[site]
                run.hooks(point, fns, value)

    return tap


def _recorder(store: dict[int, Tensor], layer: int) -> Callable:
    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> None:
        store[layer] = out.detach().clone()

    return hook


def fragile_picks(scores: Tensor, start: int, rate: int, k: int, eps: float) -> tuple[int, int]:
    """``(fragile, picks)``: of the top-``k`` picks of the query rows whose ``k`` is binding, how many score
    within ``eps / 2`` (relative; one unit in the last place of the model dtype at least) of the best entry
    left out, so that a rounding-sized change of the scores could swap them.

    ``scores``: the indexer scorer's ``[B, n, E]`` for the rows at slots ``start..start+n-1``; a row sees the
    entries ``j < (slot + 1) // rate``, as the indexer's own mask says.
    """
    B, n, E = scores.shape
    visible = (torch.arange(start, start + n, device=scores.device) + 1) // rate  # [n]
    rows = visible > k
    if not bool(rows.any()):
        return 0, 0
    future = torch.arange(E, device=scores.device)[None, :] >= visible[rows][:, None]
    s = scores[:, rows].float().masked_fill(future, float("-inf"))
    top = s.topk(k + 1, dim=-1).values  # [B, r, k + 1]
    cut = top[..., k:]
    close = top[..., :k] <= cut + cut.abs() * (eps / 2)
    return int(close.sum()), close.numel()


def _fragile_recorder(store: dict[int, tuple[int, int]], layer: int, indexer: nn.Module, run: HookRun,
                      eps: float) -> Callable:
    def hook(_m: nn.Module, _args: tuple, out: Tensor) -> None:
        with torch.no_grad():
            store[layer] = fragile_picks(out, run.query_start, int(indexer.compress_rate),
                                         int(indexer.index_topk), eps)

    return hook
