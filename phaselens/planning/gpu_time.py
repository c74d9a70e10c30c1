"""What DeepSeek-V4.1 forwards take, in time on GPUs: ``phaselens plan``'s ``time`` (a forward, a head map).

Time (:func:`seconds`): eager PyTorch runs one kernel after another, so the parts add: model-dtype FLOPs at
``mfu x`` the GPU's bf16 dense peak, fp32 FLOPs at ``mfu x`` its fp32 peak (torch leaves TF32 off), bytes at
``mfu x`` its memory bandwidth, and Engram's rows at :data:`HOST_LINK_GBPS`. A device map runs the layers one
GPU after another, so a node's wall time is that sum and its GPU-hours are the wall time times its GPUs.

The costs (FLOPs and bytes per layer kind): :mod:`phaselens.planning.flops`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phaselens.contract.layer_table import LayerTable
from phaselens.planning.counting import groups_of
from phaselens.planning.flops import Attended, Cost, pass_cost, prefill_calls


@dataclass(frozen=True)
class GPUSpec:
    """Peaks of one GPU (dense, per datasheet): bf16 TFLOPS, fp32 TFLOPS (no tensor cores) and HBM TB/s."""

    name: str
    bf16_tflops: float
    fp32_tflops: float
    hbm_tbps: float


GPU_SPECS = {"H100": GPUSpec("H100", 989.0, 67.0, 3.35), "H200": GPUSpec("H200", 989.0, 67.0, 4.8),
             "B200": GPUSpec("B200", 2250.0, 80.0, 8.0)}  # SXM parts
MFU = 0.4  # the fraction of each peak reached (the default of --mfu)
HOST_LINK_GBPS = 25.0  # Engram's rows: a host gather into pinned memory plus the PCIe copy (conservative)

# ---- time --------------------------------------------------------------------------------------------------
def seconds(cost: Cost, gpu: GPUSpec, mfu: float = MFU, host_gbps: float = HOST_LINK_GBPS) -> float:
    """Wall seconds of ``cost`` on one GPU at a time (see the module docstring)."""
    return (cost.flops / (gpu.bf16_tflops * 1e12 * mfu) + cost.flops_fp32 / (gpu.fp32_tflops * 1e12 * mfu)
            + cost.bytes / (gpu.hbm_tbps * 1e12 * mfu) + cost.host_bytes / (host_gbps * 1e9))


@dataclass(frozen=True)
class MapCost:
    """A per-head map with the query-suffix engine: per batch of items one prefix prefill (``prefix``, one item's),
    one clean query step, and per cell one pass of the batch's query rows from the cell's layer up."""

    items: int
    item_batch: int
    cells: int
    prefix_passes: int
    query_passes: int
    forward: Cost  # one item's forward over the whole context (the unit of forward-equivalents)
    cost: Cost  # the whole map
    by_kind: dict[str, Cost]

    @property
    def forward_equivalents(self) -> float:
        return self.cost.total_flops / max(self.forward.total_flops, 1.0)


def map_cost(table: LayerTable, context: int, cell_layers: Sequence[int], *, items: int, item_batch: int = 1,
             chunk: int | None = None, attended: Attended = "computed") -> MapCost:
    """The :class:`MapCost` of a map at ``context`` tokens, query at the last slot, whose cells intervene at
    ``cell_layers`` (the map's declared cells, :meth:`~phaselens.analyses.maps.Map.units`: a head map's
    ``layers x heads``), its items in the engine's groups of ``item_batch``
    (:func:`~phaselens.planning.counting.groups_of`)."""
    q = context - 1
    # pieces of item_batch items and one of the rest: counted, never listed (a count of 10^15 is priced in O(1))
    groups = sorted(groups_of([(q, items)], item_batch), key=lambda g: g[1])
    per_layer = sorted(Counter(int(x) for x in cell_layers).items())
    one = pass_cost(table, prefill_calls(q, chunk), batch=1, attended=attended)
    step = [(q, q + 1)]
    kinds: dict[str, Cost] = {}
    acc = Cost()
    for _, b, times in groups:
        parts = [pass_cost(table, prefill_calls(q, chunk), batch=b, attended=attended),
                 pass_cost(table, step, batch=b, head_rows=1, attended=attended)]
        parts += [pass_cost(table, step, batch=b, head_rows=1, first_layer=layer, attended=attended) * n
                  for layer, n in per_layer]
        for p in parts:
            for kind, cost in p.by_kind().items():
                kinds[kind] = kinds.get(kind, Cost()) + cost * times
            acc = acc + p.total * times
    forward = one.total + pass_cost(table, step, batch=1, head_rows=1, attended=attended).total
    n_batches, n_cells = sum(g[2] for g in groups), len(cell_layers)
    return MapCost(items, item_batch, n_cells, n_batches, n_batches * (1 + n_cells), forward, acc, kinds)


# ---- the plan's time ---------------------------------------------------------------------------------------
def gpu_spec(name: str | None, *, bf16_tflops: float | None = None, fp32_tflops: float | None = None,
             hbm_tbps: float | None = None) -> GPUSpec:
    """The peaks of GPU type ``name`` (an H100's when unknown), each overridable."""
    base = GPU_SPECS.get(name or "H100", GPU_SPECS["H100"])
    return GPUSpec(base.name if name in GPU_SPECS else f"{name or 'GPU'} (H100 peaks)",
                   bf16_tflops or base.bf16_tflops, fp32_tflops or base.fp32_tflops, hbm_tbps or base.hbm_tbps)


def _priced(cost: Cost, sparse: Cost, by_kind: dict[str, Cost], gpu: GPUSpec, mfu: float,
            gpus: int | None) -> dict[str, Any]:
    s = seconds(cost, gpu, mfu)
    return {**cost.to_dict(), "sparse_attention_flops": sparse.total_flops, "seconds": s, "gpus": gpus,
            "gpu_hours": None if gpus is None else s * gpus / 3600,
            "by_kind": {k: v.to_dict() for k, v in by_kind.items()}}


def plan_time(table: LayerTable, *, gpu: GPUSpec, mfu: float, context: int, chunk: int | None, batch: int,
              head_rows: int, gpus: int | None, map_context: int, map_chunk: int | None, map_gpus: int | None,
              map_layers: Sequence[int], items: int, item_batch: int) -> dict[str, Any]:
    """What ``phaselens plan`` reports as ``time`` for the model of ``table``: a forward at ``context`` (``batch`` sequences in pieces of
    ``chunk``, ``head_rows`` rows of logits) on ``gpus`` GPUs, and a map at ``map_context`` on ``map_gpus`` whose
    cells intervene at ``map_layers`` (see :func:`map_cost`), each with FLOPs, bytes, seconds and GPU-hours
    (``None`` without GPUs)."""
    from phaselens.models.parts.chunks import plan_chunks

    calls = plan_chunks(context, chunk, None).calls
    fwd = pass_cost(table, calls, batch=batch, head_rows=head_rows)
    fwd_sparse = pass_cost(table, calls, batch=batch, head_rows=head_rows, attended="sparse")
    mc = map_cost(table, map_context, map_layers, items=items, item_batch=item_batch, chunk=map_chunk)
    ms = map_cost(table, map_context, map_layers, items=items, item_batch=item_batch, chunk=map_chunk,
                  attended="sparse")
    return {
        "gpu": gpu.name, "bf16_tflops": gpu.bf16_tflops, "fp32_tflops": gpu.fp32_tflops, "hbm_tbps": gpu.hbm_tbps,
        "mfu": mfu, "host_link_gbps": HOST_LINK_GBPS,
        "forward": {"context": context, "chunk": chunk, "batch": batch,
                    **_priced(fwd.total, fwd_sparse.total, fwd.by_kind(), gpu, mfu, gpus)},
        "map": {"context": map_context, "chunk": map_chunk, "items": items, "item_batch": item_batch,
                "cells": mc.cells, "prefix_passes": mc.prefix_passes, "query_passes": mc.query_passes,
                "forward_equivalents": mc.forward_equivalents,
                **_priced(mc.cost, ms.cost, mc.by_kind, gpu, mfu, map_gpus)},
    }
