"""The query-suffix engine of a transformers causal LM: many query-row interventions over one cached prefix.

An intervention on ``z`` at the query slot ``q`` changes nothing at earlier positions. So, per query slot, the
engine runs ``tokens[:, :q]`` once into the model's own ``transformers.DynamicCache`` (``past_key_values``),
runs the clean query row once through every layer (keeping each layer's input ``hook_resid_pre`` and ``z`` at
the query), and then, for a batch of ``C`` cells at layer ``l``, runs only the query rows (``C * n`` of them)
through layers ``l..L-1``:

* **Skipping layers below l.** The pass calls a view of the model whose decoder-layer list is ``layers[l:]``
  (:func:`~phaselens.models.parts.wrappers.with_child`: shallow copies of the containers on the path, the same layer
  modules and weights); the first layer's input is replaced by the clean ``hook_resid_pre`` of layer ``l``,
  so the embedding a layer-``l`` pass computes is never used. Each attention module keeps its ``layer_idx``,
  so it reads and extends its own cache layer.
* **Repeat, not snapshot.** The query call appends its key and value to every cache layer it runs. The engine
  never lets it write into the clean prefix: a pass gets a cache whose layers ``l..L-1`` hold the prefix's
  tensors repeated ``C`` times along the batch (row ``c * n + i`` is cell ``c`` on item ``i``), built once per
  pass width and shared by every pass of that width. A plain ``DynamicLayer`` becomes a :class:`QueryLayer`
  whose buffer has one free slot that each pass writes its query key and value into (no per-pass copy of the
  cache); other layer kinds (sliding windows) get shallow copies per pass, as transformers' layers rebind their
  tensors (``torch.cat``) rather than write in place. Cache layers below ``l`` are the prefix's own (only
  their length is read, for the mask).
* **Checked once per layer.** The first pass at each layer carries one extra cell that changes nothing; its
  logits must equal the clean query's (to rounding), or the engine raises
  :class:`~phaselens.errors.UnsupportedModelError` (an architecture whose forward depends on a layer's
  index in the list, say) and names ``engine='full'``.

Exactness: every cell equals the full forward at that cell to float rounding (tests hold 1e-5 in fp32).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from phaselens.contract.cells import Cell
from phaselens.errors import UnsupportedModelError
from phaselens.models.parts.cache_repeat import CacheRows
from phaselens.models.parts.suffix_engine import HookList, SlotEngine
from phaselens.models.parts.wrappers import with_child

# What the engine runs: every layer full attention, or every layer one sliding window (Mistral). A model that mixes
# them (Gemma-2's alternating layers, Qwen2's max_window_layers) makes its query passes fail once the prefix is
# longer than the window (the layers' caches then hold different lengths); other layer kinds are untested.
LAYER_TYPES = ("full_attention", "sliding_attention")
CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


def engine_support(hf: nn.Module) -> str | None:
    """Why the query-suffix engine cannot run the transformers model ``hf`` (``None``: it can), read from its
    config before anything runs: ``layer_types``, and the cache layers transformers builds for it."""
    config, arch = hf.config, type(hf).__name__
    types = list(getattr(config, "layer_types", None) or [])
    odd = sorted(set(types) - set(LAYER_TYPES))
    if odd:
        return (f"{arch} has layers of type {odd}; the query-suffix engine runs full-attention and sliding-window "
                "layers only")
    if len(set(types)) > 1:
        counts = ", ".join(f"{types.count(t)} {t}" for t in LAYER_TYPES)
        return (f"{arch} mixes sliding-window (window {getattr(config, 'sliding_window', None)}) and full-attention "
                f"layers (layer_types: {counts}); the query-suffix engine runs models whose layers share one "
                "attention kind")
    from transformers import DynamicCache

    try:
        kinds = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers})
    except (TypeError, ValueError, AttributeError, KeyError) as err:
        return f"transformers builds no cache for {arch} from its config ({type(err).__name__}: {err})"
    if set(kinds) - set(CACHE_LAYERS) or len(kinds) > 1:
        return (f"{arch}'s cache has layers {kinds}; the query-suffix engine runs one kind of "
                f"{' or '.join(CACHE_LAYERS)}")
    return None


ROWS = CacheRows()


def repeated_layer(layer: Any, copies: int) -> Any:
    """:meth:`CacheRows.repeated` of one cache layer, a plain ``DynamicLayer`` made a :class:`QueryLayer`: the
    repeated prefix sits in a buffer with one free slot, so a pass writes its query key and value there instead of
    concatenating the whole cache."""
    new = ROWS.repeated(layer, copies)
    if type(layer) is DynamicLayer and getattr(layer, "is_initialized", False) and isinstance(new.keys, Tensor):
        return QueryLayer.of(new)
    return new


class QueryLayer(DynamicLayer):  # type: ignore[misc]
    """A ``DynamicLayer`` for the engine's query passes: ``keys`` / ``values`` ``[rows, Hkv, t, d]`` are views of
    buffers ``[rows, Hkv, t + 1, d]`` whose last slot each pass's one query key / value is written into.

    Passes of the same width share the layer (each pass overwrites the slot before any attention reads it), so a
    pass reads the cache once and copies nothing; ``get_seq_length`` stays ``t`` (the prefix), as the mask needs.
    """

    @staticmethod
    def of(layer: Any) -> QueryLayer:
        new = QueryLayer.__new__(QueryLayer)
        new.__dict__.update(vars(layer))
        t = layer.keys.shape[-2]
        new.key_buffer = torch.cat([layer.keys, layer.keys[:, :, :1]], dim=-2)
        new.value_buffer = torch.cat([layer.values, layer.values[:, :, :1]], dim=-2)
        new.keys, new.values = new.key_buffer[:, :, :t], new.value_buffer[:, :, :t]
        return new

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if key_states.shape[-2] != 1 or key_states.shape[0] != self.key_buffer.shape[0]:
            raise UnsupportedModelError("the query-suffix engine's cache takes one query row per pass; use "
                                        "engine='full'.")
        self.key_buffer[:, :, -1:] = key_states
        self.value_buffer[:, :, -1:] = value_states
        return self.key_buffer, self.value_buffer


class CausalSuffixEngine(SlotEngine):
    """Clean prefix once; per-cell query passes from the intervened layer up (one query slot): a
    :class:`~phaselens.models.parts.suffix_engine.SlotEngine` (cells, passes, the clean step and the pass budget are
    shared). What this kind keeps: the prefill into the model's ``DynamicCache``, a view of the model from the
    intervened layer up whose first input is the clean ``hook_resid_pre``, and the check once per layer.

    Args (as every :class:`~phaselens.models.parts.suffix_engine.SlotEngine`'s):
        model: a :class:`~phaselens.models.causal_lm.CausalLMAdapter` (``self.adapter``).

    Attributes:
        clean_logits: ``[n, V]``; clean_z: per layer ``[n, H, d]``; resid_pre: per layer ``[n, 1, D]``.
    """

    def prefill(self, tokens: Tensor) -> None:
        from transformers import DynamicCache

        adapter = self.adapter = self.model
        self.hf, self.layout = adapter.model, adapter._layout
        self.query_ids = tokens[:, self.q : self.q + 1]
        self.position_ids = torch.tensor([[self.q]], device=tokens.device)
        params = inspect.signature(self.hf.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._models: dict[int, nn.Module] = {}
        self._checked: set[int] = set()
        with torch.no_grad():
            self.cache = DynamicCache(config=self.hf.config)
            if self.q:
                prefix = {"input_ids": tokens[:, : self.q], self._cache_kw: self.cache, "use_cache": True,
                          "position_ids": torch.arange(self.q, device=tokens.device)[None], "logits_to_keep": 1}
                adapter.forward_hooked(prefix, {}, check=False)
            self.clean_step(None, self.layout.n_layers)
        L, H = self.layout.n_layers, self.layout.n_heads  # per row: the repeated cache, one [H, keys] fp32 score row
        self.layer_row_bytes = [ROWS.held(self.cache, i) // max(self.n, 1) + 4 * H * (self.q + 1)
                                for i in range(L)]

    def run_layers(self, start: int, state: Tensor | None, copies: int, hooks: HookList,
                   record: list[Any] | None = None) -> Tensor:
        """The query rows (``copies * n``) through layers ``start..L-1`` of a view of the model, the first layer's
        input replaced by ``state`` ``[copies * n, 1, D]`` (``None``: the embedding, at layer 0); logits
        ``[copies * n, V]``."""
        resolved: dict[str, list[Any]] = {}
        if state is not None:
            resolved[f"blocks.{start}.hook_resid_pre"] = [lambda x, *, hook: state]
        for name, fn in hooks:
            resolved.setdefault(name, []).append(fn)
        for i in range(start, self.layout.n_layers) if record is not None else ():
            resolved.setdefault(f"blocks.{i}.hook_resid_pre", []).append(lambda x, *, hook: record.append(x.clone()))
        cache = ROWS.pass_cache(self, self.cache, start, copies, build=repeated_layer,
                                fresh=lambda t: t if isinstance(t, QueryLayer) else ROWS.fresh(t))
        kwargs = {"input_ids": self.query_ids.repeat(copies, 1), self._cache_kw: cache, "use_cache": True,
                  "position_ids": self.position_ids, "logits_to_keep": 1}
        out = self.adapter.forward_hooked(kwargs, resolved, query_start=self.q, model=self._model(start), check=False)
        return out.logits[:, -1]

    def _model(self, start: int) -> nn.Module:
        """The model with decoder layers ``start..L-1`` only (the model itself for ``start = 0``)."""
        if start == 0:
            return self.hf
        if start not in self._models:
            self._models[start] = with_child(self.hf, self.layout.layers_path,
                                             nn.ModuleList(self.layout.layers[start:]))
        return self._models[start]

    def _pass(self, layer: int, cells: Sequence[Cell]) -> Tensor:
        """The shared pass; the first at each layer carries one more cell that changes nothing, checked."""
        if layer in self._checked:
            return super()._pass(layer, cells)
        logits = super()._pass(layer, [*cells, Cell(layer, [], None)])
        ref, noop = self.clean_logits.float(), logits[-1]
        tol = 1e3 * torch.finfo(ref.dtype if noop.dtype == torch.float32 else noop.dtype).eps
        if not torch.allclose(noop.float(), ref, rtol=tol, atol=tol * float(ref.abs().max())):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__}: a query pass from layer {layer} over the cached prefix does not reproduce "
                "the clean logits, so this architecture's forward cannot start at a later layer; use engine='full'."
            )
        self._checked.add(layer)
        return logits[:-1]
