"""The compressed transformer's query-suffix engine: many per-head interventions at the query position for
little more than one forward (the shared parts are in :mod:`phaselens.runtime.engines`).

An intervention on ``z`` at the query position changes nothing at earlier positions. So the engine runs
the clean prefix once into a :class:`~phaselens.models.CompressedKVCache`, and for each *cell* (a set of
heads with replacement values at one layer) re-runs only the query position through the layers at and
above the intervened one, reading the frozen prefix cache. Many cells share one batched pass.

One subtlety: at the boundary phase the entry that completes at the query pools the query's own token.
The engine recomputes it in every layer above the intervened one, because the query step goes through the
same streaming compressor as decoding does (it reads the open block's projections from the cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from phaselens.models.compressed.cache import CompressedKVCache, LayerCache
from phaselens.models.compressed.compressor import PoolerState
from phaselens.models.hooking import query_start
from phaselens.runtime.engines import Cell, run_by_layer


def _state_tensors(st: PoolerState) -> tuple[Tensor | None, ...]:
    return (st.cur_payload, st.prev_payload, st.cur_logit, st.prev_logit)


class FrozenPast:
    """A read-only view of one layer's prefix cache, repeated ``copies`` times along the batch.

    Implements the attention ``Past`` protocol without writing: new rows are concatenated, never stored.
    """

    def __init__(self, layer: LayerCache, start: int, copies: int) -> None:
        self.start = start
        self._copies = copies
        R = layer.ring
        device = layer.raw_k.device
        if layer.kind == "full":
            idx = torch.arange(start, device=device)
        else:
            idx = torch.arange(max(0, start - R), start, device=device) % max(R, 1)
        self._raw_k = self._rep(layer.raw_k.index_select(1, idx))
        self._raw_v = None if layer.raw_v is None else self._rep(layer.raw_v.index_select(1, idx))
        # head-major [copies * B, Hkv, E, d], as the cache stores them
        self._entries = {p: self._rep(s[:, :, : layer.n_entries[p]]) for p, s in layer.entry_store.items()}
        self._states = {
            p: PoolerState(*(self._rep(t) if t is not None else None for t in _state_tensors(st)))
            for p, st in layer.states.items()
        }

    def _rep(self, t: Tensor) -> Tensor:
        return t.repeat(self._copies, *([1] * (t.dim() - 1)))

    def raw_context(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys = torch.cat([self._raw_k, k], 1)
        values = keys if self._raw_v is None else torch.cat([self._raw_v, v], 1)
        return keys, values

    def entries(self, path: str, new: Tensor) -> Tensor:
        return torch.cat([self._entries[path], new.transpose(1, 2)], 2).transpose(1, 2)

    def pooler_state(self, path: str) -> PoolerState | None:
        return self._states[path] if self.start > 0 else None

    def set_pooler_state(self, path: str, state: PoolerState) -> None:
        pass


class SuffixEngine:
    """Clean prefix once; per-cell query passes from the intervened layer up.

    Args:
        model: a :class:`~phaselens.models.CompressedTransformer`.
        tokens: ``[N, T]`` items that share one query position ``query_pos`` (slot ``q``).
    """

    def __init__(self, model: Any, tokens: Tensor, query_pos: int, *, rows_per_pass: int = 4096) -> None:
        self.model = model
        self.q = int(query_pos)
        self.rows_per_pass = rows_per_pass
        self._frozen: dict[tuple[int, int], FrozenPast] = {}
        tokens = model.to_tokens(tokens)
        self.N = tokens.shape[0]
        self.query_tokens = tokens[:, self.q : self.q + 1]
        with torch.no_grad():
            self.cache = CompressedKVCache(model, self.N, self.q + 1)
            if self.q > 0:
                model(tokens[:, : self.q], cache=self.cache)
            self.resid_pre, self.clean_z, self.clean_logits = self._clean_step()

    @torch.no_grad()
    def _clean_step(self) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Query-position residuals into each block ``[N, 1, D]``, per-head z ``[N, H, d]``, clean logits ``[N, V]``."""
        model = self.model
        resid = model.hook_embed(model.embed(self.query_tokens))
        resid_pre, zs = [], []
        for i, block in enumerate(model.blocks):
            resid_pre.append(resid)
            grab: list[Tensor] = []

            def keep(z: Tensor, hook: Any, _out: list[Tensor] = grab) -> None:
                _out.append(z[:, 0].clone())

            with model.hooks(fwd_hooks=[(f"blocks.{i}.attn.hook_z", keep)]), query_start(self.q):
                resid = block(resid, FrozenPast(self.cache.layers[i], self.q, 1))
            zs.append(grab[0])
        logits = model.unembed(model.ln_final(resid))[:, 0]
        return resid_pre, zs, logits

    @torch.no_grad()
    def run(self, cells: Sequence[Cell], *, progress: Any = None) -> Tensor:
        """Logits at the query position under each cell: ``[C, N, V]``."""
        per_pass = max(1, self.rows_per_pass // max(1, self.N))
        return run_by_layer(cells, lambda _layer: per_pass, self._pass, progress)

    def _past(self, layer: int, copies: int) -> FrozenPast:
        key = (layer, copies)
        if key not in self._frozen:  # repeated prefix views are reused by every pass of this width
            self._frozen = {k: v for k, v in self._frozen.items() if k[1] == copies}
            self._frozen[key] = FrozenPast(self.cache.layers[layer], self.q, copies)
        return self._frozen[key]

    def _pass(self, layer: int, cells: Sequence[Cell]) -> Tensor:
        model, N = self.model, self.N
        C = len(cells)
        H, d = model.cfg.n_heads, model.cfg.d_head
        mask = torch.zeros(C, H, dtype=torch.bool)
        repl = torch.zeros(C, N, H, d, dtype=self.clean_z[layer].dtype, device=self.clean_z[layer].device)
        for c, cell in enumerate(cells):
            heads = list(cell.heads)
            mask[c, heads] = True
            if cell.replacement is not None:
                r = cell.replacement.to(device=repl.device, dtype=repl.dtype)
                repl[c][:, heads] = r if r.dim() == 3 else r.expand(N, -1, -1)
        device = self.clean_z[layer].device
        mask_rows = mask.repeat_interleave(N, 0)[:, None, :, None].to(device)  # [C*N, 1, H, 1]
        repl_rows = repl.reshape(C * N, 1, H, d).to(device)

        def intervene(z: Tensor, hook: Any) -> Tensor:
            return torch.where(mask_rows, repl_rows, z)

        resid = self.resid_pre[layer].repeat(C, 1, 1)
        with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_z", intervene)]), query_start(self.q):
            for i in range(layer, len(model.blocks)):
                resid = model.blocks[i](resid, self._past(i, C))
        return model.unembed(model.ln_final(resid))[:, 0].view(C, N, -1)
