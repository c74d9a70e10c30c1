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
from phaselens.contract.cells import Cell
from phaselens.core.heads import by_layer
from phaselens.errors import NotApplicableError


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
    """Run ``kos`` through a query engine, ``per_pass`` cells at a time; ``on_chunk(indices, metrics)`` after each.
    Where the engine measures rounding margins, each metrics dict also holds ``fragile`` ``[N]`` (bool: the
    cell's item took a top-k or FP8/FP4 decision within rounding of flipping; ``SlotEngine.last_fragile``)."""
    for j in range(0, len(kos), per_pass):
        idx = list(range(j, min(j + per_pass, len(kos))))
        logits = engine.run([knockout_cell(kos[i], len(batch)) for i in idx])
        fragile = getattr(engine, "last_fragile", None)
        metrics = [answer_metrics(lg, batch.answer, batch.wrong) for lg in logits]
        if fragile is not None:
            for m, f in zip(metrics, fragile.cpu().numpy()):
                m["fragile"] = f
        on_chunk(idx, metrics)


KO_FIELDS = ("correct_ko", "logit_diff_ko")  # with scoring.METRICS: one item block of ``ablate``


def ablate_block(model: Any, batch: Any, ko: Knockout, cell: Cell | None, block: slice, *, batch_size: int = 64
                 ) -> tuple[np.ndarray, ...]:
    """Clean :data:`~phaselens.analyses.scoring.METRICS` and knocked-out :data:`KO_FIELDS` of one block of
    items (``[b]`` each).

    ``cell`` (the suffix engine's knockout, a per-item ``resample`` replacement drawn for all items) runs one
    query engine over the block; ``cell=None`` runs a clean and a hooked forward, the knockout at each item's
    own query slot.
    """
    from phaselens.analyses.scoring import METRICS, block_logits

    def hooked(tokens: torch.Tensor, query_pos: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return model_logits(model, tokens, query_pos, ko.fwd_hooks(query_pos, items=items))

    if cell is None:
        clean_lg = block_logits(lambda t, q, _i: model_logits(model, t, q), batch.tokens, batch.query_pos, block)
        ko_lg = block_logits(hooked, batch.tokens, batch.query_pos, block)
    else:
        eng = model.query_engine(batch.tokens[block], batch.query_pos[block], batch_size=batch_size)
        per_item = cell.replacement is not None and cell.replacement.dim() == 3
        ko_lg = eng.run([Cell(cell.layer, cell.heads, cell.replacement[block]) if per_item else cell])[0]
        clean_lg = eng.clean_logits
    clean = answer_metrics(clean_lg, batch.answer[block], batch.wrong[block])
    ko_m = answer_metrics(ko_lg, batch.answer[block], batch.wrong[block])
    return (*(clean[k] for k in METRICS), ko_m["correct"], ko_m["logit_diff"])
