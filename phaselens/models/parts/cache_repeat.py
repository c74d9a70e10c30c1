"""A transformers cache repeated for a pass of cells, written once for every engine that runs over one (the
causal-LM kind's ``DynamicCache``, DeepSeek-V4's).

A pass of ``C`` cells over ``n`` rows needs the prefix's cache with each layer's per-row state repeated ``C`` times
along the batch (row ``c * n + i`` is cell ``c`` on item ``i``), and the query call must never write into the clean
prefix. transformers' cache layers rebind their tensors (``torch.cat``) and write into their dicts rather than
writing in place, so the repeated tensors are built once per pass width (:meth:`SlotEngine.repeated`) and each
pass gets shallow copies of the layer objects and their dicts. :class:`CacheRows` names the attributes of a kind's
cache layers that hold per-row state; any other batch-shaped state is refused (a cache layout the engine does not
know), never shared silently across cells.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from phaselens.errors import UnsupportedModelError
from phaselens.models.parts.suffix_engine import SlotEngine, repeat_rows


def _holds_rows(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.dim() > 0
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return any(isinstance(v, Tensor) for v in items)


@dataclass(frozen=True)
class CacheRows:
    """The per-row state of a kind's cache layers: ``tensors`` ``[B, ...]``, dicts of them (``tensor_dicts``) and
    dicts of counters (``counts``, copied per pass); ``unknown`` finishes the refusal of anything else."""

    tensors: tuple[str, ...] = ("keys", "values")
    tensor_dicts: tuple[str, ...] = ()
    counts: tuple[str, ...] = ()
    unknown: str = "use engine='full'."

    def repeated(self, layer: Any, copies: int) -> Any:
        """A shallow copy of the cache layer ``layer`` whose per-row state is repeated ``copies`` times."""
        new = copy.copy(layer)
        for name, value in vars(layer).items():
            if name in self.tensors:
                setattr(new, name, repeat_rows(value, copies))
            elif name in self.tensor_dicts:
                setattr(new, name, {k: repeat_rows(v, copies) for k, v in value.items()})
            elif name in self.counts:
                setattr(new, name, dict(value))
            elif _holds_rows(value):
                raise UnsupportedModelError(f"{type(layer).__name__}.{name} is cache state the query-suffix engine "
                                            f"does not know; {self.unknown}")
        if getattr(layer, "values", None) is getattr(layer, "keys", None):  # K = V layers share one tensor
            new.values = new.keys
        return new

    def fresh(self, template: Any) -> Any:
        """A per-pass copy of a repeated layer: the forward rebinds its attributes and writes into its dicts."""
        new = copy.copy(template)
        for name in (*self.tensor_dicts, *self.counts):
            if name in vars(template):
                setattr(new, name, dict(getattr(template, name)))
        return new

    def pass_cache(self, engine: SlotEngine, cache: Any, start: int, copies: int,
                   build: Callable[[Any, int], Any] | None = None, fresh: Callable[[Any], Any] | None = None) -> Any:
        """The cache of one pass from layer ``start``: layers below it the clean prefix's own (only their length
        is read, for the mask), layers from it fresh copies of the prefix repeated ``copies`` times (``build``:
        :meth:`repeated` unless the kind wraps it; built once per pass width and shared through ``engine``)."""
        build, fresh = build or self.repeated, fresh or self.fresh
        layers = list(cache.layers)
        for i in range(start, len(layers)):
            layers[i] = fresh(engine.repeated(i, copies, lambda i=i: build(cache.layers[i], copies)))
        out = copy.copy(cache)
        out.layers = layers
        return out

    def held(self, cache: Any, start: int) -> int:
        """Bytes of the per-row state of the cache's layers from ``start`` (all rows)."""
        total = 0
        for layer in cache.layers[start:]:
            for name, value in vars(layer).items():
                values = value.values() if name in self.tensor_dicts else [value] if name in self.tensors else []
                total += sum(v.numel() * v.element_size() for v in values if isinstance(v, Tensor))
        return total
