"""``DeepSeekV41``: phaselens' own implementation of the DeepSeek-V4.1 text model.

A TransformerLens ``HookedRootModule``: ``run_with_hooks``, ``run_with_cache``, ``hooks(...)`` and ``hook_dict``
work as on :class:`~phaselens.models.CompressedTransformer`. Hook names and shapes follow the DeepSeek-V4
adapter (``docs/hooks.md``, ``docs/deepseek_v41.md``): residual hooks carry the ``hc_mult`` hyper-connection
streams ``[B, n, hc, D]``.

Hyper-connections as in V4.1's reference (they differ from V4): each sublayer's mixing coefficients are
computed from the streams it sees, but its ``pre`` (collapse) weights are used by the *next* sublayer. So a
block's attention collapses its input with the ``pre`` that the previous block's FFN mix produced (one-hot on
stream 0 before the first block), its FFN with the ``pre`` of its own attention mix, and the final collapse
before the norm and head uses the last FFN mix's ``pre``.

Engram (:mod:`.engram`): before each layer of ``engram_layer_ids`` the streams get a gated n-gram table lookup,
so that layer's ``hook_resid_pre`` already holds it (the streams before it are the previous layer's
``hook_resid_post``). The n-gram hashes of a call are computed once (:mod:`.engram_hash`) from the token ids
and, when decoding, the cache's last ``max_ngram - 1`` compressed ids.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from phaselens.contract.hooknames import HookPoint as SitePoint
from phaselens.contract.strides import check_stride
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import CheckpointError, InputError
from phaselens.models.deepseek_v41.block import Block
from phaselens.models.deepseek_v41.cache import StackRuntime, V41Cache
from phaselens.models.deepseek_v41.config import V41Config
from phaselens.models.deepseek_v41.device_maps import input_device
from phaselens.models.deepseek_v41.engram_hash import (
    EngramLayout,
    NgramHasher,
    compressed_token_map,
    history_after,
)
from phaselens.models.deepseek_v41.kernels import Kernels
from phaselens.models.deepseek_v41.layers import Numerics, Quantize, hc_pre
from phaselens.models.deepseek_v41.sites import v41_hook_points
from phaselens.models.parts.chunks import plan_chunks
from phaselens.models.parts.dtypes import compute_dtype, dtype_name
from phaselens.models.parts.hooking import ContextHooks, query_start, silent_hooks
from phaselens.models.parts.index_topk import IndexTopKWarning
from phaselens.models.parts.kind_model import KindModel
from phaselens.models.parts.norms import RMSNorm
from phaselens.models.parts.suffix_engine import SlotEngine
from phaselens.models.parts.tl_factored import HyperConnectionModel
from phaselens.models.parts.tl_habits import HYPER_CONNECTION_LIMITS, TLConfig, tokenizer_from_dir
from phaselens.models.parts.tokens import check_tokens

_UNSET = object()


@dataclass(frozen=True, kw_only=True)
class V41Cfg(TLConfig):
    """TransformerLens-style names the analyses read (a :class:`~phaselens.models.parts.tl_habits.TLConfig` plus V4.1's
    own fields; ``n_key_value_heads = 1``: one K = V latent)."""

    hc_mult: int
    local_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    index_topk: int | str
    rope_dims: int
    engram_layer_ids: tuple[int, ...] = ()


class DeepSeekV41(KindModel, HyperConnectionModel, ContextHooks, HookedRootModule):
    """The DeepSeek-V4.1 text model with Engram (no vision tower, no draft layers).

    Build it with :func:`phaselens.models.deepseek_v41.load_v41` (``phaselens.load("hf:DIR")``).

    Args:
        config: the parsed :class:`V41Config`.
        dtype: parameter dtype (``torch.bfloat16`` as the reference, or ``torch.float32``).
        quantize: ``None``, ``"kv"`` or ``"fp8"`` (see :class:`~phaselens.models.deepseek_v41.layers.Numerics`).
        index_topk: ``None`` (the config's), an int, or ``"all"`` (every visible entry; lifts the candidate filter).
        analysis_stride: the stride that defines phases (default: the smallest compression ratio >= 2).
        engram: ``"run"`` (Engram at the config's layers, as the reference) or ``"drop"`` (built without it: an
            ablation). Running it needs the tokenizer: :meth:`set_engram_tokenizer` (``load_v41`` calls it).
        kernels: how GEMMs on packed weights run (:mod:`~phaselens.models.deepseek_v41.kernels`).
        chunk: prefill in pieces of this many tokens (see :meth:`forward`); needed at long context.
    """

    tl_limits = HYPER_CONNECTION_LIMITS  # what TransformerLens's residual methods cannot mean here, and why

    def __init__(self, config: V41Config, *, dtype: torch.dtype = torch.bfloat16, quantize: Quantize = None,
                 index_topk: int | str | None = None, analysis_stride: int | None = None,
                 metadata: dict[str, Any] | None = None, engram: str = "run", kernels: Kernels = "auto",
                 chunk: int | None = None) -> None:
        super().__init__()
        if engram not in ("run", "drop"):
            raise InputError(f"engram must be 'run' or 'drop', got {engram!r}.")
        if quantize not in (None, "kv", "fp8"):
            raise InputError(f"quantize must be None, 'kv' or 'fp8', got {quantize!r}.")
        if index_topk == "all":
            topk: int | None = None
        elif index_topk is None:
            topk = config.index_topk
        elif isinstance(index_topk, int) and not isinstance(index_topk, bool) and index_topk >= 1:
            topk = index_topk
        else:
            raise InputError(f"index_topk must be None, a positive int or 'all', got {index_topk!r}.")
        self.config, self.numerics, self.default_task = config, Numerics(quantize, kernels), None
        self.chunk = chunk
        self.roles = config.topology()
        self._index_topk = topk
        D, V, ct = config.hidden_size, config.vocab_size, compute_dtype(dtype)
        self.embed = nn.Embedding(V, D, dtype=dtype)
        self.hook_embed = HookPoint()
        self.engram_layout = EngramLayout.from_config(config) if config.engram_layer_ids and engram == "run" else None
        self.engram_hasher: NgramHasher | None = None  # needs the tokenizer: set_engram_tokenizer
        self.blocks = nn.ModuleList([Block(config, r, self.numerics, dtype, topk, self.engram_layout)
                                     for r in self.roles])
        self.norm = RMSNorm(D, config.rms_norm_eps, dtype)
        self.head = nn.Linear(D, V, bias=False, dtype=ct)
        strides = sorted({r.ratio for r in self.roles if r.ratio >= 2})
        if analysis_stride is not None:  # the one rule for strides (phaselens.contract.strides)
            analysis_stride = check_stride(analysis_stride, strides, option="analysis_stride",
                                           what="this DeepSeek-V4.1 model")
        self._stride = analysis_stride or (strides[0] if strides else 1)
        self._metadata: dict[str, Any] = dict(metadata or {})
        self._warned: set[str] = set()
        self.setup()
        self.eval()

    # ---- the model contract ------------------------------------------------------------------------
    @property
    def hook_sites(self) -> dict[str, SitePoint]:
        """Every hook name with its :class:`~phaselens.contract.hooknames.HookPoint` (shape, read-only or not), from
        the kind's table (:mod:`phaselens.models.deepseek_v41.sites`)."""
        return v41_hook_points(self.roles, () if self.engram_layout is None else self.engram_layout.layer_ids)

    @property
    def name(self) -> str:
        return self.config.name or "deepseek_v41"

    @property
    def cfg(self) -> V41Cfg:
        c = self.config
        return V41Cfg(
            n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads, n_key_value_heads=1, d_head=c.head_dim,
            d_model=c.hidden_size, d_vocab=c.vocab_size, n_ctx=c.max_position_embeddings,
            device=self.embed.weight.device, dtype=self.embed.weight.dtype,
            hc_mult=c.hc_mult, local_window=c.sliding_window, compress_ratios=c.compress_ratios,
            kv_source_layer_ids=c.kv_source_layer_ids, index_source_layer_ids=c.index_source_layer_ids,
            candidate_source_layer_id=c.candidate_source_layer_id,
            index_topk="all" if self._index_topk is None else self._index_topk, rope_dims=c.qk_rope_head_dim,
            engram_layer_ids=() if self.engram_layout is None else self.engram_layout.layer_ids,
        )

    @property
    def phase_specs(self) -> list[PhaseSpec | None]:
        """``PhaseSpec(r)`` for layers of ratio ``r >= 2``; ``None`` for ratio-1 and sliding layers (no phase)."""
        return [PhaseSpec(r.ratio) if r.ratio >= 2 else None for r in self.roles]

    @property
    def analysis_spec(self) -> PhaseSpec:
        """``PhaseSpec(analysis_stride)`` (2 for V4.1), origin 0: BOS and any template count as slots."""
        return PhaseSpec(self._stride)

    def _weights_at(self) -> tuple[torch.dtype, torch.device]:
        return self.embed.weight.dtype, input_device(self)  # the embedding may be offloaded

    @property
    def returns_query_logits(self) -> bool:
        """Analyses ask for the query rows' logits only: all ``[B, T, 129280]`` rows would not fit at length."""
        return True

    @property
    def sharing(self) -> dict[int, dict[str, int | None]]:
        """Per compressed layer: the layers whose compressed KV and indexer picks it reads."""
        return {r.layer: {"kv_source": r.kv_source, "index_source": r.index_source} for r in self.roles if r.compressed}

    @property
    def analysis_metadata(self) -> dict[str, Any]:
        """What a result must carry to be read correctly (a copy)."""
        c = self.config
        md = {
            "model": self.name, "architecture": "deepseek_v41", "analysis_stride": self._stride,
            "geometry": {str(i): (f"PhaseSpec({s.stride})" if s else None) for i, s in enumerate(self.phase_specs)},
            "kv_source_layer_ids": list(c.kv_source_layer_ids), "index_source_layer_ids": list(c.index_source_layer_ids),
            "candidate_source_layer_id": c.candidate_source_layer_id,
            "dtype": dtype_name(self.cfg.dtype), "numerics": "reference", "quantize": self.numerics.quantize,
            "index_topk": self.cfg.index_topk, "index_topk_binding": False, "candidate_filter_binding": False,
            "model_modified": False, "modifications": [],
        }
        md.update(self._metadata)
        if self._index_topk is None or self._index_topk != c.index_topk:
            md["model_modified"] = True
            md["modifications"] = [*md["modifications"], f"index_topk={self.cfg.index_topk} (config: {c.index_topk})"]
        return md

    checkpoint_dir: Any = None  # the directory load_v41 read (its tokenizer is model.tokenizer)

    def _find_tokenizer(self) -> Any:
        return tokenizer_from_dir(self.checkpoint_dir)

    # ---- Engram ------------------------------------------------------------------------------------
    def set_engram_tokenizer(self, tokenizer_json: str | Any) -> None:
        """Build Engram's n-gram hasher from the checkpoint's ``tokenizer.json`` (:mod:`.engram_hash`).

        Raises :class:`CheckpointError` when the tokenizer's compressed vocabulary does not have the config's
        ``engram_compressed_vocab_size`` ids: every hash would then address the wrong rows.
        """
        if self.engram_layout is None:
            return
        token_map, size = compressed_token_map(tokenizer_json)
        want = self.config.engram_compressed_vocab_size
        if size != want:
            raise CheckpointError(
                f"{tokenizer_json} normalizes to {size} distinct tokens but the config's "
                f"engram_compressed_vocab_size is {want}: Engram's hashes derive from that number, so this "
                "tokenizer is not the checkpoint's (or the tokenizers library normalizes differently)."
            )
        device = input_device(self)  # where the token ids go (the embedding may be offloaded)
        self.engram_hasher = NgramHasher(self.engram_layout, token_map, size, self.config.engram_pad_id).to(device)

    def _engram_rows(self, tokens: Tensor, run: V41Cache) -> Tensor | None:
        """Table rows ``[B, n, n_engram_layers, cols]`` of the call; stages the cache's n-gram history."""
        if self.engram_layout is None:
            return None
        if self.engram_hasher is None:
            raise CheckpointError(
                "this model runs Engram but has no tokenizer: call model.set_engram_tokenizer('DIR/tokenizer.json') "
                "or load it with phaselens.load('hf:DIR') from a checkpoint directory holding tokenizer.json."
            )
        ids = self.engram_hasher.compress(tokens)
        history = run.ngram_history if run.ngram_history is not None else ids[:, :0]
        run.stage_ngram_history(history_after(history, ids, self.engram_layout.max_ngram - 1))
        return self.engram_hasher(ids, history)

    # ---- forward -----------------------------------------------------------------------------------
    def new_cache(self, batch_size: int = 1) -> V41Cache:
        """An empty :class:`V41Cache` for ``batch_size`` sequences."""
        return V41Cache(self, batch_size)

    def forward(self, tokens: Tensor, *, cache: V41Cache | None = None,
                logits: Literal["all", "query"] = "all", query_len: int | None = None,
                chunk: int | None | object = _UNSET) -> Tensor:
        """Logits ``[B, n, vocab]`` (fp32) for token ids ``[B, n]`` (or ``[n]``).

        Args:
            cache: continue the cached sequence at slot ``cache.length`` (and advance it).
            logits: ``"query"`` computes only the last ``query_len`` rows' logits (``[B, query_len, vocab]``).
            chunk: without ``cache``, prefill in pieces of this many tokens through a fresh cache, then run the
                query piece (the last ``query_len`` tokens, default ``min(chunk, n)``); hooks fire only for
                the query piece, as in the DeepSeek-V4 adapter. Default: the model's ``chunk`` (``None``: one
                call). Attention then holds ``[B, H, chunk, window + entries]`` scores instead of
                ``[B, H, n, ...]``; logits equal the unchunked ones to float rounding.
        """
        if logits not in ("all", "query"):
            raise InputError(f"logits must be 'all' or 'query', got {logits!r}.")
        tokens = self._check_tokens(tokens)
        chunk = self.chunk if chunk is _UNSET else chunk
        if cache is not None or chunk is None:
            return self._call(tokens, cache, logits, query_len)
        plan = plan_chunks(tokens.shape[1], chunk, query_len)
        run = V41Cache(self, tokens.shape[0])
        kept = []
        with torch.no_grad(), silent_hooks():
            for a, b in plan.prefix:
                kept.append(self._call(tokens[:, a:b], run, "all", None, head=logits == "all"))
        out = self._call(tokens[:, plan.query_start :], run, "all", None)
        return torch.cat([*kept, out], dim=1) if logits == "all" else out

    def _call(self, tokens: Tensor, cache: V41Cache | None, logits: str, query_len: int | None,
              head: bool = True) -> Tensor | None:
        """One forward of ``tokens`` (checked ids) through ``cache`` (``None``: a fresh one); ``head=False``:
        no logits (a prefix piece)."""
        B, n = tokens.shape
        run = cache if cache is not None else V41Cache(self, B)
        run.check(self, B)
        start = run.length
        if start + n > self.config.max_position_embeddings:
            raise InputError(f"{start + n} slots exceed max_position_embeddings={self.config.max_position_embeddings}.")
        q = n if logits == "all" else int(query_len or n)
        if not 1 <= q <= n:
            raise InputError(f"query_len must lie in 1..{n}, got {query_len!r}.")
        rt = StackRuntime()
        try:
            with query_start(start):
                rows = self._engram_rows(tokens, run)
                h = self.hook_embed(self.embed(tokens))
                x = h.unsqueeze(2).repeat(1, 1, self.config.hc_mult, 1)
                pre = torch.zeros(B, n, self.config.hc_mult, dtype=compute_dtype(h.dtype), device=h.device)
                pre[..., 0] = 1.0  # one-hot: the first block's attention reads stream 0
                for block in self.blocks:
                    x, pre = block(x, pre, start, run, rt, rows)
        except BaseException:
            run.discard()
            raise
        run.commit(n)
        self._note_binding(rt, start + n)
        if not head:
            return None
        final = self.norm(hc_pre(x[:, n - q :], pre[:, n - q :]))
        return self.head(final.to(self.head.weight.dtype))  # a module call: a device map's hook sees it

    def _entry_stride(self, name: str, layer: int) -> int | None:
        """Compressor hooks count entries of the layer's own ratio (ratio-1 layers have entries but no phase
        spec); Engram's hook_gate is per token: no entries."""
        return self.roles[layer].ratio if f"blocks.{layer}.attn." in name else None

    def _check_tokens(self, tokens: Any) -> Tensor:
        return check_tokens(tokens, vocab=self.config.vocab_size, device=input_device(self))

    def _note_binding(self, rt: StackRuntime, length: int) -> None:
        what = []
        if rt.topk_binding:
            self._metadata["index_topk_binding"] = True
            what.append(f"index_topk={self._index_topk} dropped visible entries in index-source layers {sorted(rt.topk_binding)}")
        if rt.candidate_binding:
            self._metadata["candidate_filter_binding"] = True
            what.append(f"the candidate filter dropped visible entries in layers {sorted(rt.candidate_binding)}")
        if not what:
            return
        msg = "; ".join(what)
        if msg not in self._warned:
            self._warned.add(msg)
            warnings.warn(IndexTopKWarning(
                f"at length {length}: {msg}. The layers reusing those picks attend to the same subset. Load with "
                "index_topk='all' to keep every visible entry (recorded as a modification of the model)."
            ), stacklevel=3)

    def estimate_memory(self, tokens: int, *, batch: int = 1, query_len: int | None = None,
                        logits: Literal["all", "query"] = "all") -> Any:
        """Bytes of a forward over ``batch`` x ``tokens`` tokens in this model's ``chunk``
        (:func:`~phaselens.models.deepseek_v41.memory.estimate_memory`; a meta-device model will do)."""
        from phaselens.models.deepseek_v41.memory import estimate_memory

        return estimate_memory(self, tokens, batch=batch, chunk=self.chunk, query_len=query_len, logits=logits)

    def _slot_engine(self) -> type[SlotEngine]:
        """:class:`~phaselens.models.deepseek_v41.engine.V41SuffixEngine` (``engine="auto"`` picks it)."""
        from phaselens.models.deepseek_v41.engine import V41SuffixEngine

        return V41SuffixEngine

    def _hooks_active(self) -> bool:
        return any(point.fwd_hooks for point in self.hook_dict.values())

    def __repr__(self) -> str:
        kinds = "".join("S" if r.ratio == 0 else str(r.ratio) for r in self.roles)
        return (f"DeepSeekV41({self.name!r}, layers={kinds}, kv_sources={list(self.config.kv_source_layer_ids)}, "
                f"index_sources={list(self.config.index_source_layer_ids)}, engram={list(self.cfg.engram_layer_ids)}, "
                f"analysis_stride={self._stride}, "
                f"dtype={dtype_name(self.cfg.dtype)}, quantize={self.numerics.quantize})")


__all__ = ["DeepSeekV41", "V41Cfg"]
