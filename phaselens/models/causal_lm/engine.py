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
  :class:`~phaselens.core.errors.UnsupportedModelError` (an architecture whose forward depends on a layer's
  index in the list, say) and names ``engine='full'``.

Exactness: every cell equals the full forward at that cell to float rounding (tests hold 1e-5 in fp32).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from phaselens.contract import hooknames
from phaselens.contract.cells import PASS_BYTES, Cell
from phaselens.core.errors import UnsupportedModelError
from phaselens.models.parts.suffix_engine import run_by_layer
from phaselens.models.parts.wrappers import with_child

_ROW_TENSORS = ("keys", "values")  # per-row state of transformers' dynamic (and sliding-window) cache layers
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


def repeated_layer(layer: Any, copies: int) -> Any:
    """A shallow copy of one cache layer whose ``keys`` / ``values`` ``[n, Hkv, t, d]`` are repeated ``copies``
    times along the batch; any other batch-shaped state is refused (a cache layout this engine does not know).

    A plain ``DynamicLayer`` becomes a :class:`QueryLayer`: the repeated prefix sits in a buffer with one free
    slot, so a pass writes its query key and value there instead of concatenating the whole cache."""
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if name in _ROW_TENSORS and isinstance(value, Tensor):
            setattr(new, name, value.repeat(copies, *([1] * (value.dim() - 1))) if copies > 1 else value)
        elif isinstance(value, Tensor) and value.dim() > 0:
            raise UnsupportedModelError(f"{type(layer).__name__}.{name} is cache state the query-suffix engine does "
                                        "not know; use engine='full'.")
    from transformers.cache_utils import DynamicLayer

    if type(layer) is DynamicLayer and getattr(layer, "is_initialized", False) and isinstance(new.keys, Tensor):
        return QueryLayer.of(new)
    return new


def _query_layer_base() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class QueryLayer(_query_layer_base()):  # type: ignore[misc]
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


class CausalSuffixEngine:
    """Clean prefix once; per-cell query passes from the intervened layer up (one query slot).

    The per-slot engine behind :meth:`CausalLMAdapter.query_engine` (grouped by slot by
    :class:`phaselens.models.parts.suffix_engine.QueryEngine`).

    Args:
        adapter: a :class:`~phaselens.models.causal_lm.CausalLMAdapter`.
        tokens: ``[n, T]`` ids sharing the query slot ``query_pos`` (only ``tokens[:, :q + 1]`` is read).
        rows_per_pass: at most this many rows (cells x items) per pass; pass_bytes: its memory budget.

    Attributes:
        clean_logits: ``[n, V]``; clean_z: per layer ``[n, H, d]``; resid_pre: per layer ``[n, 1, D]``.
    """

    def __init__(self, adapter: Any, tokens: Tensor, query_pos: int, *, rows_per_pass: int = 4096,
                 pass_bytes: int = PASS_BYTES) -> None:
        from transformers import DynamicCache

        self.adapter, self.hf = adapter, adapter.model
        self.layout = adapter._layout
        self.q, self.rows_per_pass, self.pass_bytes = int(query_pos), int(rows_per_pass), int(pass_bytes)
        tokens = adapter.tokens(tokens)
        self.n = int(tokens.shape[0])
        self.query_ids = tokens[:, self.q : self.q + 1]
        self.position_ids = torch.tensor([[self.q]], device=tokens.device)
        params = inspect.signature(self.hf.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._templates: dict[tuple[int, int], Any] = {}
        self._views: dict[int, nn.Module] = {}
        self._checked: set[int] = set()
        with torch.no_grad():
            self.cache = DynamicCache(config=self.hf.config)
            if self.q:
                prefix = {"input_ids": tokens[:, : self.q], self._cache_kw: self.cache, "use_cache": True,
                          "position_ids": torch.arange(self.q, device=tokens.device)[None], "logits_to_keep": 1}
                adapter.forward_hooked(prefix, {}, check=False)
            self.resid_pre, self.clean_z, self.clean_logits = self._clean_step()
        self._row_bytes = [self._bytes_per_row(layer) for layer in range(self.layout.n_layers)]

    def _clean_step(self) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Per layer the query's input ``[n, 1, D]`` and ``z`` ``[n, H, d]``; clean logits ``[n, V]``."""
        L = self.layout.n_layers
        resid: dict[int, Tensor] = {}
        zs: dict[int, Tensor] = {}

        def keep_resid(x: Tensor, *, hook: Any) -> None:
            resid[hook.layer()] = x.clone()

        def keep_z(z: Tensor, *, hook: Any) -> None:
            zs[hook.layer()] = z[:, 0].clone()

        hooks = {**{hooknames.z(i): [keep_z] for i in range(L)},
                 **{f"blocks.{i}.hook_resid_pre": [keep_resid] for i in range(L)}}
        logits = self._call(0, 1, hooks)
        return [resid[i] for i in range(L)], [zs[i] for i in range(L)], logits

    def _call(self, start: int, copies: int, hooks: dict[str, list[Any]]) -> Tensor:
        """The query rows (``copies * n``) through layers ``start..L-1`` of a view of the model: logits ``[copies * n, V]``."""
        kwargs = {"input_ids": self.query_ids.repeat(copies, 1), self._cache_kw: self._pass_cache(start, copies),
                  "use_cache": True, "position_ids": self.position_ids, "logits_to_keep": 1}
        out = self.adapter.forward_hooked(kwargs, hooks, query_start=self.q, model=self._view(start), check=False)
        return out.logits[:, -1]

    def _view(self, start: int) -> nn.Module:
        """The model with decoder layers ``start..L-1`` only (the model itself for ``start = 0``)."""
        if start == 0:
            return self.hf
        if start not in self._views:
            self._views[start] = with_child(self.hf, self.layout.layers_path, nn.ModuleList(self.layout.layers[start:]))
        return self._views[start]

    def _pass_cache(self, start: int, copies: int) -> Any:
        """Layers below ``start``: the clean prefix's own (read only); from ``start``: per-pass copies of the prefix
        repeated ``copies`` times."""
        if not any(k[1] == copies for k in self._templates):  # a new pass width: drop the old width's copies
            self._templates = {}
        layers = list(self.cache.layers)
        for i in range(start, len(layers)):
            if (i, copies) not in self._templates:
                self._templates[(i, copies)] = repeated_layer(layers[i], copies)
            template = self._templates[(i, copies)]
            layers[i] = template if isinstance(template, QueryLayer) else copy.copy(template)
        cache = copy.copy(self.cache)
        cache.layers = layers
        return cache

    def _bytes_per_row(self, start: int) -> int:
        """Memory per row of a pass from ``start``: its repeated cache (the buffers of :class:`QueryLayer`) and one
        ``[H, keys]`` score row in fp32."""
        held = sum(t.numel() * t.element_size() for layer in self.cache.layers[start:]
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, Tensor))
        return held // max(self.n, 1) + 4 * self.layout.n_heads * (self.q + 1)

    @torch.no_grad()
    def run(self, cells: Sequence[Cell], *, progress: Any = None) -> Tensor:
        """Logits at the query slot under each cell: ``[C, n, V]``."""
        def per_pass(layer: int) -> int:
            rows = min(self.rows_per_pass, self.pass_bytes // max(self._row_bytes[layer], 1))
            return max(1, rows // max(self.n, 1))

        return run_by_layer(cells, per_pass, self._pass, progress)

    def _pass(self, layer: int, cells: Sequence[Cell]) -> Tensor:
        check = layer not in self._checked
        cells = [*cells, Cell(layer, [], None)] if check else list(cells)
        n, C = self.n, len(cells)
        z0 = self.clean_z[layer]
        H, d = z0.shape[1:]
        mask = torch.zeros(C, H, dtype=torch.bool)
        repl = torch.zeros(C, n, H, d, dtype=z0.dtype, device=z0.device)
        for c, cell in enumerate(cells):  # one cell at a time; heads are indexed as one tensor
            heads = list(cell.heads)
            mask[c, heads] = True
            if cell.replacement is not None:
                r = cell.replacement.to(device=repl.device, dtype=repl.dtype)
                repl[c][:, heads] = r if r.dim() == 3 else r.expand(n, -1, -1)
        mask_rows = mask.repeat_interleave(n, 0)[:, None, :, None].to(z0.device)  # [C * n, 1, H, 1]
        repl_rows = repl.reshape(C * n, 1, H, d)
        resid = self.resid_pre[layer].repeat(C, 1, 1)

        def clean_input(x: Tensor, *, hook: Any) -> Tensor:
            return resid

        def intervene(z: Tensor, *, hook: Any) -> Tensor:
            return torch.where(mask_rows, repl_rows, z)

        hooks = {f"blocks.{layer}.hook_resid_pre": [clean_input], hooknames.z(layer): [intervene]}
        logits = self._call(layer, C, hooks).view(C, n, -1)
        if check:
            self._check(layer, logits[-1])
            logits = logits[:-1]
        return logits

    def _check(self, layer: int, noop: Tensor) -> None:
        ref = self.clean_logits.float()
        tol = 1e3 * torch.finfo(ref.dtype if noop.dtype == torch.float32 else noop.dtype).eps
        if not torch.allclose(noop.float(), ref, rtol=tol, atol=tol * float(ref.abs().max())):
            raise UnsupportedModelError(
                f"{type(self.hf).__name__}: a query pass from layer {layer} over the cached prefix does not reproduce "
                "the clean logits, so this architecture's forward cannot start at a later layer; use engine='full'."
            )
        self._checked.add(layer)
