"""Typed head specifications: ``(2, 3)``, ``"L2H3"``, ``"L2"`` (a whole layer), ``"L2KV0"`` (a KV group)."""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from phaselens.core.errors import HeadSpecError

_PATTERN = re.compile(r"^L(\d+)(?:H(\d+)|KV(\d+))?$")


@dataclass(frozen=True, order=True)
class Head:
    """One query head ``(layer, head)``; prints as ``L{layer}H{head}``."""

    layer: int
    head: int

    def __post_init__(self) -> None:
        for name in ("layer", "head"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise HeadSpecError(f"Head({self.layer!r}, {self.head!r}): {name} must be a non-negative int.")

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"


def parse_heads(spec: Any, cfg: Any) -> tuple[Head, ...]:
    """Expand a head specification into sorted, unique :class:`Head` s.

    Args:
        spec: a ``(layer, head)`` tuple, ``"L2H3"``, ``"L2"`` (every head of layer 2), ``"L2KV0"`` (every
            query head that reads KV head 0 of layer 2), a :class:`Head`, or an iterable of these.
        cfg: anything with ``n_layers``, ``n_heads`` and ``n_key_value_heads``.
    """
    n_layers, n_heads = int(cfg.n_layers), int(cfg.n_heads)
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    group = n_heads // n_kv
    heads: set[Head] = set()

    def check_layer(layer: int, raw: Any) -> None:
        if not 0 <= layer < n_layers:
            raise HeadSpecError(f"{raw!r}: layer {layer} is out of range; layers are 0..{n_layers - 1}.")

    def one(item: Any) -> None:
        if isinstance(item, Head):
            item = (item.layer, item.head)
        if isinstance(item, tuple) and len(item) == 2 and all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in item):
            layer, head = int(item[0]), int(item[1])
            check_layer(layer, item)
            if not 0 <= head < n_heads:
                raise HeadSpecError(f"{item!r}: head {head} is out of range; heads are 0..{n_heads - 1}.")
            heads.add(Head(layer, head))
            return
        if isinstance(item, str):
            m = _PATTERN.match(item.strip())
            if not m:
                raise HeadSpecError(
                    f"{item!r} is not a head spec; use 'L2H3' (layer 2 head 3), 'L2' (a whole layer) "
                    "or 'L2KV0' (the query heads of KV head 0)."
                )
            layer = int(m.group(1))
            check_layer(layer, item)
            if m.group(2) is not None:
                one((layer, int(m.group(2))))
            elif m.group(3) is not None:
                kv = int(m.group(3))
                if not 0 <= kv < n_kv:
                    raise HeadSpecError(f"{item!r}: KV head {kv} is out of range; KV heads are 0..{n_kv - 1}.")
                heads.update(Head(layer, h) for h in range(kv * group, (kv + 1) * group))
            else:
                heads.update(Head(layer, h) for h in range(n_heads))
            return
        if isinstance(item, Iterable) and not isinstance(item, (str, bytes, tuple)):
            for sub in item:
                one(sub)
            return
        if isinstance(item, tuple):
            for sub in item:
                one(sub)
            return
        raise HeadSpecError(f"{item!r} is not a head spec; use (layer, head), 'L2H3', 'L2' or 'L2KV0'.")

    one(spec)
    if not heads:
        raise HeadSpecError("the head specification is empty; name at least one head.")
    return tuple(sorted(heads))


def by_layer(heads: Iterable[Head]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for h in heads:
        out.setdefault(h.layer, []).append(h.head)
    return out
