"""Typed head specifications: ``(2, 3)``, ``"L2H3"``, ``"L2"`` (a whole layer), ``"L2KV0"`` (a KV group)."""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from phaselens.errors import HeadSpecError

# "L<layer>", then optionally "H<head>" or "KV<kv head>"; each part is checked on its own (see _string_parts)
_FORM = re.compile(r"^L(?P<layer>[^HK]*)(?:(?P<sep>H|KV)(?P<index>.*))?$")
_INT = re.compile(r"[0-9]+")
_FORMS = "use 'L2H3' (layer 2 head 3), 'L2' (a whole layer) or 'L2KV0' (the query heads of KV head 0)"


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


def _is_index(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_pair(item: Any) -> bool:
    """A ``(layer, head)`` pair, well-formed or not: a tuple holding a number and no spec (``"L2H3"``, a
    :class:`Head`, a nested tuple), so that ``(2, 3.5)`` is read as one head whose head part is wrong."""
    def spec_like(x: Any) -> bool:
        return isinstance(x, Head) or (isinstance(x, str) and x.strip().startswith("L")) or (
            isinstance(x, Iterable) and not isinstance(x, str))

    return isinstance(item, tuple) and any(isinstance(x, numbers.Number) for x in item) and not any(
        spec_like(x) for x in item)


def _pair_parts(item: tuple[Any, ...]) -> tuple[int, int]:
    """``(layer, head)`` of a pair, blaming the element that is not an integer (ranges are checked after)."""
    if len(item) != 2:
        raise HeadSpecError(f"{item!r}: a head is (layer, head), two integers, not {len(item)} values; e.g. (2, 3).")
    for name, x in zip(("layer", "head"), item):
        if not _is_index(x):
            raise HeadSpecError(f"{item!r}: the {name} {x!r} is not an integer; a head is (layer, head) with "
                                "integers, e.g. (2, 3).")
    return int(item[0]), int(item[1])


def _string_parts(item: str) -> tuple[int, str | None, int | None]:
    """``(layer, "H" | "KV" | None, index)`` of a string spec, naming the part that is not an integer."""
    m = _FORM.match(item.strip())
    if not m:
        raise HeadSpecError(f"{item!r} is not a head spec; {_FORMS}.")
    sep = m.group("sep")
    what = {None: "layer", "H": "head", "KV": "KV head"}
    parts = [("layer", m.group("layer"))] + ([(what[sep], m.group("index"))] if sep else [])
    for name, text in parts:
        if not _INT.fullmatch(text):
            got = f"is {text!r}, not a non-negative integer" if text else "is missing"
            raise HeadSpecError(f"{item!r}: the {name} number {got}; {_FORMS}.")
    return int(m.group("layer")), sep, (int(m.group("index")) if sep else None)


def parse_heads(spec: Any, cfg: Any) -> tuple[Head, ...]:
    """Expand a head specification into sorted, unique :class:`Head` s.

    Args:
        spec: a ``(layer, head)`` tuple, ``"L2H3"``, ``"L2"`` (every head of layer 2), ``"L2KV0"`` (every
            query head that reads KV head 0 of layer 2), a :class:`Head`, or an iterable of these.
        cfg: anything with ``n_layers``, ``n_heads`` and ``n_key_value_heads``.

    Raises:
        HeadSpecError: naming the part that is wrong (``'L2H3.5'``: the head number ``'3.5'``; ``(2.0, 3)``:
            the layer ``2.0``) and the valid range or form.
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
        if _is_pair(item):
            layer, head = _pair_parts(item)
            check_layer(layer, item)
            if not 0 <= head < n_heads:
                raise HeadSpecError(f"{item!r}: head {head} is out of range; heads are 0..{n_heads - 1}.")
            heads.add(Head(layer, head))
            return
        if isinstance(item, str):
            layer, sep, index = _string_parts(item)
            check_layer(layer, item)
            if sep == "H":
                if not 0 <= index < n_heads:
                    raise HeadSpecError(f"{item!r}: head {index} is out of range; heads are 0..{n_heads - 1}.")
                heads.add(Head(layer, index))
            elif sep == "KV":
                if not 0 <= index < n_kv:
                    raise HeadSpecError(f"{item!r}: KV head {index} is out of range; KV heads are 0..{n_kv - 1}.")
                heads.update(Head(layer, h) for h in range(index * group, (index + 1) * group))
            else:
                heads.update(Head(layer, h) for h in range(n_heads))
            return
        if isinstance(item, Iterable) and not isinstance(item, bytes):
            for sub in item:
                one(sub)
            return
        if _is_index(item):  # a bare layer number (e.g. [2, 3] meant as one head)
            raise HeadSpecError(f"{item!r} alone is not a head spec; a head is ({item}, head) or 'L{item}H0', a whole "
                                f"layer 'L{item}'.")
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
