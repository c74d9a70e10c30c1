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

from phaselens.analyses.knockouts import Knockout, resample_index
from phaselens.analyses.scoring import answer_metrics, model_logits, query_metrics
from phaselens.core.errors import NotApplicableError
from phaselens.core.heads import by_layer
from phaselens.runtime.engines import Cell


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


KO_FIELDS = ("correct_ko", "logit_diff_ko")  # with scoring.METRICS: one item block of ``ablate``


def ablate_blocks(model: Any, batch: Any, ko: Knockout, *, engine: str, batch_size: int = 64,
                  progress: bool = False, store: Any = None) -> tuple[Any, dict[str, np.ndarray]]:
    """Clean items and knocked-out metrics ``{"correct", "logit_diff": [N]}``, one unit per block of
    ``batch_size`` items (split across ranks under torch.distributed; ``store``: a checkpoint of finished
    blocks, fields ``METRICS + KO_FIELDS``).

    ``engine="suffix"`` builds one query engine (clean prefix) per block; a per-item ``resample``
    replacement is drawn for all items, then sliced per block. ``engine="full"`` runs a clean and a hooked
    forward per block, the knockout at each item's own query slot.
    """
    from phaselens.analyses.scoring import METRICS, block_logits, items_from_metrics
    from phaselens.runtime.distributed import block_labels, item_blocks, shard_map

    blocks = item_blocks(len(batch), batch_size)
    cell = knockout_cell(ko, len(batch)) if engine == "suffix" else None

    def hooked(tokens: torch.Tensor, query_pos: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return model_logits(model, tokens, query_pos, ko.fwd_hooks(query_pos, items=items))

    def one(sl: slice) -> tuple[torch.Tensor, torch.Tensor]:  # clean and knocked-out query logits [b, V]
        if cell is None:
            clean = block_logits(lambda t, q, _i: model_logits(model, t, q), batch.tokens, batch.query_pos, sl)
            return clean, block_logits(hooked, batch.tokens, batch.query_pos, sl)
        eng = model.query_engine(batch.tokens[sl], batch.query_pos[sl], batch_size=batch_size)
        per_item = cell.replacement is not None and cell.replacement.dim() == 3
        logits = eng.run([Cell(cell.layer, cell.heads, cell.replacement[sl]) if per_item else cell])[0]
        return eng.clean_logits, logits

    def compute(idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        out = []
        for b in idx:
            sl = blocks[b]
            clean_lg, ko_lg = one(sl)
            clean = answer_metrics(clean_lg, batch.answer[sl], batch.wrong[sl])
            ko_m = answer_metrics(ko_lg, batch.answer[sl], batch.wrong[sl])
            out.append((*(clean[k] for k in METRICS), ko_m["correct"], ko_m["logit_diff"]))
        return out

    parts = shard_map(compute, block_labels(blocks), store=store, progress=progress, stage="ablate", model=model)
    cat = [np.concatenate([p[j] for p in parts]) for j in range(len(METRICS) + 2)]
    clean_items = items_from_metrics(batch, dict(zip(METRICS, cat)))
    return clean_items, {"correct": cat[-2], "logit_diff": cat[-1]}
