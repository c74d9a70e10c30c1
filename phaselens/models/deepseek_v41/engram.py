"""Engram: a gated n-gram table lookup added to every hyper-connection stream before a V4.1 layer.

Facts from DeepSeek's reference ``inference/model.py`` (``Engram``, ``ParallelEngramEmbedding``; revision
dba1be0a of DeepSeek-V4.1-Flash). Per token, with ``x`` ``[hc, D]`` the streams entering the layer and
``rows`` the ``C = (max_ngram - 1) * n_heads`` table rows its n-grams hash to (:mod:`.engram_hash`):

* **lookup**: the table is FP8 (E4M3) ``[num_embeddings, head_dim]`` with one power-of-two (UE8M0) scale per
  row and 32 values; each looked-up row is dequantized in fp32 and read as bf16 (exact: an E4M3 value times a
  power of two fits bf16);
* **projection**: ``wkv`` (an FP8 checkpoint weight ``[(hc + 1) D, C head_dim]``) maps the ``C`` rows,
  concatenated, to one key per stream ``k_c`` ``[hc, D]`` and one shared value ``v`` ``[D]``;
* **gate** (fp32, per stream ``c``): ``dot_c = sum_i x_ci q_ci k_ci k'_ci / (rms(x_c) rms(k_c) sqrt(D))`` with
  the learned ``q_weight`` and ``k_weight`` ``[hc, D]`` (used only as their product) and ``rms(y) =
  sqrt(mean(y^2) + eps)``, ``eps`` = ``rms_norm_eps``; ``g_c = sigmoid(sign(dot_c) sqrt(max(|dot_c|, 1e-6)))``;
* **output**: ``x_c + g_c v`` for every stream, computed in fp32 and cast back to the streams' dtype.

Hooks (``blocks.{l}.engram.*``): ``hook_rows`` ``[B, n, C]`` (int64 table rows; editable), ``hook_key``
``[B, n, hc, D]``, ``hook_value`` ``[B, n, D]``, ``hook_gate`` ``[B, n, hc]`` and ``hook_out`` ``[B, n, hc, D]``
(``g_c v``, what Engram adds; zero it to ablate one layer's Engram). Every one is editable.

Placement: a device map keeps each table (98 GB at the released size) in host memory and sends only the
looked-up rows to the layer's GPU (:class:`EngramTable`, :mod:`.device_maps`); :func:`engram_traffic` counts
the bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from phaselens.models.deepseek_v41.layers import Linear, Numerics
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.packed import FP8_ROWS, as_bytes, dequantize

SCALE_GROUP = 32  # one UE8M0 scale per 32 table values
GATE_FLOOR = 1e-6  # |dot| is clamped to this before the square root (the sign is kept)


class EngramTable(nn.Module):
    """The n-gram table kept as stored: ``weight`` FP8 ``[rows, head_dim]``, ``scale`` UE8M0 ``[rows, head_dim / 32]``.

    At the released size a table has 384 M rows (98 GB as FP8, 197 GB in bf16), so only looked-up rows are
    dequantized. Where the table lives (see :mod:`~phaselens.models.deepseek_v41.device_maps`):

    * **with its layer** (``device=``, or a device map that names the table): the rows are indexed in place;
    * **in host memory** (``host_resident``: what every device map does unless it names the table): the looked-up
      rows are gathered on the host into a pinned staging buffer and copied (asynchronously) to the device of
      ``rows``, where they are dequantized. Only ``rows_per_token x row_bytes`` move per token and Engram layer
      (:func:`engram_traffic`); ``moved_bytes`` counts what this table has sent.

    Both paths give bit-identical values: FP8 and UE8M0 bytes are copied as they are, and the dequantization
    (:func:`~phaselens.models.parts.packed.dequantize`, blocks of one row and 32 values) is exact on any device.
    """

    host_resident: ClassVar[bool] = True  # device maps keep this module's tensors in host memory

    def __init__(self, rows: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, head_dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(rows, head_dim // SCALE_GROUP, dtype=torch.float8_e8m0fnu),
                                  requires_grad=False)
        self.staged = False  # gather through the host path even when rows and table share a device (set by device_maps)
        self.moved_bytes = 0

    def forward(self, rows: Int[Tensor, "*shape"]) -> Float[Tensor, "*shape head_dim"]:
        """The rows' values as bf16 (the stored values times their scales: exact products in bf16), on
        ``rows``' device."""
        local = not self.staged and rows.device == self.weight.device
        values, scales = (self.weight[rows], self.scale[rows]) if local else self.gather(rows)
        return dequantize(as_bytes(values), scales, FP8_ROWS, torch.bfloat16)

    def gather(self, rows: Int[Tensor, "*shape"]) -> tuple[Tensor, Tensor]:
        """The stored values ``[*shape, head_dim]`` (FP8) and scales ``[*shape, head_dim / 32]`` (UE8M0) of
        ``rows``, gathered where the table lives and sent to ``rows``' device (through pinned memory when the
        table is on the CPU and ``rows`` on a GPU)."""
        home, dest = self.weight.device, rows.device
        flat = rows.reshape(-1).to(home)
        pin = home.type == "cpu" and dest.type == "cuda"
        out = []
        for t in (self.weight, self.scale):
            raw = t.view(torch.uint8)  # bytes as stored (index_select needs no FP8 kernels)
            buf = torch.empty(flat.numel(), raw.shape[1], dtype=torch.uint8, device=home, pin_memory=pin)
            torch.index_select(raw, 0, flat, out=buf)
            self.moved_bytes += buf.numel()
            out.append(buf.to(dest, non_blocking=pin).view(t.dtype).unflatten(0, rows.shape))
        return out[0], out[1]


@dataclass(frozen=True)
class EngramTraffic:
    """What Engram's lookups move from host-resident tables to the GPUs (:func:`engram_traffic`)."""

    layers: int  # Engram layers
    rows_per_token: int  # per layer: (max_ngram - 1) x heads
    row_bytes: int  # FP8 values plus one UE8M0 scale per 32
    index_bytes_per_token: int  # int64 row ids sent to the host, per token (all layers)

    @property
    def bytes_per_token(self) -> int:
        """Host -> GPU bytes per token, over every Engram layer."""
        return self.layers * self.rows_per_token * self.row_bytes

    def bytes_at(self, tokens: int) -> int:
        """Host -> GPU bytes of a pass over ``tokens`` tokens."""
        return tokens * self.bytes_per_token


def engram_traffic(cfg: Any) -> EngramTraffic:
    """Rows and bytes per token that Engram gathers, for a :class:`~phaselens.models.deepseek_v41.V41Config`:
    per Engram layer one row per n-gram size (``2 .. engram_max_ngram_size``) and head, each row ``head_dim``
    FP8 bytes plus ``head_dim / 32`` scale bytes. (V4.1-Flash: 2 layers x 24 rows x 264 B = 12,672 B per token.)"""
    layers = len(cfg.engram_layer_ids)
    rows = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads if layers else 0
    hd = cfg.engram_head_dim
    return EngramTraffic(layers, rows, hd + hd // SCALE_GROUP if layers else 0, layers * rows * 8)


def engram_gate(x: Tensor, key: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The gate ``[..., hc]`` of streams ``x`` and keys ``key`` ``[..., hc, D]`` (see the module docstring)."""
    D = x.shape[-1]
    rstd = torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (x * weight * key).sum(-1) * rstd * D**-0.5
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))


class Engram(nn.Module):
    """Engram of one layer; parameter names follow the checkpoint (``layers.{l}.engram.embed.weight``, ...)."""

    def __init__(self, cfg, index: int, numerics: Numerics, dtype: torch.dtype, n_cols: int) -> None:
        super().__init__()
        hc, D, hd = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
        self.index, self.hc, self.d_model, self.eps = index, hc, D, cfg.rms_norm_eps
        self.embed = EngramTable(cfg.engram_num_embeddings[index], hd)
        self.wkv = Linear(n_cols * hd, D * (hc + 1), numerics, quantized=True, dtype=dtype, stored="fp8")
        self.q_weight = nn.Parameter(torch.ones(hc, D, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(hc, D, dtype=dtype))
        self.hook_rows, self.hook_key, self.hook_value = HookPoint(), HookPoint(), HookPoint()
        self.hook_gate, self.hook_out = HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "batch pos hc d"], rows: Int[Tensor, "batch pos cols"]) -> Tensor:
        """The streams after Engram, ``[B, n, hc, D]`` in ``x``'s dtype."""
        rows = self.hook_rows(rows)
        ct = compute_dtype(x.dtype)
        looked = self.embed(rows).to(self.wkv.dtype)  # bf16 -> the model dtype: exact (wkv may hold packed bytes)
        kv = self.wkv(looked.flatten(-2))
        key = self.hook_key(kv[..., : self.hc * self.d_model].unflatten(-1, (self.hc, self.d_model))).to(ct)
        value = self.hook_value(kv[..., self.hc * self.d_model :]).to(ct)
        weight = self.q_weight.to(ct) * self.k_weight.to(ct)
        h = x.to(ct)
        gate = self.hook_gate(engram_gate(h, key, weight, self.eps))
        out = self.hook_out(gate.unsqueeze(-1) * value.unsqueeze(-2))
        return (h + out.to(ct)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"table={tuple(self.embed.weight.shape)}, streams={self.hc}, d_model={self.d_model}"
