"""The plan of a run on a model: :class:`Plan` (what ``phaselens.plan(model, analysis, ...)`` returns) and
:func:`plan_run`, which fills it from the analysis's declared :class:`~phaselens.analyses.units.Units`, the
items' shape and the model's sizes (counts: :mod:`.counting`; memory: :mod:`.peak_memory`). Nothing is run
and nothing of the size of the items is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phaselens.analyses.units import Units
from phaselens.contract.protocol import model_name
from phaselens.planning.counting import count
from phaselens.planning.peak_memory import peak_memory
from phaselens.planning.planned_items import PlannedItems
from phaselens.runtime.budget import host_available, items_bytes

GiB = 2**30


@dataclass(frozen=True)
class Plan:
    """What a run of ``analysis`` on ``model`` will run (see :mod:`phaselens.planning.counting` for how each
    number is counted).

    ``cells`` are the interventions by kind (empty for an analysis without cells); ``items_bytes`` is the host
    memory the items take to build and ``available_bytes`` what this machine has now (``None``: unknown, or the
    items were passed built); ``fits`` says whether the items fit, and ``max_per_residue`` the largest
    ``n_per_residue`` that does. ``notes`` say what the numbers leave out.
    """

    model: str
    analysis: str
    engine: str
    cells: dict[str, int]
    items: int
    tokens: int
    query_slots: int  # distinct query slots (the suffix engine caches one prefix per slot and batch of items)
    forwards: int
    token_passes: float
    full_forwards: float
    calibration_items: int
    calibration_forwards: int
    calibration_token_passes: float
    memory_bytes: int
    memory: dict[str, int] = field(default_factory=dict)
    items_bytes: int = 0
    available_bytes: int | None = None
    max_per_residue: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def n_cells(self) -> int:
        return sum(self.cells.values())

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.items_bytes <= self.available_bytes

    def __repr__(self) -> str:
        kinds = ", ".join(f"{v} {k}" for k, v in self.cells.items())
        parts = ", ".join(f"{k} {v / GiB:.3g}" for k, v in self.memory.items())
        cal = f"; calibration {self.calibration_items} items" if self.calibration_items else ""
        full = self.token_passes / self.full_forwards if self.full_forwards else 1.0
        cal_f = f" ({self.calibration_forwards:,} for calibration)" if self.calibration_items else ""
        cal_t = (f" ({self.calibration_token_passes / full:,.1f} for calibration)" if self.calibration_items
                 else "")
        host = ""
        if self.items_bytes:
            host = f"\n  host       ~{self.items_bytes / GiB:,.3g} GiB to build the items"
            if self.available_bytes is not None:
                host += (" (fits in the memory available now)" if self.fits else
                         f": does NOT fit in the {self.available_bytes / GiB:,.3g} GiB available; use "
                         f"n_per_residue={self.max_per_residue:,} or fewer")
        cells = f"  cells      {self.n_cells} ({kinds})\n" if self.cells else ""
        notes = "".join(f"\n  note       {n}" for n in self.notes)
        return (
            f"Plan({self.analysis} on {self.model}, engine {self.engine!r}:\n{cells}"
            f"  items      {self.items:,} x {self.tokens} tokens, {self.query_slots} query slot(s){cal}\n"
            f"  forwards   {self.forwards:,} model calls{cal_f}\n"
            f"  tokens     {self.token_passes:,.0f} token passes = {self.full_forwards:,.1f} full forwards over "
            f"the items{cal_t}\n"
            f"  memory     ~{self.memory_bytes / GiB:.3g} GiB peak ({parts} GiB){host}{notes})"
        )


def plan_run(model: Any, analysis: str, units: Units, items: PlannedItems, *, batch_size: int) -> Plan:
    """The :class:`Plan` of a run that declares ``units`` over ``items`` (planned, or the shape of a built
    batch: ``items_bytes`` 0)."""
    N, T = items.n, items.seq_len
    counts = count(units, items, batch_size=batch_size, n_layers=model.dims.n_layers, copies=model.dims.copies)
    memory = peak_memory(model, units, items, counts.groups, batch_size=batch_size)
    avail = most = None
    if items.items_bytes:
        avail = host_available()
        if avail is not None:
            most = int(avail // max(items_bytes(items.n_residues, T), 1))
    notes = ("with gradients: the memory is a forward's, a lower bound for the backward",) if units.backward else ()
    return Plan(model_name(model), analysis, units.engine, dict(units.cells), N, T, len(set(items.order)),
                counts.forwards, counts.token_passes, counts.token_passes / max(N * T, 1), units.calibration_items,
                counts.calibration_forwards, counts.calibration_token_passes, sum(memory.values()), memory,
                items.items_bytes, avail, most, notes)


__all__ = ["Plan", "plan_run"]
