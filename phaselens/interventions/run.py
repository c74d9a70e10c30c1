"""Run knockouts over task items, by the engine the model offers: shared by ``ablate`` and the maps.

* ``"full"``: one hooked forward per batch of items, the knockout at each item's own query slot;
* ``"suffix"``: the model's query-suffix engine (``query_engine`` capability): the clean prefix once, then only
  the query rows per knockout, many knockouts per pass.

Both give the same numbers (tests hold them to 1e-5); ``resample`` draws by item so they draw alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from phaselens.engine import Cell
from phaselens.errors import NotApplicableError
from phaselens.heads import by_layer
from phaselens.interventions.knockout import Knockout, resample_index
from phaselens.scoring import answer_metrics, model_logits, query_metrics


def full_metrics(model: Any, batch: Any, ko: Knockout, *, batch_size: int = 64, progress: bool = False,
                 desc: str = "knockout") -> dict[str, np.ndarray]:
    """Answer metrics ``{name: [N]}`` of ``batch`` with ``ko`` at each item's query slot (full forwards)."""

    def forward(tokens: torch.Tensor, query_pos: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return model_logits(model, tokens, query_pos, ko.fwd_hooks(query_pos, items=items))

    return query_metrics(forward, batch, batch_size=batch_size, progress=progress, desc=desc, model=model)


def knockout_cell(ko: Knockout, n_items: int) -> Cell:
    """The engine cell of a single-layer knockout (``resample`` draws by item, as :func:`full_metrics`)."""
    layers = by_layer(ko.heads)
    if len(layers) != 1:
        raise NotApplicableError(f"the query-suffix engine runs one layer per cell; {len(layers)} layers given. "
                                 "Use engine='full'.")
    (layer, heads), = layers.items()
    if ko.method == "zero":
        return Cell(layer, heads, None)
    assert ko.calibration is not None
    z = ko.calibration.z[layer][:, heads]  # [Ncal, h, d]
    if ko.method == "mean":
        return Cell(layer, heads, z.mean(0))
    return Cell(layer, heads, z[resample_index(z.shape[0], n_items, ko.seed)])


def engine_metrics(engine: Any, batch: Any, kos: Sequence[Knockout], *, per_pass: int,
                   on_chunk: Callable[[list[int], list[dict[str, np.ndarray]]], None]) -> None:
    """Run ``kos`` through a query engine, ``per_pass`` cells at a time; ``on_chunk(indices, metrics)`` after each."""
    for j in range(0, len(kos), per_pass):
        idx = list(range(j, min(j + per_pass, len(kos))))
        logits = engine.run([knockout_cell(kos[i], len(batch)) for i in idx])
        on_chunk(idx, [answer_metrics(lg, batch.answer, batch.wrong) for lg in logits])


def suffix_blocks(model: Any, batch: Any, ko: Knockout, *, batch_size: int = 64,
                  progress: bool = False) -> tuple[Any, dict[str, np.ndarray]]:
    """Clean items and knocked-out metrics ``{"correct", "logit_diff": [N]}`` by the query-suffix engine, one
    engine (clean prefix) per block of ``batch_size`` items; under torch.distributed the blocks are split
    across ranks. A per-item ``resample`` replacement is drawn for all items, then sliced per block."""
    from phaselens.distributed import block_labels, item_blocks, shard_map
    from phaselens.evaluate import items_from_metrics
    from phaselens.scoring import METRICS

    cell = knockout_cell(ko, len(batch))
    blocks = item_blocks(len(batch), batch_size)

    def compute(idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        out = []
        for b in idx:
            sl = blocks[b]
            eng = model.query_engine(batch.tokens[sl], batch.query_pos[sl], batch_size=batch_size)
            per_item = cell.replacement is not None and cell.replacement.dim() == 3
            logits = eng.run([Cell(cell.layer, cell.heads, cell.replacement[sl]) if per_item else cell])[0]
            clean = answer_metrics(eng.clean_logits, batch.answer[sl], batch.wrong[sl])
            ko_m = answer_metrics(logits, batch.answer[sl], batch.wrong[sl])
            out.append((*(clean[k] for k in METRICS), ko_m["correct"], ko_m["logit_diff"]))
        return out

    parts = shard_map(compute, block_labels(blocks), progress=progress, stage="ablate", model=model)
    cat = [np.concatenate([p[j] for p in parts]) for j in range(len(METRICS) + 2)]
    clean_items = items_from_metrics(batch, dict(zip(METRICS, cat)))
    return clean_items, {"correct": cat[-2], "logit_diff": cat[-1]}
