"""The query engines' shared parts: a cell (one intervention), the loop over cells by layer, and the
engine for items whose query positions differ.

An intervention on ``z`` at the query position changes nothing at earlier positions, so a model's
*slot engine* runs the clean prefix once and then only the query rows per cell. The slot engines are the
models' own (``phaselens.models.compressed.engine.SuffixEngine``, the DeepSeek-V4 adapter's); what they share
lives here, and analyses reach them only through the ``query_engine`` capability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from phaselens.core.errors import InputError

PASS_BYTES = 2**30  # default memory budget of one cell pass (its repeated cache and attention temporaries)


@dataclass
class Cell:
    """One intervention: at ``layer``, replace ``z`` of the ``heads`` at the query position.

    ``replacement`` is ``[N, len(heads), d]`` (per item) or ``[len(heads), d]`` (shared); ``None`` means zero.
    """

    layer: int
    heads: Sequence[int]
    replacement: Tensor | None = None


def run_by_layer(cells: Sequence[Cell], per_pass: Callable[[int], int],
                 run: Callable[[int, list[Cell]], Tensor], progress: Any = None) -> Tensor:
    """Run ``cells`` grouped by layer, at most ``per_pass(layer)`` cells per ``run(layer, cells)`` call (which
    returns ``[c, N, V]``); a query engine's shared loop. Returns ``[C, N, V]`` in the cells' order."""
    out: list[Tensor | None] = [None] * len(cells)
    by_layer: dict[int, list[int]] = {}
    for i, c in enumerate(cells):
        by_layer.setdefault(int(c.layer), []).append(i)
    for layer, idxs in sorted(by_layer.items()):
        step = per_pass(layer)
        for j in range(0, len(idxs), step):
            chunk = idxs[j : j + step]
            logits = run(layer, [cells[i] for i in chunk])
            for k, i in enumerate(chunk):
                out[i] = logits[k]
            if progress is not None:
                progress.update(len(chunk))
    return torch.stack(out)  # type: ignore[arg-type]


class QueryEngine:
    """The query-suffix engine for items whose query positions may differ.

    Rows are grouped by query slot (and a slot's rows split into pieces of at most ``batch_size``); each group
    gets one :class:`SuffixEngine` (one clean prefix pass), and every cell runs on every group. Results come
    back in the items' order, so callers never see the groups.

    Args:
        model: a model with a per-slot engine (``slot_engine``).
        tokens: ``[N, T]``; query_pos: ``[N]`` the slot whose logits are scored in each row.
        slot_engine: builds the engine of one slot, ``slot_engine(model, tokens [n, T], q, rows_per_pass=...)``
            with ``clean_logits [n, V]``, ``clean_z[layer] [n, H, d]`` and ``run(cells) -> [C, n, V]``
            (the compressed transformer's :class:`~phaselens.models.compressed.engine.SuffixEngine`, the
            DeepSeek-V4 adapter's own).
        batch_size: at most this many rows per group, so per prefill call (``None``: a slot's rows together).
    """

    def __init__(self, model: Any, tokens: Tensor, query_pos: Tensor, *, rows_per_pass: int = 4096,
                 slot_engine: Callable[..., Any], batch_size: int | None = None) -> None:
        qp = torch.as_tensor(query_pos).long().cpu()
        if qp.dim() != 1 or len(qp) != tokens.shape[0]:
            raise InputError(f"query_pos must be [N] = [{tokens.shape[0]}], got {tuple(qp.shape)}.")
        self.N = len(qp)
        self.groups: list[tuple[Tensor, Any]] = []
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise InputError(f"batch_size must be a positive int or None, got {batch_size!r}.")
        for q in torch.unique(qp).tolist():
            slot_rows = torch.nonzero(qp == q).flatten()
            step = batch_size or len(slot_rows)
            for rows in slot_rows.split(step):
                self.groups.append((rows, slot_engine(model, tokens[rows], int(q), rows_per_pass=rows_per_pass)))
        if not bool(torch.isfinite(self.clean_logits).all()):  # a NaN/inf weight: never a map of NaN effects
            from phaselens.runtime.finite import raise_nonfinite

            raise_nonfinite(model, lambda: model(tokens))

    @property
    def clean_logits(self) -> Tensor:
        """Clean logits at each item's query slot ``[N, V]``."""
        return self._scatter([eng.clean_logits for _, eng in self.groups], 0)

    def clean_z(self, layer: int) -> Tensor:
        """Clean per-head ``z`` at each item's query slot ``[N, H, d]``."""
        return self._scatter([eng.clean_z[layer] for _, eng in self.groups], 0)

    def run(self, cells: Sequence[Cell]) -> Tensor:
        """Logits at each item's query slot under each cell: ``[C, N, V]``.

        A cell's per-item replacement ``[N, h, d]`` is split among the groups by row.
        """
        outs = []
        for rows, eng in self.groups:
            sub = [c if c.replacement is None or c.replacement.dim() != 3 else
                   Cell(c.layer, c.heads, c.replacement[rows]) for c in cells]
            outs.append(eng.run(sub))
        return self._scatter(outs, 1)

    def _scatter(self, parts: list[Tensor], dim: int) -> Tensor:
        if len(parts) == 1:
            return parts[0]
        shape = list(parts[0].shape)
        shape[dim] = self.N
        out = parts[0].new_empty(shape)
        for (rows, _), part in zip(self.groups, parts):
            out.index_copy_(dim, rows.to(out.device), part)
        return out
