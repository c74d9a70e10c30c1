"""The dry run of a knockout map: what ``specialization_map(..., plan=True)`` would run, without running it.

Counts follow the engines exactly (``phaselens.analyses.maps``, ``phaselens.analyses.knockout_runs``, ``phaselens.models.compressed.engine``):

* ``"full"``: the clean scoring pass and one pass per cell, each ``ceil(items / batch_size)`` forwards over
  every item's ``T`` tokens (times a phase ensemble's copies);
* ``"suffix"``: per query slot ``q`` and piece of ``n <= batch_size`` of its items, one prefill of ``q`` tokens per item (a chunked adapter makes
  it in ``ceil(q / chunk)`` pieces; counted once), one clean query step, and per cell a pass of the query
  rows through the layers at and above the cell's layer; cells share passes (``rows_per_pass`` rows; the
  DeepSeek-V4 adapter may split a pass further to stay within its ``pass_bytes``);
* mean and resample knockouts first calibrate: one forward per ``batch_size`` calibration items (256 by
  default, of the task's length), the same in both engines.

``token_passes`` counts token rows through the whole model (a query row from layer ``l`` of ``L`` counts
``(L - l) / L``); ``full_forwards`` divides it by ``items x T``: the map's cost in full forwards over the items.
Memory: the model's ``estimate_memory`` capability where it has one (the DeepSeek-V4 adapter: weights, every
slot's cache, a call's attention probabilities times four, logits, the pass budget), else an upper bound
from sizes (weights, one batch's ``[b, H, T, T]`` fp32 attention scores, its logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from phaselens.contract.protocol import capability, model_name
from phaselens.runtime.budget import forward_bytes

GiB = 2**30
CALIBRATION_ITEMS = 256  # phaselens.analyses.knockouts.calibrate's default


@dataclass(frozen=True)
class PlannedItems:
    """The shape of a run's items, known without building them: ``n`` items of ``seq_len`` tokens whose query
    slots are ``slots`` (slot -> items), residues mod ``modulus``; ``items_bytes`` to build them
    (:func:`phaselens.runtime.budget.items_bytes`) from ``n_residues`` residues."""

    n: int
    seq_len: int
    slots: dict[int, int]
    modulus: int
    items_bytes: int = 0
    n_residues: int = 0


@dataclass(frozen=True)
class MapPlan:
    """What a knockout map will run (see the module docstring for how each number is counted).

    ``items_bytes`` is the host memory the items take to build and ``available_bytes`` what this machine
    has now (``None``: unknown, or the items were passed built); ``fits`` says whether the items fit, and
    ``max_per_residue`` the largest ``n_per_residue`` that does.
    """

    model: str
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
        return (
            f"MapPlan({self.model}, engine {self.engine!r}:\n"
            f"  cells      {self.n_cells} ({kinds})\n"
            f"  items      {self.items:,} x {self.tokens} tokens, {self.query_slots} query slot(s){cal}\n"
            f"  forwards   {self.forwards:,} model calls{cal_f}\n"
            f"  tokens     {self.token_passes:,.0f} token passes = {self.full_forwards:,.1f} full forwards over "
            f"the items{cal_t}\n"
            f"  memory     ~{self.memory_bytes / GiB:.3g} GiB peak ({parts} GiB){host})"
        )


def _shape(batch: Any) -> tuple[int, int, list[tuple[int, int]], int]:
    """``(N, T, [(query slot, items)], modulus)`` of a built batch or of :class:`PlannedItems`."""
    if isinstance(batch, PlannedItems):
        return batch.n, batch.seq_len, sorted(batch.slots.items()), batch.modulus
    qp = torch.as_tensor(batch.query_pos).long()
    slots, counts = torch.unique(qp, return_counts=True)
    pairs = [(int(q), int(c)) for q, c in zip(slots.tolist(), counts.tolist())]
    return int(batch.tokens.shape[0]), int(batch.tokens.shape[1]), pairs, int(batch.modulus)


def plan_map(model: Any, batch: Any, cells: Any, *, engine: str, method: str, calibration: Any, batch_size: int,
             rows_per_pass: int) -> MapPlan:
    """The :class:`MapPlan` of ``specialization_map`` on ``batch`` (built, or :class:`PlannedItems`) with the
    ``cells`` frame (no model call, nothing of the size of the items allocated)."""
    from phaselens.runtime.budget import host_available, items_bytes

    N, T, slot_counts, modulus = _shape(batch)
    L = model.dims.n_layers
    copies = model.dims.copies
    first_slot = min(q for q, _ in slot_counts)
    layers = [int(x) for x in cells["layer"]]
    groups = _groups(slot_counts, batch_size)
    n_cal = _calibration_items(method, calibration, modulus)
    forwards = cal_forwards = math.ceil(n_cal / batch_size)  # calibrate runs batch_size items per forward
    tokens = cal_tokens = float(n_cal * T * copies)
    if engine == "full":
        forwards += (len(layers) + 1) * math.ceil(N / batch_size)
        tokens += (len(layers) + 1) * N * T * copies
    else:
        per_chunk = max(1, rows_per_pass // N)  # engine_metrics: cells per engine.run call
        for q, n, times in groups:
            per_pass = max(1, rows_per_pass // n)  # the slot engine: cells per pass of one layer
            forwards += times * ((1 if q > 0 else 0) + 1)  # the prefix prefill, the clean query step
            tokens += times * n * (q + 1)
            for j in range(0, len(layers), per_chunk):
                in_chunk = layers[j : j + per_chunk]
                forwards += times * sum(math.ceil(in_chunk.count(layer) / per_pass) for layer in set(in_chunk))
        tokens += sum(N * (L - layer) / L for layer in layers)
    memory = _memory(model, engine, N, T, first_slot, groups, batch_size, rows_per_pass, len(layers))
    if n_cal:  # calibration runs first, in forwards of batch_size items: the peak is the larger of the two
        cal = forward_bytes(model, T, min(batch_size, n_cal), T - first_slot)
        if sum(cal.values()) > sum(memory.values()):
            memory = {("calibration " + k if k != "weights" else k): v for k, v in cal.items()}
    kinds = {str(k): int(v) for k, v in cells["kind"].value_counts(sort=False).items()}
    need = avail = most = None
    if isinstance(batch, PlannedItems):
        need, avail = batch.items_bytes, host_available()
        if avail is not None and batch.n_residues:
            most = int(avail // max(items_bytes(batch.n_residues, T), 1))
    return MapPlan(model_name(model), engine, kinds, N, T, len(slot_counts), int(forwards), tokens,
                   tokens / max(N * T, 1), n_cal, cal_forwards, cal_tokens, sum(memory.values()), memory,
                   need or 0, avail, most)


def _groups(slot_counts: list[tuple[int, int]], batch_size: int) -> list[tuple[int, int, int]]:
    """``(query slot, rows, times)`` of the engine's groups: each slot's rows in pieces of at most
    ``batch_size`` (``times`` pieces of that size; counted, not listed, so a plan of billions of items is
    instant)."""
    out = []
    for q, n in slot_counts:
        full, rest = divmod(int(n), int(batch_size))
        if full:
            out.append((int(q), int(batch_size), full))
        if rest:
            out.append((int(q), rest, 1))
    return out


def _calibration_items(method: str, calibration: Any, modulus: int) -> int:
    if method == "zero":
        return 0
    if calibration is None:
        return max(1, CALIBRATION_ITEMS // modulus) * modulus
    if isinstance(calibration, torch.Tensor):
        return int(calibration.shape[0])
    if hasattr(calibration, "query_pos"):
        return len(calibration.query_pos)
    return 0  # a Calibration: already computed


def _memory(model: Any, engine: str, N: int, T: int, first_slot: int, groups: list[tuple[int, int, int]],
            batch_size: int, rows_per_pass: int, n_cells: int) -> dict[str, int]:
    """Bytes of the map's largest step: a batch forward (full engine), or the cached prefixes, a prefill call
    and a cell pass (suffix engine)."""
    estimate = capability(model, "estimate_memory")
    if engine == "full" or estimate is None:
        return forward_bytes(model, T, min(batch_size, N), T - first_slot)
    # the engine's prefill of each group: the prefix (in the adapter's pieces), then the query row, kept cached
    per_group = [estimate(q + 1, batch=n, query_len=1, logits="query") for q, n, _ in groups]
    return {"weights": per_group[0].weights,
            "cache": sum(e.cache * times for e, (_, _, times) in zip(per_group, groups)),  # every group's prefix
            "attention": max(4 * e.attention for e in per_group),
            "passes": max(_pass_bytes(model, q, n, e.cache, rows_per_pass, n_cells)
                          for (q, n, _), e in zip(groups, per_group))}


def _pass_bytes(model: Any, q: int, n: int, cache: int, rows_per_pass: int, n_cells: int) -> int:
    """One cell pass of the query-suffix engine: its rows' repeated cache and attention (keys ``[keys, d]`` and
    score tensors ``[H, keys]`` per row), capped by the engine's ``pass_bytes`` budget."""
    from phaselens.contract.cells import PASS_BYTES

    cfg = model.dims
    strides = [s.stride for s in cfg.phase_specs if s is not None]
    keys = int(cfg.local_window or 0) + (q + 1) // min(strides, default=q + 1)
    item = torch.empty((), dtype=cfg.dtype).element_size()
    per_row = cache // max(n, 1) + keys * (int(cfg.d_head) + 4 * int(cfg.n_heads)) * item
    return min(PASS_BYTES, per_row * min(rows_per_pass, n * n_cells))
