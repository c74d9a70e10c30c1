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

GiB = 2**30
CALIBRATION_ITEMS = 256  # phaselens.analyses.knockouts.calibrate's default


@dataclass(frozen=True)
class MapPlan:
    """What a knockout map will run (see the module docstring for how each number is counted)."""

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

    @property
    def n_cells(self) -> int:
        return sum(self.cells.values())

    def __repr__(self) -> str:
        kinds = ", ".join(f"{v} {k}" for k, v in self.cells.items())
        parts = ", ".join(f"{k} {v / GiB:.3g}" for k, v in self.memory.items())
        cal = f"; calibration {self.calibration_items} items" if self.calibration_items else ""
        full = self.token_passes / self.full_forwards if self.full_forwards else 1.0
        cal_f = f" ({self.calibration_forwards:,} for calibration)" if self.calibration_items else ""
        cal_t = (f" ({self.calibration_token_passes / full:,.1f} for calibration)" if self.calibration_items
                 else "")
        return (
            f"MapPlan({self.model}, engine {self.engine!r}:\n"
            f"  cells      {self.n_cells} ({kinds})\n"
            f"  items      {self.items} x {self.tokens} tokens, {self.query_slots} query slot(s){cal}\n"
            f"  forwards   {self.forwards:,} model calls{cal_f}\n"
            f"  tokens     {self.token_passes:,.0f} token passes = {self.full_forwards:,.1f} full forwards over "
            f"the items{cal_t}\n"
            f"  memory     ~{self.memory_bytes / GiB:.3g} GiB peak ({parts} GiB))"
        )


def plan_map(model: Any, batch: Any, cells: Any, *, engine: str, method: str, calibration: Any, batch_size: int,
             rows_per_pass: int) -> MapPlan:
    """The :class:`MapPlan` of ``specialization_map`` on ``batch`` with the ``cells`` frame (no model call)."""
    N, T = int(batch.tokens.shape[0]), int(batch.tokens.shape[1])
    L = int(model.cfg.n_layers)
    copies = int(getattr(model, "cost", 1) or 1)
    qp = torch.as_tensor(batch.query_pos).long()
    slots, counts = torch.unique(qp, return_counts=True)
    layers = [int(x) for x in cells["layer"]]
    n_cal = _calibration_items(method, calibration, batch.modulus)
    forwards = cal_forwards = math.ceil(n_cal / batch_size)  # calibrate runs batch_size items per forward
    tokens = cal_tokens = float(n_cal * T * copies)
    if engine == "full":
        forwards += (len(layers) + 1) * math.ceil(N / batch_size)
        tokens += (len(layers) + 1) * N * T * copies
    else:
        per_chunk = max(1, rows_per_pass // N)  # engine_metrics: cells per engine.run call
        for q, n in _groups(slots, counts, batch_size):
            per_pass = max(1, rows_per_pass // n)  # the slot engine: cells per pass of one layer
            forwards += (1 if q > 0 else 0) + 1  # the prefix prefill, the clean query step
            tokens += n * (q + 1)
            for j in range(0, len(layers), per_chunk):
                in_chunk = layers[j : j + per_chunk]
                forwards += sum(math.ceil(in_chunk.count(layer) / per_pass) for layer in set(in_chunk))
        tokens += sum(N * (L - layer) / L for layer in layers)
    memory = _memory(model, engine, N, T, qp, _groups(slots, counts, batch_size), batch_size, rows_per_pass,
                     len(layers))
    if n_cal:  # calibration runs first, in forwards of batch_size items: the peak is the larger of the two
        cal = _forward_memory(model, capability(model, "estimate_memory"), T, min(batch_size, n_cal),
                              T - int(qp.min()))
        if sum(cal.values()) > sum(memory.values()):
            memory = {("calibration " + k if k != "weights" else k): v for k, v in cal.items()}
    kinds = {str(k): int(v) for k, v in cells["kind"].value_counts(sort=False).items()}
    return MapPlan(model_name(model), engine, kinds, N, T, len(slots), int(forwards), tokens,
                   tokens / max(N * T, 1), n_cal, cal_forwards, cal_tokens, sum(memory.values()), memory)


def _groups(slots: torch.Tensor, counts: torch.Tensor, batch_size: int) -> list[tuple[int, int]]:
    """``(query slot, rows)`` of the engine's groups: each slot's rows in pieces of at most ``batch_size``."""
    out = []
    for q, n in zip(slots.tolist(), counts.tolist()):
        out += [(int(q), min(batch_size, n - i)) for i in range(0, n, batch_size)]
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


def _memory(model: Any, engine: str, N: int, T: int, qp: torch.Tensor, groups: list[tuple[int, int]],
            batch_size: int, rows_per_pass: int, n_cells: int) -> dict[str, int]:
    """Bytes of the map's largest step: a batch forward (full engine), or the cached prefixes, a prefill call
    and a cell pass (suffix engine)."""
    estimate = capability(model, "estimate_memory")
    if engine == "full" or estimate is None:
        return _forward_memory(model, estimate, T, min(batch_size, N), T - int(qp.min()))
    # the engine's prefill of each group: the prefix (in the adapter's pieces), then the query row, kept cached
    per_group = [estimate(q + 1, batch=n, query_len=1, logits="query") for q, n in groups]
    return {"weights": per_group[0].weights, "cache": sum(e.cache for e in per_group),  # every group's prefix
            "attention": max(4 * e.attention for e in per_group),
            "passes": max(_pass_bytes(model, q, n, e.cache, rows_per_pass, n_cells)
                          for (q, n), e in zip(groups, per_group))}


def _forward_memory(model: Any, estimate: Any, T: int, b: int, query_rows: int) -> dict[str, int]:
    """Bytes of one scored forward of ``b`` items (as ``model_logits`` makes it: query rows' logits only)."""
    if estimate is not None:
        query_len = None if getattr(model, "chunk", None) is None else query_rows  # hooked rows when chunked
        e = estimate(T, batch=b, query_len=query_len, logits="query")
        return {"weights": e.weights, "cache": e.cache, "attention": 4 * e.attention, "logits": e.logits}
    from phaselens.runtime.fingerprints import torch_module

    module = torch_module(model)
    weights = 0 if module is None else sum(t.numel() * t.element_size() for t in [*module.parameters(),
                                                                                  *module.buffers()])
    cfg = model.cfg
    b *= int(getattr(model, "cost", 1) or 1)
    return {"weights": weights, "attention": b * int(cfg.n_heads) * T * T * 4,
            "logits": b * query_rows * int(cfg.d_vocab) * 4}


def _pass_bytes(model: Any, q: int, n: int, cache: int, rows_per_pass: int, n_cells: int) -> int:
    """One cell pass of the query-suffix engine: its rows' repeated cache and attention (keys ``[keys, d]`` and
    score tensors ``[H, keys]`` per row), capped by the engine's ``pass_bytes`` budget."""
    from phaselens.runtime.engines import PASS_BYTES

    cfg = model.cfg
    strides = [s.stride for s in model.phase_specs if s is not None]
    keys = int(cfg.local_window) + (q + 1) // min(strides, default=q + 1)
    item = torch.empty((), dtype=getattr(cfg, "dtype", torch.float32)).element_size()
    per_row = cache // max(n, 1) + keys * (int(cfg.d_head) + 4 * int(cfg.n_heads)) * item
    return min(PASS_BYTES, per_row * min(rows_per_pass, n * n_cells))
