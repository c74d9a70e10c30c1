"""What a forward costs: FLOPs and GPU-memory bytes per layer kind, from the model's per-layer table.

A pass runs ``calls`` (``[(a, s), ...]`` slot ranges through one cache, ``n = s - a`` new tokens each) for ``B``
sequences through the layers of a :class:`~phaselens.contract.layer_table.LayerTable` whose rows describe
their work (:class:`~phaselens.contract.layer_table.Work`; DeepSeek-V4.1's: what each counts and why,
:mod:`phaselens.models.deepseek_v41.layer_table`). Per layer and call:

* **FLOPs** are the matmuls' (``2 x`` multiply-adds: what ``torch.utils.flop_counter.FlopCounterMode`` counts;
  element-wise work is left out), in the model's dtype and in fp32: per token, per entry the call finishes,
  per (query, entry) pair the indexer scores, per (query, entry scored) pair the attention computes.

  **Which keys a query attends.** A sliding layer: its window. A compressed layer of ratio ``r``: the window
  plus **every** entry of its KV source so far (``s // r``): phaselens scores all entries and masks them to the
  indexer's picks (``attended="computed"``, what the plan prices). A sparse kernel attends the window plus
  ``min(s // r, index_topk)`` picks (``attended="sparse"``, reported beside).
* **Bytes** (GPU memory traffic, a lower-bound estimate): the weights each call reads (routed experts: the
  expected number of distinct experts its tokens choose, under uniform routing; packed weights' dequantized
  copies written and read), and the traffic per token, per entry and per pair.
* **Host bytes**: Engram's looked-up rows, host -> GPU.

Time from these costs: :mod:`phaselens.planning.gpu_time`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from phaselens.contract.layer_table import LayerTable
from phaselens.errors import NotApplicableError

Attended = Literal["computed", "sparse"]


@dataclass(frozen=True)
class Cost:
    """FLOPs (model dtype and fp32), GPU-memory bytes and host -> GPU bytes of some work."""

    flops: float = 0.0
    flops_fp32: float = 0.0
    bytes: float = 0.0
    host_bytes: float = 0.0

    @property
    def total_flops(self) -> float:
        return self.flops + self.flops_fp32

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.flops_fp32 + other.flops_fp32, self.bytes + other.bytes,
                    self.host_bytes + other.host_bytes)

    def __mul__(self, k: float) -> Cost:
        return Cost(self.flops * k, self.flops_fp32 * k, self.bytes * k, self.host_bytes * k)

    __rmul__ = __mul__

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_flops": self.total_flops}


def total(costs: Any) -> Cost:
    return sum(costs, Cost())


# ---- one pass ----------------------------------------------------------------------------------------------
def distinct_experts(tokens: np.ndarray, n_experts: int, k: int) -> np.ndarray:
    """Expected distinct experts ``tokens`` tokens choose (``k`` each, uniform routing)."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** np.asarray(tokens, dtype=np.float64))


@dataclass(frozen=True)
class PassCost:
    """A pass's cost per backbone layer (``layers``, Engram excluded), per Engram layer (``engram``) and of the
    final norm and head (``head``)."""

    layers: tuple[Cost, ...]
    engram: dict[int, Cost]
    head: Cost
    kinds: tuple[str, ...]  # each layer's kind: "sliding", "ratio 2", ...

    @property
    def total(self) -> Cost:
        return total(self.layers) + total(self.engram.values()) + self.head

    def __mul__(self, k: float) -> PassCost:
        return PassCost(tuple(c * k for c in self.layers), {i: c * k for i, c in self.engram.items()},
                        self.head * k, self.kinds)

    def by_kind(self) -> dict[str, Cost]:
        """Costs summed per layer kind, plus ``"engram"`` and ``"head"``."""
        out: dict[str, Cost] = {}
        for kind, c in zip(self.kinds, self.layers):
            out[kind] = out.get(kind, Cost()) + c
        if self.engram:
            out["engram"] = total(self.engram.values())
        out["head"] = self.head
        return out


def pass_cost(table: LayerTable, calls: Any, *, batch: int = 1, head_rows: int = 0, first_layer: int = 0,
              attended: Attended = "computed") -> PassCost:
    """The cost of running ``calls`` (``[(start, stop), ...]`` slot ranges, in order, through one cache) for
    ``batch`` sequences through the layers of ``table`` from ``first_layer`` up, the last call computing
    ``head_rows`` rows of logits."""
    missing = [r.layer for r in table.rows if r.work is None]
    if missing:
        raise NotApplicableError(f"this model's layer table describes no work for layers {missing[:4]}: its time is "
                                 "not priced (phaselens prices DeepSeek-V4.1's).")
    topk = table.index_topk
    arr = np.asarray(calls, dtype=np.int64).reshape(-1, 2)
    a, s = arr[:, 0], arr[:, 1]
    n = (s - a).astype(np.float64)
    B = float(batch)
    N = float(n.sum())
    layers, engram, kinds = [], {}, []
    for row in table.rows[first_layer:]:
        w = row.work
        assert w is not None
        kinds.append(row.kind)
        low, fp32 = 2 * N * w.macs, 2 * N * w.macs_fp32
        act = B * (w.bytes_per_token * n)
        if row.ratio:
            r = row.entry_ratio
            E = (s // r).astype(np.float64)
            seen = np.minimum(E, topk) if attended == "sparse" and topk is not None else E
            fp32 += 2 * w.macs_fp32_per_score * float((n * seen).sum())
            act = act + B * (w.bytes_per_score * n * seen + E * w.bytes_per_entry)
            if row.makes_entries:
                low += 2 * float((s // r - a // r).sum()) * w.macs_per_new_entry
            if w.macs_per_pair:
                low += 2 * w.macs_per_pair * float((n * E).sum())
                act = act + B * (w.bytes_per_pair * n * E)
        used = distinct_experts(B * n, w.n_experts, w.experts_per_token) if w.n_experts else 0.0
        weights = w.weight_held + used * w.expert_held + 2 * (w.weight_dense + used * w.expert_dense)
        layers.append(Cost(B * low, B * fp32, float((weights + act).sum())))
        if w.engram_macs:
            rows = B * N * w.engram_rows
            engram[row.layer] = Cost(2 * B * N * w.engram_macs, 0.0,
                                     len(n) * w.engram_weight_bytes + rows * w.engram_row_bytes,
                                     rows * w.engram_host_row_bytes)
    head = Cost()
    if head_rows:
        q = B * head_rows
        head = Cost(0.0, 2 * q * table.head_macs_fp32, float(table.head_weight_bytes + q * table.head_bytes_per_row))
    return PassCost(tuple(layers), engram, head, tuple(kinds))


def prefill_calls(tokens: int, chunk: int | None) -> np.ndarray:
    """``[(start, stop)]`` of a prefill of ``tokens`` tokens in pieces of ``chunk`` (``None``: one call)."""
    step = tokens if chunk is None else int(chunk)
    starts = np.arange(0, tokens, step, dtype=np.int64)
    return np.stack([starts, np.minimum(starts + step, tokens)], axis=1)
