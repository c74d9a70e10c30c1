"""``CausalLMAdapter``: any transformers causal LM behind :class:`phaselens.contract.protocol.PhaseModel`, analysed at
a stride the user gives (full attention: the paper's control).

    model = phaselens.load("hf:/data/Qwen3-0.6B", stride=4)     # or phaselens.load(hf_model, stride=4)
    logits = model(tokens)                                      # [B, T] -> [B, T, vocab]
    with model.hooks(fwd_hooks=[("blocks.2.attn.hook_z", fn)]):
        logits = model(tokens)

Hook names and shapes: :mod:`.sites` (TransformerLens conventions). The wrapped model is ``adapter.model``;
nothing is attached to it between calls, and a forward leaves it as it was (modes, attention implementation,
hooks), also when a hook raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from jaxtyping import Float, Int
from torch import Tensor, nn

from phaselens.contract.dims import ModelIdentity, config_dict
from phaselens.contract.memory import MemoryEstimate
from phaselens.contract.protocol import HookFn
from phaselens.core.checks import as_int
from phaselens.core.geometry import PhaseSpec
from phaselens.errors import InputError, PhaseGeometryError
from phaselens.models.causal_lm.attention import attn_implementation, borrowed
from phaselens.models.causal_lm.layout import Layout, base_module, model_layout
from phaselens.models.causal_lm.sites import causal_hook_points, check_fired, installed, no_entries
from phaselens.models.numerics.sizing import held_bytes
from phaselens.models.parts.adapter_hooks import HookRun
from phaselens.models.parts.hooking import HookedAdapter
from phaselens.models.parts.kind_model import KindModel
from phaselens.models.parts.suffix_engine import SlotEngine
from phaselens.models.parts.tl_habits import TLConfig
from phaselens.models.parts.tl_hf import HFSplitQKV, HFSurface
from phaselens.models.parts.tokens import check_tokens


@dataclass(frozen=True, kw_only=True)
class CausalLMCfg(TLConfig):
    """The wrapped model's sizes, TransformerLens-named (``adapter.cfg``; analyses read ``adapter.dims``): a
    :class:`~phaselens.models.parts.tl_habits.TLConfig` (``normalization_type`` ``"LN"`` for GPT-2); ``d_mlp`` is
    ``None`` for a mixture of experts."""

    d_mlp: int | None = None


def spec_of(stride: Any, window: Any, origin: Any, what: str) -> PhaseSpec:
    """The :class:`PhaseSpec` of ``stride=`` / ``window=`` / ``origin=`` (window defaults to the stride; no
    ``stride=``: an error naming the option, as a model without compression has none to read)."""
    if stride is None:
        raise InputError(
            f"{what} has no compressed layers, so phaselens cannot read a stride from it: pass the stride to analyse "
            "its phases at, e.g. phaselens.load(model, stride=4) (window= and origin= too where they matter), or "
            "stride=4 to the analysis (phaselens.evaluate(model, task, stride=4))."
        )
    try:
        return PhaseSpec(stride, window, 0 if origin is None else origin)
    except PhaseGeometryError as err:
        raise PhaseGeometryError(f"{what}: {err}") from None


class CausalLMAdapter(HFSplitQKV, HFSurface, HookedAdapter, KindModel):
    """A transformers causal LM with phaselens' hook names, geometry and interventions.

    Build it with :func:`~phaselens.models.causal_lm.from_transformers` (or ``phaselens.load``). ``spec`` is the
    geometry phases are read in (stride, window, origin); every layer is full attention (``phase_specs`` all
    ``None``).

    Attributes:
        model: the transformers model (for a TransformerLens-bridged model, a view with the original modules).
        default_task: the task analyses use when none is passed (``None``: pass one).
    """

    def __init__(self, model: nn.Module, spec: PhaseSpec, *, metadata: dict[str, Any]) -> None:
        self.model = model
        self._layout: Layout = model_layout(model)
        self._spec = spec
        self._points = causal_hook_points(self._layout)
        self._active: list[tuple[object, dict[str, list[HookFn]]]] = []
        self._metadata = metadata

    # ---- PhaseModel --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The checkpoint's name or path, else the model's class (what results call the model)."""
        return str(getattr(self.model.config, "_name_or_path", "") or "") or type(self.model).__name__

    @property
    def cfg(self) -> CausalLMCfg:
        lay, w = self._layout, self._layout.embed.weight
        norm = self.tl_norm
        kind = None if norm is None else norm[0]
        learned = base_module(self.model, "wpe") is not None
        return CausalLMCfg(n_layers=lay.n_layers, n_heads=lay.n_heads, n_key_value_heads=lay.n_kv_heads,
                           d_head=lay.d_head, d_model=lay.d_model, d_vocab=lay.d_vocab, n_ctx=lay.n_ctx, dtype=w.dtype,
                           device=w.device, normalization_type=kind, final_rms=kind == "RMS", attn_only=False,
                           positional_embedding_type="standard" if learned else "rotary", d_mlp=self._d_mlp())

    # ---- TransformerLens habits (phaselens.models.parts.tl_habits) ----------------------------------------
    @property
    def ln_final(self) -> nn.Module | None:
        """The model's final norm (``model.model.norm``; GPT-2's ``transformer.ln_f``), ``[B, n, D]`` in and out."""
        return base_module(self.model, "norm") or base_module(self.model, "ln_f")

    @property
    def tl_norm(self) -> tuple[str, float] | None:
        """``("RMS" | "LN", eps)`` of the final norm (the blocks' norms share its eps in these families)."""
        norm = self.ln_final
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if norm is None or eps is None:
            return None
        return ("LN" if isinstance(norm, nn.LayerNorm) else "RMS", float(eps))

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.model.get_output_embeddings().weight.T

    def _unembed_directions(self) -> Float[Tensor, "d_model d_vocab"]:
        norm = self.ln_final
        w = getattr(norm, "weight", None)
        return self.W_U if w is None else self.W_U * w[:, None]

    @property
    def phase_specs(self) -> list[PhaseSpec | None]:
        """``None`` per layer: no layer compresses."""
        return [None] * self._layout.n_layers

    @property
    def analysis_spec(self) -> PhaseSpec:
        """The geometry given at construction: phases are ``(slot - origin) mod stride``."""
        return self._spec

    def identity(self) -> ModelIdentity:
        """transformers' config, the geometry, and the model (fingerprints)."""
        s = self._spec
        config = {"config": config_dict(self.model.config), "stride": s.stride, "window": s.window,
                  "origin": s.origin}
        return ModelIdentity(type(self).__qualname__, config, self.model)

    # ---- forward -----------------------------------------------------------------------------------
    def __call__(self, tokens: Int[Tensor, "batch pos"], *, query_len: int | None = None,
                 logits: Literal["all", "query"] = "all") -> Float[Tensor, "batch pos vocab"]:
        """Logits ``[B, T, vocab]`` (the last ``query_len`` rows ``[B, query_len, vocab]`` with ``logits="query"``;
        only those rows are unembedded)."""
        if logits not in ("all", "query"):
            raise InputError(f"logits must be 'all' or 'query', got {logits!r}.")
        tokens = self._check_tokens(tokens)
        T = tokens.shape[1]
        kwargs: dict[str, Any] = {"input_ids": tokens, "use_cache": False}
        if logits == "query" and query_len is not None:
            kwargs["logits_to_keep"] = as_int("query_len", query_len, minimum=1, maximum=T)
        return self.forward_hooked(kwargs, self._merged_hooks()).logits

    forward = __call__

    def _check_tokens(self, tokens: Any) -> Tensor:
        """``tokens`` as checked ``[B, T]`` ids on the model's device."""
        lay = self._layout
        return check_tokens(tokens, vocab=lay.d_vocab, device=lay.embed.weight.device, n_ctx=lay.n_ctx)

    def forward_hooked(self, kwargs: dict[str, Any], resolved: dict[str, list[HookFn]], *, query_start: int = 0,
                       model: nn.Module | None = None, check: bool = True) -> Any:
        """One call of the transformers model (or ``model``, a view of it) with ``resolved`` hooks; the user's
        object is restored afterwards whatever raises."""
        run = HookRun(query_start)
        eager = any(self._points[n].site == "pattern" for n in resolved)
        with installed(self._layout, self._points, resolved, run) as taps, borrowed(self.model, eager=eager,
                                                                                    taps=taps):
            out = (model or self.model)(**kwargs)
        if check:
            check_fired(resolved, run, self.name)
        return out

    # ---- capabilities (see phaselens.contract.protocol.CAPABILITIES) ---------------------------------------
    def _slot_engine(self) -> type[SlotEngine]:
        """The per-slot engine over the cached clean prefix (the model's own ``DynamicCache``; see :mod:`.engine`),
        where :meth:`query_engine_support` says it can run."""
        from phaselens.models.causal_lm.engine import CausalSuffixEngine

        why = self.query_engine_support()
        if why is not None:
            from phaselens.errors import EngineError

            raise EngineError(f"the query-suffix engine cannot run here: {why}; use engine='full'.")
        return CausalSuffixEngine

    def query_engine_support(self) -> str | None:
        """The ``query_engine_support`` capability: why the query-suffix engine cannot run this architecture
        (``None``: it can; :func:`~phaselens.models.causal_lm.engine.engine_support`), checked once."""
        if "_engine_support" not in self.__dict__:
            from phaselens.models.causal_lm.engine import engine_support

            self.__dict__["_engine_support"] = engine_support(self.model)
        return self.__dict__["_engine_support"]

    def estimate_memory(self, tokens: int, *, batch: int = 1, query_len: int | None = None,
                        logits: Literal["all", "query"] = "all") -> MemoryEstimate:
        """The ``estimate_memory`` capability: weights; the key/value cache of a ``query_len`` call after its
        prefix (the query engine's prefill; 0 for one uncached forward); the ``[B, H, n, keys]`` probabilities of
        eager attention (what pattern hooks make; SDPA holds less); the returned logits."""
        lay = self._layout
        item = lay.embed.weight.dtype.itemsize
        T, n = int(tokens), int(query_len or tokens)
        cache = 2 * lay.n_layers * lay.n_kv_heads * lay.d_head * T * batch * item if query_len else 0
        rows = T if logits == "all" else n
        return MemoryEstimate(T, batch, None, n, held_bytes(self.model), cache, batch * lay.n_heads * n * T * item,
                              batch * rows * lay.d_vocab * item)

    def with_geometry(self, stride: Any, window: Any = None, origin: Any = None) -> CausalLMAdapter:
        """This model read at another geometry: a new adapter over the same transformers model whose
        ``analysis_spec`` and ``analysis_metadata`` are ``stride`` / ``window`` (default: the stride) / ``origin``
        (default: this adapter's); itself when they are this adapter's (docs/concepts.md, "Strides: one rule")."""
        from phaselens.contract.strides import check_stride

        spec = spec_of(check_stride(stride, ()), window, self._spec.origin if origin is None else origin, self.name)
        if spec == self._spec:
            return self
        metadata = {**self._metadata, "analysis_stride": spec.stride, "analysis_window": spec.window,
                    "analysis_origin": spec.origin}
        out = CausalLMAdapter(self.model, spec, metadata=metadata)
        out.default_task = self.default_task
        if "_tl_tokenizer" in self.__dict__:  # a tokenizer found or set once stays
            out.__dict__["_tl_tokenizer"] = self.__dict__["_tl_tokenizer"]
        return out

    def _missing_hook(self, name: str) -> None:
        no_entries(name)  # compressed-layer names explained
        super()._missing_hook(name)

    def __repr__(self) -> str:
        s = self._spec
        return (f"CausalLMAdapter({type(self.model).__name__}, layers={self._layout.n_layers}, full attention, "
                f"stride={s.stride}, window={s.window}, origin={s.origin}, "
                f"attention={attn_implementation(self.model)!r})")

