"""What a run of an analysis runs, declared as data: its passes over the items, its cells, its engine.

Each analysis says, in :meth:`~phaselens.analyses.runner.Analysis.units`, what it will run for a model and its
checked options (nothing is run to say it): :class:`Units`. ``phaselens.plan`` (:mod:`phaselens.planning`)
reads it, with the shape of the items, and counts forwards, token passes and the peak memory; the analysis
never prices itself. A pass over the items is ``ceil(N / batch_size)`` forwards of ``batch_size`` items of
``T`` tokens (times ``copies``); the query-suffix engine instead prefills each query slot's prefix once per piece
of at most ``batch_size`` items, takes one clean query step, then one pass of the query rows per cell from the
cell's layer up, several cells per pass (``rows_per_pass`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINE_SCOPES = ("items", "block")


@dataclass(frozen=True)
class Units:
    """An analysis's passes over its ``N`` items, as data.

    Attributes:
        engine: ``"full"`` (every pass a forward of every item) or ``"suffix"`` (the query-suffix engine runs
            the cells: see the module docstring).
        item_passes: forwards of every item besides the cells' (clean scoring, the corrupted run, the
            source's captured ``z``; with the suffix engine its own clean query step is not one of them).
        cells: the interventions by kind (``{"head": 16, "layer": 4}``): with the full engine each is one more
            forward of every item; with the suffix engine one query-row pass from its layer.
        cell_layers: the layer of each cell, in order (the suffix engine's pass starts there).
        engine_scope: the suffix engine runs over all the items at once (``"items"``) or once per block of
            ``batch_size`` items (``"block"``, as ``ablate`` does).
        rows_per_pass: query rows the suffix engine runs per pass (cells share passes, never across calls).
        cells_per_call: cells per call of the suffix engine (a pass holds cells of one call only).
        calibration_items: items of the task's length forwarded first, ``calibration_batch`` per forward (the
            mean and resample knockouts' calibration).
        copies: forwards of each item per pass (phase repair's shifted copies, batched in one call), each
            ``extra_tokens`` tokens longer than the item.
        backward: each pass also runs a backward (gradients: ``attribution_map``).
        weight_copies: copies of the weights held at once (a gate-cycled copy beside the model).
        unit: what one unit of the progress bar and journal is (``"block"``, ``"cell"``, ``"copy"``).
    """

    engine: str = "full"
    item_passes: int = 1
    cells: dict[str, int] = field(default_factory=dict)
    cell_layers: tuple[int, ...] = ()
    engine_scope: str = "items"
    rows_per_pass: int = 4096
    cells_per_call: int = 1
    calibration_items: int = 0
    calibration_batch: int = 64
    copies: int = 1
    extra_tokens: int = 0
    backward: bool = False
    weight_copies: int = 1
    unit: str = "block"

    def __post_init__(self) -> None:
        # a declaration is the analysis's own code: a wrong one is a bug, not a user's input
        assert self.engine in ("full", "suffix"), self.engine
        assert self.engine_scope in ENGINE_SCOPES, self.engine_scope
        assert sum(self.cells.values()) == len(self.cell_layers) or not self.cell_layers, (self.cells,
                                                                                         self.cell_layers)

    @property
    def n_cells(self) -> int:
        return sum(self.cells.values())


__all__ = ["ENGINE_SCOPES", "Units"]
