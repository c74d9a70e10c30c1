"""The peak memory of a run: its largest step, from what the analysis declares and the model's sizes.

* a full pass: one forward of ``batch_size`` items (times the pass's ``copies``), as
  :func:`~phaselens.runtime.budget.forward_bytes` prices it (the model's ``estimate_memory`` capability where it
  has one: weights, cache, a call's attention probabilities times four, other transients, logits; else an upper
  bound from sizes: weights, one batch's ``[b, H, T, T]`` fp32 attention scores, its logits);
* the query-suffix engine (a model with ``estimate_memory``): the cached prefixes of every group alive at once
  (all of them over the items; one block's with ``engine_scope="block"``), a prefill call's attention, and one
  cell pass (its rows' repeated cache and attention, capped by the engine's ``pass_bytes``);
* calibration runs first, in forwards of ``calibration_batch`` items: the peak is the larger of the two;
* the weights count once per copy the run holds (``weight_copies``: a gate-cycled copy beside the model).
"""

from __future__ import annotations

from typing import Any

import torch

from phaselens.analyses.units import Units
from phaselens.contract.protocol import capability
from phaselens.planning.counting import Group
from phaselens.planning.planned_items import PlannedItems
from phaselens.runtime.budget import forward_bytes


def peak_memory(model: Any, units: Units, items: PlannedItems, scopes: list[tuple[list[Group], int]], *,
                batch_size: int) -> dict[str, int]:
    """Bytes of the run's largest step, by kind (see the module docstring)."""
    N, T = items.n, items.seq_len + units.extra_tokens
    first_slot = min(items.order)
    estimate = capability(model, "estimate_memory")
    if units.engine == "full" or estimate is None:
        memory = forward_bytes(model, T, min(batch_size, N) * units.copies, T - first_slot)
    else:
        memory = max((_engine_bytes(model, estimate, groups, units) for groups, _ in scopes),
                     key=lambda m: sum(m.values()))
    n_cal = units.calibration_items
    if n_cal:  # calibration runs first: the peak is the larger of the two
        cal = forward_bytes(model, items.seq_len, min(units.calibration_batch, n_cal), items.seq_len - first_slot)
        if sum(cal.values()) > sum(memory.values()):
            memory = {("calibration " + k if k != "weights" else k): v for k, v in cal.items()}
    if units.weight_copies > 1:
        memory = {**memory, "weights": memory["weights"] * units.weight_copies}
    return memory


def _engine_bytes(model: Any, estimate: Any, groups: list[Group], units: Units) -> dict[str, int]:
    """The cached prefixes of ``groups``, a prefill call and a cell pass of the query-suffix engine."""
    per_group = [estimate(q + 1, batch=n, query_len=1, logits="query") for q, n, _ in groups]
    return {"weights": per_group[0].weights,
            "cache": sum(e.cache * times for e, (_, _, times) in zip(per_group, groups)),  # every group's prefix
            "attention": max(4 * e.attention for e in per_group),
            "passes": max(_pass_bytes(model, q, n, e.cache, units.rows_per_pass, units.n_cells)
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


__all__ = ["peak_memory"]
