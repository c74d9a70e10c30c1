"""``DeepSeekV4Adapter``: transformers' DeepSeek-V4 behind :class:`phaselens.contract.protocol.PhaseModel`.

    adapter = phaselens.from_hf(model)                      # torch hooks (see .construct)
    adapter = phaselens.from_hf(model, backend="nnsight")   # interventions through nnsight
    logits = adapter(tokens)                                # [B, T] -> [B, T, vocab]
    logits = adapter(tokens, chunk=512)                     # chunked prefill; hooks see the last chunk only
    with adapter.hooks(fwd_hooks=[("blocks.2.attn.hook_z", fn)]):
        logits = adapter(tokens)

Hook names and shapes follow ``docs/hooks.md``; ``docs/deepseek_v4.md`` says where each one sits.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from phaselens.contract.dims import ModelIdentity, config_dict
from phaselens.contract.hooknames import explain_missing
from phaselens.contract.protocol import HookFn
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import HookNameError, InputError
from phaselens.models.deepseek_v4.config import DeepSeekV4Cfg, build_cfg, check_eager
from phaselens.models.deepseek_v4.engine import V4SuffixEngine
from phaselens.models.deepseek_v4.geometry import LayerGeometry
from phaselens.models.deepseek_v4.memory import MemoryEstimate, estimate_memory
from phaselens.models.deepseek_v4.nnsight_backend import run_traced
from phaselens.models.deepseek_v4.prefill import call_kwargs, run_prefix
from phaselens.models.deepseek_v4.sites import MODULE_SITES, v4_hook_points
from phaselens.models.deepseek_v4.torch_hooks import torch_sites
from phaselens.models.parts.adapter_hooks import HookRun
from phaselens.models.parts.chunks import plan_chunks
from phaselens.models.parts.hooking import HookedAdapter
from phaselens.models.parts.index_topk import IndexTopKWarning
from phaselens.models.parts.kind_model import KindModel
from phaselens.models.parts.suffix_engine import QueryEngine
from phaselens.models.parts.tl_factored import FactoredBlock, HyperConnectionModel
from phaselens.models.parts.tl_habits import HYPER_CONNECTION_LIMITS
from phaselens.models.parts.tokens import check_tokens

Backend = Literal["torch", "nnsight"]
_UNSET: Any = object()


class DeepSeekV4Adapter(HyperConnectionModel, HookedAdapter, KindModel):
    """A transformers ``DeepseekV4ForCausalLM`` with phaselens' geometry, hook names and interventions.

    Build it with :func:`from_transformers` (or :func:`load_hf` / ``phaselens.load("hf:PATH")``). The wrapped model is
    ``adapter.model``; nothing is attached to it between calls.

    Attributes:
        default_task: the task analyses use when none is passed (``None``: pass one).
        indexer_picks: ``{layer: [B, n, k]}`` indexer picks of the last call's query rows, kept for the CSA
            layers whose ``index_topk`` truncated the entries (see :class:`IndexTopKWarning`).
        indexer_fragile: ``{layer: share}`` for the same layers: the share of those picks that score within
            rounding (half the model dtype's epsilon, relative) of the best entry left out, so that a
            rounding-sized change could swap them. Their mean over layers is
            ``analysis_metadata["index_topk_fragile_picks"]`` (docs/deepseek_v4.md: in bf16 it predicts the
            share of picks on which the adapter and DeepSeek's reference disagree).
    """

    tl_limits = HYPER_CONNECTION_LIMITS  # what TransformerLens's residual methods cannot mean here, and why

    def __init__(
        self,
        model: nn.Module,
        geometry: list[LayerGeometry],
        *,
        analysis_stride: int,
        backend: Backend,
        envoy: Any = None,
        remote: bool = False,
        chunk: int | None = None,
        metadata: dict[str, Any],
    ) -> None:
        self.model = model
        self.chunk = chunk
        self.indexer_picks: dict[int, Tensor] = {}
        self.indexer_fragile: dict[int, float] = {}
        self._geometry = geometry
        self._cfg = build_cfg(model, geometry)
        self._stride = analysis_stride
        self._backend: Backend = backend
        self._envoy = envoy
        self._remote = remote
        self._points = v4_hook_points(geometry)
        self._active: list[tuple[object, dict[str, list[HookFn]]]] = []
        self._metadata = metadata
        self._csa_layers = tuple(g.layer for g in geometry if g.kind == "csa")

    @property
    def blocks(self) -> list[FactoredBlock]:
        """Per layer, TransformerLens's ``attn`` / ``mlp`` names, each refused with the factors (parts.tl_factored)."""
        return [FactoredBlock(g.layer) for g in self._geometry]

    # ---- PhaseModel --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The checkpoint's name or path (what results call the model)."""
        return str(getattr(self.model.config, "_name_or_path", "") or "") or "deepseek_v4"

    @property
    def cfg(self) -> DeepSeekV4Cfg:
        device = self.model.get_input_embeddings().weight.device
        if device != self._cfg.device:  # the model was moved since
            self._cfg = replace(self._cfg, device=device)
        return self._cfg

    @property
    def phase_specs(self) -> list[PhaseSpec | None]:
        """Per layer: ``PhaseSpec(r, 2r)`` (CSA), ``PhaseSpec(r')`` (HCA) or ``None`` (sliding only)."""
        return [g.spec for g in self._geometry]

    @property
    def analysis_stride(self) -> int:
        return self._stride

    @property
    def analysis_spec(self) -> PhaseSpec:
        """``PhaseSpec(analysis_stride)``, origin 0: phases are slots mod the analysis stride.

        Residues use a modulus that is a multiple of it (e.g. 8 for stride 4; the LCM of 4 and 128 to see
        CSA and HCA phases together).
        """
        return PhaseSpec(self._stride)

    @property
    def layer_geometry(self) -> list[LayerGeometry]:
        return list(self._geometry)

    def identity(self) -> ModelIdentity:
        """transformers' config and model (fingerprints); the numerics are in ``analysis_metadata``."""
        return ModelIdentity(type(self).__qualname__, config_dict(self.model.config), self.model)

    @property
    def returns_query_logits(self) -> bool:
        """Whether analyses ask for the query rows' logits only (``logits="query"``): when prefilling in
        chunks, where all ``[B, T, vocab]`` logits of a long context would not fit in memory."""
        return self.chunk is not None and not self._remote

    # ---- forward -----------------------------------------------------------------------------------
    def __call__(
        self,
        tokens: Int[Tensor, "batch pos"],
        *,
        chunk: int | None = _UNSET,
        query_len: int | None = None,
        logits: Literal["all", "query"] = "all",
    ) -> Float[Tensor, "batch pos vocab"]:
        """Logits ``[B, T, vocab]`` (``[B, query_len, vocab]`` with ``logits="query"``).

        Args:
            tokens: ``[B, T]`` token ids (or ``[T]``), unpadded.
            chunk: prefill in pieces of this many tokens through the model's cache (default: the ``chunk``
                given to :func:`from_transformers`, else one uncached forward). Hooks fire only for the query chunk.
            query_len: the query rows: under chunked prefill the query chunk, the hooked last tokens (default
                ``min(chunk, T)``); in an uncached forward only the rows whose logits ``logits="query"`` keeps.
            logits: ``"query"`` to return (and compute) only the query rows' logits.
        """
        if logits not in ("all", "query"):
            raise InputError(f"logits must be 'all' or 'query', got {logits!r}.")
        tokens = self._check_tokens(tokens)
        check_eager(self.model.config)  # the config could have been switched since from_transformers
        T = tokens.shape[1]
        chunk = self.chunk if chunk is _UNSET else chunk
        plan = plan_chunks(T, chunk, query_len if chunk is not None else None)
        cached = bool(plan.prefix)
        if cached and self._remote:
            raise InputError(
                "chunked prefill needs a local cache; with remote=True run unchunked (chunk=None)."
            )
        topk_layers = self._check_topk(T)
        prefix = run_prefix(self.model, tokens, plan, keep_logits=logits == "all") if cached else None
        query = tokens[:, plan.query_start :]
        kwargs = call_kwargs(query, plan.query_start, prefix.cache if prefix else None)
        if logits == "query" and not cached and query_len is not None:
            if isinstance(query_len, bool) or not isinstance(query_len, numbers.Integral) or not 1 <= query_len <= T:
                raise InputError(f"query_len must be an int in 1..{T}, got {query_len!r}.")
            kwargs["logits_to_keep"] = int(query_len)  # the lm_head runs on the query rows only
        fragile: dict[int, tuple[int, int]] = {}
        out = self._hooked_forward(kwargs, HookRun(plan.query_start), topk_layers, fragile if topk_layers else None)
        shares = {layer: f / n for layer, (f, n) in sorted(fragile.items()) if n}
        if shares:
            self.indexer_fragile = shares
            self._metadata["index_topk_fragile_picks"] = sum(shares.values()) / len(shares)
        if logits == "query" or prefix is None:
            return out.logits
        return torch.cat([*prefix.prefix_logits, out.logits], dim=1)

    forward = __call__

    def _check_tokens(self, tokens: Any) -> Tensor:
        # remote: the local model is on the meta device; NDIF places the inputs
        return check_tokens(tokens, vocab=self._cfg.d_vocab, device=None if self._remote else self.cfg.device)

    def _check_topk(self, T: int) -> tuple[int, ...]:
        """Warn when an indexer keeps fewer entries than exist at length ``T``; return the layers to record
        (the binding ones)."""
        self.indexer_picks = {}
        self.indexer_fragile = {}
        if not self._csa_layers:
            return ()
        rate = int(self._cfg.compress_rates["compressed_sparse_attention"])
        entries = T // rate
        md = self._metadata
        md["max_entries_seen"] = max(int(md.get("max_entries_seen", 0)), entries)
        layers = self.model.model.layers
        topk = {i: int(layers[i].self_attn.compressor.indexer.index_topk) for i in self._csa_layers}
        binding = tuple(i for i, k in topk.items() if k < entries)
        if binding:
            k = min(topk[i] for i in binding)
            md["index_topk_binding"] = True
            warnings.warn(
                IndexTopKWarning(
                    f"index_topk={k} < {entries} entries at length {T} in CSA layers {list(binding)}: the "
                    "indexer drops entries, and its tie-breaking differs between chunked and unchunked runs. "
                    "The picks are in adapter.indexer_picks; phaselens.from_hf(model, index_topk='all') keeps every "
                    "entry (and records that the measured model was changed)."
                ),
                stacklevel=3,
            )
        return binding

    def _hooked_forward(self, kwargs: dict[str, Any], run: HookRun, topk_layers: tuple[int, ...],
                        fragile: dict[int, tuple[int, int]] | None) -> Any:
        resolved = self._merged_hooks()
        record = self.indexer_picks if topk_layers else None
        module_plan = [
            (self._points[n], fns) for n, fns in resolved.items() if self._points[n].site in MODULE_SITES
        ]
        use_nnsight = self._backend == "nnsight" and (bool(module_plan) or self._remote)  # remote: nnsight only
        n_heads = self._cfg.n_heads
        if self._remote:
            derived = [n for n in resolved if self._points[n].site not in MODULE_SITES]
            if derived:
                raise InputError(
                    f"remote=True reaches module sites only; {derived} need backend='torch' locally."
                )
            return run_traced(self.model, self._envoy, kwargs, module_plan, run, n_heads=n_heads, remote=True)
        skip = frozenset(MODULE_SITES) if use_nnsight else frozenset()  # module sites: nnsight's, derived: torch's
        with torch_sites(self.model, self._points, resolved, run, skip=skip, record_topk=record,
                         topk_layers=topk_layers, record_fragile=fragile):
            if use_nnsight:
                return run_traced(self.model, self._envoy, kwargs, module_plan, run, n_heads=n_heads)
            return self.model(**kwargs)

    # ---- capabilities (see phaselens.contract.protocol.CAPABILITIES) ----------------------------------------
    @property
    def query_engine(self) -> Callable[..., Any] | None:
        """The ``query_engine`` capability: ``adapter.query_engine(tokens [N, T], query_pos [N],
        rows_per_pass=4096, batch_size=None, pass_bytes=2**30)`` returns a :class:`~phaselens.models.parts.suffix_engine.QueryEngine`
        over the cached clean prefix (see :mod:`.engine`): one cache per query slot and piece of at most
        ``batch_size`` rows, prefilled in the adapter's ``chunk``. ``None`` with ``remote=True``: the engine
        needs a local cache.
        """
        return None if self._remote else self._query_engine

    def _query_engine(self, tokens: Tensor, query_pos: Tensor, **options: Any) -> QueryEngine:
        engine = KindModel.query_engine(self, tokens, query_pos, **options)
        self._check_topk(int(torch.as_tensor(query_pos).max()) + 1)
        return engine

    def _slot_engine(self) -> type[V4SuffixEngine]:
        check_eager(self.model.config)
        return V4SuffixEngine

    def estimate_memory(self, tokens: int, *, batch: int = 1, query_len: int | None = None,
                        logits: Literal["all", "query"] = "all") -> MemoryEstimate:
        """The ``estimate_memory`` capability: :func:`~phaselens.models.deepseek_v4.estimate_memory` of a call
        on ``batch`` sequences of ``tokens`` tokens, prefilled in this adapter's ``chunk``."""
        return estimate_memory(self, tokens, batch=batch, chunk=self.chunk, query_len=query_len, logits=logits)

    def _missing_hook(self, name: str) -> None:
        raise HookNameError(explain_missing(name, self._points) + " On the DeepSeek-V4 adapter, compressed-layer "
                            "hooks exist only on CSA/HCA layers and hook_indexer_topk only on CSA layers.")

    def __repr__(self) -> str:
        kinds = "".join({"csa": "C", "hca": "H", "sliding": "S"}[g.kind] for g in self._geometry)
        return (
            f"DeepSeekV4Adapter(layers={kinds}, strides={sorted({s.stride for s in self.phase_specs if s})}, "
            f"analysis_stride={self._stride}, backend={self._backend!r})"
        )
