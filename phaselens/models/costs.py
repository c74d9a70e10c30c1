"""What DeepSeek-V4.1 forwards cost: FLOPs, GPU-memory bytes and time, per layer kind (``phaselens plan``).

Counted from phaselens's own code (``phaselens.models.deepseek_v41``), call by call as a chunked prefill runs
(:func:`~phaselens.models.parts.chunks.plan_chunks`), for ``B`` sequences whose call covers slots
``a .. s - 1`` (``n = s - a`` new tokens):

* **FLOPs** are the matmuls' (``2 x`` multiply-adds: what ``torch.utils.flop_counter.FlopCounterMode`` counts;
  element-wise work is left out), split by the precision they run in for a bf16 model:

  - model dtype: the attention projections (``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``), the ratio-1
    compressor, the indexer (``wq_b``, ``weights_proj``, keys ``wk``, scores ``n x E`` per head), the shared
    expert and the **activated** routed experts only (``num_experts_per_tok`` per token), Engram's ``wkv``;
  - fp32: the attention core, the hyper-connection mixes, the router, the pooling compressor (ratio >= 2) and
    the head.

  **Which keys a query attends.** A sliding layer: its window (``sliding_window`` keys). A compressed layer of
  ratio ``r``: the window plus **every** entry of its KV source so far (``s // r``): phaselens scores all
  entries and masks them to the indexer's picks (``attended="computed"``, what the plan prices). A sparse
  kernel attends the window plus ``min(s // r, index_topk)`` picks (``attended="sparse"``, reported beside).
* **Bytes** (GPU memory traffic, a lower-bound estimate): each call reads the weights it uses (routed experts:
  the expected number of distinct experts its tokens choose, under uniform routing), writes and reads the
  dequantized copy of every packed weight it uses (phaselens's ``kernels="torch"`` path), reads the cache
  (entries copied to fp32), and writes and reads about four fp32 score tensors ``[B, H, n, window + E + 1]``,
  the window's fp32 unfold, the indexer's scores and ~24 fp32 passes over the hyper-connection streams.
* **Host bytes**: Engram's looked-up rows, host -> GPU (:func:`~phaselens.models.deepseek_v41.engram.engram_traffic`).

Time (:func:`seconds`): eager PyTorch runs one kernel after another, so the parts add: model-dtype FLOPs at
``mfu x`` the GPU's bf16 dense peak, fp32 FLOPs at ``mfu x`` its fp32 peak (torch leaves TF32 off), bytes at
``mfu x`` its memory bandwidth, and Engram's rows at :data:`HOST_LINK_GBPS`. A device map runs the layers one
GPU after another, so a node's wall time is that sum and its GPU-hours are the wall time times its GPUs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

Attended = Literal["computed", "sparse"]


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
STREAM_PASSES = 24  # fp32 passes over the [B, n, hc, D] streams per layer (mixes, Sinkhorn inputs, pre, post)
SCORE_PASSES = 8  # four fp32 score tensors per attention call, each written and read


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


# ---- the model's sizes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockBytes:
    """Weight bytes of one layer as held on its GPU: ``held`` (packed or dense, routed experts excluded),
    ``dense`` (the dequantized size of its packed weights), and per routed expert ``expert_held`` /
    ``expert_dense`` (0 when the experts are held dense)."""

    held: int
    dense: int
    expert_held: int
    expert_dense: int


def block_bytes(block: Any) -> BlockBytes:
    """:class:`BlockBytes` of a V4.1 ``Block`` (a meta-device one will do), Engram left out (its table is host
    memory, its projection counted by Engram's cost)."""
    from phaselens.models.deepseek_v41.moe import RoutedExperts

    held = dense = ex_held = ex_dense = 0
    skip = {id(m) for m in block.engram.modules()} if hasattr(block, "engram") else set()
    for m in block.modules():
        if id(m) in skip:
            continue
        own = sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        if isinstance(m, RoutedExperts):
            n = m.shapes["w1"][0]
            ex_held += own // n
            if m.fmt is not None:
                ex_dense += sum(math.prod(s[1:]) for s in m.shapes.values()) * _item(m.dtype)
            continue
        held += own
        if getattr(m, "fmt", None) is not None:
            dense += math.prod(m.shape) * _item(m.dtype)
    return BlockBytes(held, dense, ex_held, ex_dense)


def _item(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def distinct_experts(tokens: np.ndarray, n_experts: int, k: int) -> np.ndarray:
    """Expected distinct experts ``tokens`` tokens choose (``k`` each, uniform routing)."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** np.asarray(tokens, dtype=np.float64))


# ---- one pass ----------------------------------------------------------------------------------------------
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


def kind_of(ratio: int) -> str:
    return "sliding" if ratio == 0 else f"ratio {ratio}"


def pass_cost(model: Any, calls: Any, *, batch: int = 1, head_rows: int = 0, first_layer: int = 0,
              attended: Attended = "computed") -> PassCost:
    """The cost of running ``calls`` (``[(start, stop), ...]`` slot ranges, in order, through one cache) for
    ``batch`` sequences through the layers from ``first_layer`` up, the last call computing ``head_rows``
    rows of logits. ``model``: a :class:`~phaselens.models.deepseek_v41.DeepSeekV41` (the meta-device one
    ``phaselens plan`` builds will do); its ``index_topk`` (``None``: ``"all"``) decides whether indexers score.
    """
    c = model.config
    topk = model._index_topk
    arr = np.asarray(calls, dtype=np.int64).reshape(-1, 2)
    a, s = arr[:, 0], arr[:, 1]
    n = (s - a).astype(np.float64)
    B = float(batch)
    D, H, d, L = c.hidden_size, c.num_attention_heads, c.head_dim, c.sliding_window
    hc, qr, R, G = c.hc_mult, c.q_lora_rank, c.o_lora_rank, c.o_groups
    Hi, di, F, Er, k = c.index_n_heads, c.index_head_dim, c.moe_intermediate_size, c.n_routed_experts, \
        c.num_experts_per_tok
    item = _item(model.embed.weight.dtype)
    mix = (2 + hc) * hc
    N = float(n.sum())
    used = distinct_experts(B * n, Er, k)
    layers, engram, kinds = [], {}, []
    for role, block in zip(model.roles[first_layer:], model.blocks[first_layer:]):
        kinds.append(kind_of(role.ratio))
        wb = block_bytes(block)
        # hyper-connections (fp32): per sublayer the mixes, the pre collapse and the post expansion
        fp32 = 2 * (2 * N * hc * D * mix + 2 * N * hc * D + 2 * N * hc * hc * D)
        low = 2 * N * (D * qr + qr * H * d + D * d + H * d * R + G * R * D)  # attention projections
        low += 2 * N * 3 * D * F * (k + 1)  # activated routed experts and the shared one
        fp32 += 2 * N * D * Er + 4 * N * H * d * L  # router; window scores and P.V
        act = B * (SCORE_PASSES * H * n * (L + 1) * 4 + 2 * n * d * L * 4 + STREAM_PASSES * n * hc * D * 4)
        if role.ratio:
            r = model.roles[role.kv_source].ratio
            E = (s // r).astype(np.float64)
            seen = np.minimum(E, topk) if attended == "sparse" and topk is not None else E
            fp32 += 4 * H * d * float((n * seen).sum())
            act = act + B * (SCORE_PASSES * H * n * seen * 4 + E * d * (item + 12))
            if role.is_kv_source:
                new = float((s // r - a // r).sum())
                if r == 1:
                    low += 2 * N * D * d
                else:
                    fp32 += 4 * N * D * d
                low += 2 * new * d * di  # index keys of the new entries
            if role.is_index_source and topk is not None:
                low += 2 * N * (qr * Hi * di + D * Hi) + 2 * Hi * di * float((n * E).sum())
                act = act + B * (4 * n * Hi * E * item + E * di * item)
        weights = wb.held + used * wb.expert_held + 2 * (wb.dense + used * wb.expert_dense)
        layers.append(Cost(B * low, B * fp32, float((weights + act).sum())))
        if hasattr(block, "engram"):
            engram[role.layer] = _engram_cost(model, block.engram, N, B, len(n), item)
    head = Cost()
    if head_rows:
        q = B * head_rows
        head = Cost(0.0, 2 * q * hc * D + 2 * q * D * c.vocab_size,
                    float(c.vocab_size * D * 4 + q * c.vocab_size * 4))
    return PassCost(tuple(layers), engram, head, tuple(kinds))


def _engram_cost(model: Any, module: Any, N: float, B: float, calls: int, item: int) -> Cost:
    """Engram of one layer: ``wkv`` over the looked-up rows (model dtype) and the rows sent from the host."""
    from phaselens.models.deepseek_v41.engram import engram_traffic

    c = model.config
    t = engram_traffic(c)
    cols, out = module.wkv.shape[1], module.wkv.shape[0]
    w = sum(p.numel() * p.element_size() for p in module.wkv.parameters())
    dense = 2 * out * cols * item if module.wkv.fmt is not None else 0
    rows = B * N * t.rows_per_token
    return Cost(2 * B * N * cols * out, 0.0, calls * (w + dense) + rows * c.engram_head_dim * (11 + item),
                rows * t.row_bytes)


# ---- time --------------------------------------------------------------------------------------------------
def seconds(cost: Cost, gpu: GPUSpec, mfu: float = MFU, host_gbps: float = HOST_LINK_GBPS) -> float:
    """Wall seconds of ``cost`` on one GPU at a time (see the module docstring)."""
    return (cost.flops / (gpu.bf16_tflops * 1e12 * mfu) + cost.flops_fp32 / (gpu.fp32_tflops * 1e12 * mfu)
            + cost.bytes / (gpu.hbm_tbps * 1e12 * mfu) + cost.host_bytes / (host_gbps * 1e9))


def prefill_calls(tokens: int, chunk: int | None) -> np.ndarray:
    """``[(start, stop)]`` of a prefill of ``tokens`` tokens in pieces of ``chunk`` (``None``: one call)."""
    step = tokens if chunk is None else int(chunk)
    starts = np.arange(0, tokens, step, dtype=np.int64)
    return np.stack([starts, np.minimum(starts + step, tokens)], axis=1)


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


def map_cost(model: Any, context: int, *, items: int, item_batch: int = 1, chunk: int | None = None,
             attended: Attended = "computed") -> MapCost:
    """The :class:`MapCost` of a head map (``layers x heads`` cells) at ``context`` tokens, query at the last slot."""
    c = model.config
    L, H, q = c.num_hidden_layers, c.num_attention_heads, context - 1
    # batches of item_batch items and one of the rest: counted, never listed (a count of 10^15 is priced in O(1))
    batches = {b: n for b, n in ((item_batch, items // item_batch), (items % item_batch, 1)) if b and n}
    one = pass_cost(model, prefill_calls(q, chunk), batch=1, attended=attended)
    step = [(q, q + 1)]
    kinds: dict[str, Cost] = {}
    acc = Cost()
    for b, times in sorted(batches.items()):
        parts = [pass_cost(model, prefill_calls(q, chunk), batch=b, attended=attended),
                 pass_cost(model, step, batch=b, head_rows=1, attended=attended)]
        parts += [pass_cost(model, step, batch=b, head_rows=1, first_layer=layer, attended=attended) * H
                  for layer in range(L)]
        for p in parts:
            for kind, cost in p.by_kind().items():
                kinds[kind] = kinds.get(kind, Cost()) + cost * times
            acc = acc + p.total * times
    forward = one.total + pass_cost(model, step, batch=1, head_rows=1, attended=attended).total
    n_batches = sum(batches.values())
    return MapCost(items, item_batch, L * H, n_batches, n_batches * (1 + L * H), forward, acc, kinds)


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


def plan_time(model: Any, *, gpu: GPUSpec, mfu: float, context: int, chunk: int | None, batch: int,
              head_rows: int, gpus: int | None, map_context: int, map_chunk: int | None, map_gpus: int | None,
              items: int, item_batch: int) -> dict[str, Any]:
    """What ``phaselens plan`` reports as ``time``: a forward at ``context`` (``batch`` sequences in pieces of
    ``chunk``, ``head_rows`` rows of logits) on ``gpus`` GPUs, and a per-head map at ``map_context`` on
    ``map_gpus`` (see :func:`map_cost`), each with FLOPs, bytes, seconds and GPU-hours (``None`` without GPUs)."""
    from phaselens.models.parts.chunks import plan_chunks

    calls = plan_chunks(context, chunk, None).calls
    fwd = pass_cost(model, calls, batch=batch, head_rows=head_rows)
    fwd_sparse = pass_cost(model, calls, batch=batch, head_rows=head_rows, attended="sparse")
    mc = map_cost(model, map_context, items=items, item_batch=item_batch, chunk=map_chunk)
    ms = map_cost(model, map_context, items=items, item_batch=item_batch, chunk=map_chunk, attended="sparse")
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
