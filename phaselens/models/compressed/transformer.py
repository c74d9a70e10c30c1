"""``CompressedTransformer``: a hookable decoder-only transformer with a chunk-compressed KV cache.

It subclasses TransformerLens's ``HookedRootModule``, so ``run_with_hooks``, ``run_with_cache`` and
TransformerLens's ``patching`` functions work on it. Hook names follow TransformerLens
(``blocks.{l}.hook_resid_pre``, ``blocks.{l}.attn.hook_z``, ...) plus the compressed-cache hooks
documented in ``docs/hooks.md``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, SupportsInt

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from phaselens.contract.hooknames import HookPoint as SitePoint
from phaselens.core.checks import as_int
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import InputError
from phaselens.models.compressed.attention import NoPast, Past
from phaselens.models.compressed.block import Block
from phaselens.models.compressed.compressor import default_init_
from phaselens.models.compressed.config import CompressedConfig
from phaselens.models.compressed.sites import zoo_hook_points
from phaselens.models.compressed.sizing import check_forward, check_weights
from phaselens.models.parts.chunks import plan_chunks
from phaselens.models.parts.hooking import ContextHooks, query_start
from phaselens.models.parts.kind_model import KindModel
from phaselens.models.parts.norms import RMSNorm
from phaselens.models.parts.suffix_engine import SlotEngine
from phaselens.models.parts.tl_split_qkv import FlatSplitQKV
from phaselens.models.parts.tl_weights import TLModelWeights, stacked
from phaselens.models.parts.tokens import check_tokens

if TYPE_CHECKING:
    from phaselens.models.compressed.cache import CompressedKVCache


class CompressedTransformer(KindModel, FlatSplitQKV, TLModelWeights, ContextHooks, HookedRootModule):
    """A decoder-only transformer whose compressed layers attend to a local window plus pooled entries.

    Args:
        cfg: the :class:`CompressedConfig`. ``cfg.compression=None`` builds the full-attention control.

    Example:
        >>> import torch, phaselens
        >>> from phaselens.models import CompressedConfig, CompressorSpec
        >>> cfg = CompressedConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=50,
        ...                        n_ctx=128, local_window=8, compression=CompressorSpec(stride=4))
        >>> model = phaselens.models.CompressedTransformer(cfg)
        >>> model(torch.zeros(1, 10, dtype=torch.long)).shape
        torch.Size([1, 10, 50])
    """

    name: str = ""

    def __init__(self, cfg: CompressedConfig) -> None:
        check_weights(cfg)  # priced before any parameter exists: ResourceError naming the sizes that fit
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.hook_embed = HookPoint()
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.ln_final = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        if cfg.tie_embeddings:
            self.unembed.weight = self.embed.weight  # one parameter, [d_vocab, d_model] in both roles
        self.metadata: dict[str, Any] = {}
        self._metadata: dict[str, Any] = {}  # analysis_metadata: nothing beyond the model's name
        self.name = "CompressedTransformer"  # what results call the model (the zoo sets its name)
        if self.embed.weight.device.type != "meta":  # on the meta device (size planning) there is nothing to fill
            generator = torch.Generator().manual_seed(cfg.seed)
            default_init_(self, cfg.init_std, generator)
        self.setup()
        self.eval()

    @property
    def hook_sites(self) -> dict[str, SitePoint]:
        """Every hook name with its :class:`~phaselens.contract.hooknames.HookPoint` (shape, read-only or not), from
        the kind's table (:mod:`phaselens.models.compressed.sites`)."""
        return zoo_hook_points([b.attn.kind for b in self.blocks], [b.attn.tied for b in self.blocks],
                               self.config.mlp == "swiglu")

    # ---- TransformerLens-shaped weights, stacked (blocks[l].attn.W_* are the per-layer views) ------------
    W_Q = stacked("attn.W_Q", "[n_layers, n_heads, d_model, d_head]",
                  "Applied to the RMS-normed residual, before RoPE; with ``cfg.qk_norm`` the per-head "
                  "RMSNorm ``q_norm`` follows, so ``hook_q`` is not ``x @ W_Q``.")
    W_K = stacked("attn.W_K", "[n_layers, n_heads, d_model, d_head]",
                  "KV heads repeated over their query heads (GQA, KV-major as TransformerLens repeats them), "
                  "before RoPE; W_KV on tied K=V layers.")
    W_V = stacked("attn.W_V", "[n_layers, n_heads, d_model, d_head]",
                  "KV heads repeated to ``n_heads``; W_KV on tied K=V layers, where RoPE is undone at z.")
    W_O = stacked("attn.W_O", "[n_layers, n_heads, d_head, d_model]",
                  '``hook_attn_out = einsum("bnhd,hdm->bnm", hook_z, W_O[l])`` (no bias).')
    W_in = stacked("mlp.W_in", "[n_layers, d_model, d_mlp]")
    W_out = stacked("mlp.W_out", "[n_layers, d_mlp, d_model]")

    @property
    def W_gate(self) -> Float[Tensor, "n_layers d_model d_mlp"]:
        """The gate weights of a SwiGLU MLP (``cfg.mlp="swiglu"``)."""
        if self.config.mlp != "swiglu":
            raise AttributeError("W_gate exists only for a gated MLP (cfg.mlp='swiglu').")
        return torch.stack([b.mlp.W_gate for b in self.blocks])

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.weight

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """Unembedding as TransformerLens shapes it (the transpose of ``unembed.weight``)."""
        return self.unembed.weight.T

    # TransformerLens habits (phaselens.models.parts.tl_habits reads these)
    @property
    def tl_norm(self) -> tuple[str, float]:
        """Every norm is an RMSNorm of ``cfg.norm_eps`` (ln1, ln2, ln_final)."""
        return ("RMS", self.config.norm_eps)

    def _unembed_directions(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.W_U * self.ln_final.weight[:, None]

    # ---- protocol ------------------------------------------------------------------------------------
    @property
    def cfg(self) -> CompressedConfig:
        """The config, with ``device`` reporting where the parameters are now (TransformerLens reads it)."""
        device = str(self.unembed.weight.device)
        if self.config.device != device:
            self.config = dataclasses.replace(self.config, device=device)
        return self.config

    @property
    def phase_specs(self) -> list[PhaseSpec | None]:
        """Per-layer geometry (``None`` for layers that do not compress)."""
        return self.config.phase_specs()

    @property
    def analysis_spec(self) -> PhaseSpec:
        """The geometry used to define phases: the smallest compressed stride (stride 1 for the control)."""
        specs = [s for s in self.phase_specs if s is not None]
        return min(specs, key=lambda s: s.stride) if specs else PhaseSpec(1)

    def _weights_at(self) -> tuple[torch.dtype, torch.device]:
        w = self.unembed.weight
        return w.dtype, w.device

    # ---- capabilities (see phaselens.contract.protocol.CAPABILITIES) -------------------------------------------
    def _slot_engine(self) -> type[SlotEngine]:
        """The query-suffix engine (:mod:`.engine`); hooks active on the model run in its passes too."""
        from phaselens.models.compressed.engine import SuffixEngine

        return SuffixEngine

    def cycle_gates(self, delta: int) -> CompressedTransformer:
        """A copy whose offset-specific gate parameters are rolled by ``delta`` (see
        :func:`phaselens.analyses.cycling.cycle_gates`)."""
        from phaselens.models.compressed.gate_cycling import roll_offset_gates

        return roll_offset_gates(self, delta)

    def to_tokens(self, tokens: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Token ids as a ``[batch, pos]`` long tensor. Text (a string, or a list of strings of one token count)
        is encoded by the model's tokenizer with its BOS (the zoo's: id N is the word ``tN``); without a
        tokenizer, text is an error."""
        texts = [tokens] if isinstance(tokens, str) else tokens
        if isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
            if self.__dict__.get("_tl_tokenizer") is None:
                raise InputError("this CompressedTransformer has no tokenizer; set model.tokenizer = tok, or pass "
                                 "token ids as a [batch, pos] tensor.")
            ids = [self.tokenizer(t)["input_ids"] for t in texts]
            if len({len(i) for i in ids}) > 1:
                raise InputError(f"the texts encode to {sorted({len(i) for i in ids})} tokens; pass texts of one "
                                 "length (phaselens never pads on the left: it would move every token's phase).")
            tokens = ids
        return self._check_tokens(torch.as_tensor(tokens))

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        return check_tokens(tokens, vocab=self.config.d_vocab, device=self.unembed.weight.device)

    # ---- forward -------------------------------------------------------------------------------------
    def forward(
        self,
        tokens: Tensor,
        *,
        cache: CompressedKVCache | None = None,
        return_type: Literal["logits", "loss", "both", None] = "logits",
        logits: Literal["all", "query"] = "all",
        query_len: SupportsInt | None = None,
        targets: Tensor | None = None,
        reduction: Literal["mean", "sum"] = "mean",
    ) -> Any:
        """Logits ``[batch, pos, d_vocab]`` for token ids ``tokens`` ``[batch, pos]`` (or ``[pos]``).

        Ids are validated here (an ``InputError`` names the problem), so the annotation is a plain Tensor.

        With ``cache``, ``tokens`` continue the cached sequence at slot ``cache.length`` and the cache is
        advanced; the logits equal those of a parallel forward over the whole sequence.

        With ``logits="query"`` only the last ``query_len`` rows are unembedded: ``[batch, query_len, d_vocab]``
        (the analyses score query rows only, and the unembedding is most of a small model's cost).

        With ``targets`` ``[batch, pos]`` (``targets[b, t]`` is the token to predict from position t, -100 where
        no loss is taken, as :class:`~phaselens.tasks.lm_batches.TrainingBatch` holds them) and
        ``return_type="loss"``, the fp32 cross-entropy over the targeted positions (``reduction`` ``"mean"`` or
        ``"sum"``); only those rows are unembedded (a task trains a few positions of every sequence).
        """
        if logits not in ("all", "query"):
            raise InputError(f"logits must be 'all' or 'query', got {logits!r}.")
        if targets is not None and (return_type != "loss" or logits != "all" or reduction not in ("mean", "sum")
                                    or not isinstance(targets, Tensor) or targets.shape != getattr(tokens, "shape", None)):
            raise InputError("targets= needs return_type='loss', reduction 'mean' or 'sum', and a tensor shaped like "
                             "tokens [batch, pos].")
        tokens = self._check_tokens(tokens)
        B, n = tokens.shape  # both >= 1: checked before the cache is touched, so the cache stays usable
        if cache is None and n > self.config.n_ctx:
            raise InputError(f"sequence of {n} tokens exceeds the model's context n_ctx={self.config.n_ctx}; "
                             "shorten it or build the model with a larger n_ctx.")
        if cache is not None:
            cache.check_model(self)
        rows = n if logits == "all" and targets is None else 1  # a lower bound of the unembedded rows
        check_forward(self, B, n, 0 if cache is None else cache.length, rows)
        pasts: list[Past] = [NoPast() for _ in self.blocks] if cache is None else cache.begin(tokens)
        with query_start(0 if cache is None else cache.length):
            resid = self.hook_embed(self.embed(tokens))
            for block, past in zip(self.blocks, pasts):
                resid = block(resid, past)
        if cache is not None:
            cache.end(n)
        if logits == "query":
            if return_type != "logits":
                raise InputError("logits='query' returns logits only; use return_type='logits'.")
            q = n if query_len is None else as_int("query_len", query_len, minimum=1, maximum=n)
            resid = resid[:, n - q :]
        if return_type is None:
            return None
        if targets is not None:
            targets = targets.to(resid.device).reshape(B, n)
            keep = targets != -100
            out = self.unembed(self.ln_final(resid[keep]))
            return F.cross_entropy(out.float(), targets[keep], reduction=reduction)
        out = self.unembed(self.ln_final(resid))
        if return_type == "logits":
            return out
        loss = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1))
        return loss if return_type == "loss" else (out, loss)

    def new_cache(self, batch_size: SupportsInt = 1, max_len: SupportsInt | None = None, *,
                  batch: SupportsInt | None = None) -> CompressedKVCache:
        """An empty :class:`~phaselens.models.compressed.cache.CompressedKVCache` for ``batch_size`` sequences of up to
        ``max_len`` tokens (default ``n_ctx``; ``batch`` is another name of ``batch_size``). Both must be positive
        ints (numpy ints too), else a :class:`~phaselens.errors.CacheError`; a cache larger than the memory
        available is a :class:`~phaselens.errors.ResourceError` naming the sizes that fit."""
        from phaselens.models.compressed.cache import CompressedKVCache

        if batch is not None:
            batch_size = batch
        return CompressedKVCache(self, batch_size, self.config.n_ctx if max_len is None else max_len)

    @torch.no_grad()
    def generate(
        self, tokens: Int[Tensor, "batch pos"], max_new_tokens: int, *, prefill_chunk: SupportsInt | None = None,
        verbose: bool = False, **tl_options: Any,
    ) -> Int[Tensor, "batch pos_plus_new"]:
        """Greedy decoding through the compressed cache; returns prompt + new tokens (``verbose``: a progress
        bar; TransformerLens's sampling options are refused by name)."""
        if tl_options:  # TransformerLens's options a greedy decoder cannot honour (sampling, stop tokens, ...)
            raise InputError(f"generate() decodes greedily and takes tokens, max_new_tokens, prefill_chunk and "
                             f"verbose; {sorted(tl_options)} are not supported (sample from the returned logits "
                             "yourself).")
        tokens = self._check_tokens(tokens)
        cache = self.new_cache(tokens.shape[0], tokens.shape[1] + max_new_tokens)
        logits = self.prefill(tokens, cache, chunk=prefill_chunk)
        out = [tokens]
        from tqdm.auto import tqdm

        for _ in tqdm(range(max_new_tokens), disable=not verbose, desc="generate"):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            logits = self(nxt, cache=cache)
        return torch.cat(out, dim=1)

    def prefill(
        self, tokens: Int[Tensor, "batch pos"], cache: CompressedKVCache, *, chunk: SupportsInt | None = None
    ) -> Float[Tensor, "batch 1 d_vocab"]:
        """Feed ``tokens`` through ``cache`` in chunks of ``chunk`` tokens (a positive int; ``None``: one piece)
        with bounded memory; return the last position's logits."""
        tokens = self._check_tokens(tokens)
        T = tokens.shape[1]
        plan_chunks(max(T, 1), chunk, None)  # a bad chunk is refused first
        # pieces of chunk tokens from the start, the last one the rest (one piece without a chunk)
        plan = plan_chunks(T, chunk, None if chunk is None else T - (T - 1) // int(chunk) * int(chunk))
        logits = None
        for start, stop in plan.calls:
            logits = self(tokens[:, start:stop], cache=cache)[:, -1:]
        assert logits is not None
        return logits

    # ---- persistence ---------------------------------------------------------------------------------
    def save(self, path: Any, *, metadata: dict[str, Any] | None = None, overwrite: bool = False) -> None:
        """Write ``model.safetensors`` and ``config.json`` (+ ``card.json`` from ``metadata``) into the directory
        ``path``, atomically.

        A directory holding other files is refused (:class:`~phaselens.errors.OutputError`) unless
        ``overwrite=True``, which replaces only the checkpoint's own files and keeps the rest.
        """
        from phaselens.models.compressed.io import save_model

        save_model(self, path, metadata=metadata, overwrite=overwrite)

    def __repr__(self) -> str:
        c = self.config
        kinds = [b.attn.kind for b in self.blocks]
        comp = c.compression
        geo = "full attention (control)" if comp is None else (
            f"S={comp.stride} W={comp.window} gate={comp.gate}{' overlap_split' if comp.overlap_split else ''}"
            f"{' tied K=V' if comp.tied_kv else ''}"
        )
        n_params = sum(p.numel() for p in self.parameters())
        return (
            f"CompressedTransformer({c.n_layers} layers {kinds}, d_model={c.d_model}, heads={c.n_heads}"
            f"/{c.n_key_value_heads} kv, d_head={c.d_head}, local_window={c.local_window}, {geo}, "
            f"{n_params:,} params)"
        )
