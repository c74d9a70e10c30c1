"""The V4.1 feed-forward: a mixture of routed SwiGLU experts plus one shared expert.

Routing (reference ``Gate``): fp32 scores ``act(x W^T / gate_temp)`` (``sqrtsoftplus`` in V4.1); the
correction ``bias`` only chooses the top-k experts; their weights are the unbiased scores, normalised to sum
to one (``norm_topk_prob``, +1e-20) and multiplied by ``routed_scaling_factor``. Every expert (the shared one
too, unlike V4) clamps its up branch to ``+-swiglu_limit`` and its gate branch from above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from phaselens.core import margins
from phaselens.models.deepseek_v41.config import V41Config
from phaselens.models.deepseek_v41.kernels import CALLS, kernel_linear, wants_kernel
from phaselens.models.deepseek_v41.layers import Linear, Numerics, packed_parameters
from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.formats import fp8_round_trip
from phaselens.models.parts.numerics_deepseek import swiglu
from phaselens.models.parts.packed import PackedFormat, dequantize


class SharedExpert(nn.Module):
    def __init__(self, d_model: int, d_ff: int, numerics: Numerics, dtype: torch.dtype, limit: float) -> None:
        super().__init__()
        fp8 = {"quantized": True, "dtype": dtype, "stored": "fp8"}
        self.w1 = Linear(d_model, d_ff, numerics, **fp8)
        self.w2 = Linear(d_ff, d_model, numerics, **fp8)
        self.w3 = Linear(d_model, d_ff, numerics, **fp8)
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        ct = compute_dtype(x.dtype)
        h = swiglu(self.w1(x).to(ct), self.w3(x).to(ct), self.limit)
        return self.w2(h.to(x.dtype))


class RoutedExperts(nn.Module):
    """The routed experts' weights stacked per layer: ``w1``, ``w3`` ``[E, d_ff, D]`` and ``w2`` ``[E, D, d_ff]``
    (checkpoint ``ffn.experts.{e}.w{1,2,3}.weight``, FP4 in the release).

    Packed (:meth:`set_packed`), ``w{1,2,3}`` hold the stored bytes (FP4: ``[E, d_ff, D/2]`` ...) and
    ``w{1,2,3}_scale`` the scales; each forward dequantizes only the experts its tokens selected, in groups of
    at most ``chunk_bytes`` of dequantized weights, each group in one vectorised call.
    """

    chunk_bytes = 1 << 30  # dequantized expert weights alive at once (1 GiB: ~23 experts of the released Flash)
    stored = "fp4"  # the release's format (plans made without a checkpoint)

    def __init__(self, n: int, d_model: int, d_ff: int, numerics: Numerics, dtype: torch.dtype, limit: float) -> None:
        super().__init__()
        self.shapes = {"w1": (n, d_ff, d_model), "w2": (n, d_model, d_ff), "w3": (n, d_ff, d_model)}
        for name, shape in self.shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(*shape, dtype=dtype)))
            self.register_parameter(f"{name}_scale", None)
        self.numerics, self.limit, self.dtype = numerics, limit, dtype
        self.fmt: PackedFormat | None = None

    def set_packed(self, fmt: PackedFormat, scale_dtype: torch.dtype = torch.uint8) -> None:
        """Hold the experts packed in ``fmt`` (empty tensors on the weights' device, to be filled)."""
        for name, (n, rows, cols) in self.shapes.items():
            values, scales = packed_parameters(fmt, (n,), rows, cols, scale_dtype, getattr(self, name).device)
            setattr(self, name, values)
            setattr(self, f"{name}_scale", scales)
        self.fmt = fmt

    def dense(self, name: str, experts: Tensor) -> Tensor:
        """Weights ``name`` of ``experts`` ``[k]`` as ``[k, rows, cols]`` in the model dtype (dequantized in one
        call when packed)."""
        w = getattr(self, name)
        if self.fmt is None:
            return w[experts]
        return dequantize(w[experts], getattr(self, f"{name}_scale")[experts], self.fmt, self.dtype)

    def _in(self, x: Tensor) -> Tensor:
        return fp8_round_trip(x, 32) if self.numerics.activations else x

    def _groups(self, experts: list[int]) -> list[list[int]]:
        """``experts`` cut into runs whose dequantized weights fit ``chunk_bytes``."""
        _, rows, cols = self.shapes["w1"]
        per = 3 * rows * cols * self.dtype.itemsize
        size = max(1, self.chunk_bytes // per)
        return [experts[i : i + size] for i in range(0, len(experts), size)]

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``x`` ``[N, D]``, ``indices`` / ``weights`` ``[N, k]`` -> fp32 ``[N, D]``.

        One loop over the experts that received tokens (each step one batched GEMM over its tokens), as the
        reference does: a dense gather of ``[N, k, d_ff, D]`` expert weights would not fit at real scale.
        """
        ct = compute_dtype(x.dtype)
        y = torch.zeros(x.shape[0], x.shape[1], dtype=ct, device=x.device)
        chosen = torch.unique(indices).tolist()
        if self.fmt is None:
            for e in chosen:
                self._expert(x, y, indices, weights, e, self.w1[e], self.w2[e], self.w3[e])
            return y
        for group in self._groups(chosen):
            ids = torch.tensor(group, device=self.w1.device)
            if self._kernel_group(x, y, indices, weights, group):
                continue
            CALLS["dequantize"] += 1
            w1, w2, w3 = (self.dense(name, ids) for name in ("w1", "w2", "w3"))
            for j, e in enumerate(group):
                self._expert(x, y, indices, weights, e, w1[j], w2[j], w3[j])
        return y

    def _expert(self, x: Tensor, y: Tensor, indices: Tensor, weights: Tensor, e: int,
                w1: Tensor, w2: Tensor, w3: Tensor) -> None:
        """Add expert ``e``'s weighted output to ``y`` for the tokens that chose it."""
        ct = y.dtype
        rows, slot = torch.where(indices == e)
        with margins.gathered(rows, x.shape[0]):  # the expert's tokens, for the FP8 roundings' margins
            xe = self._in(x[rows])
            h = swiglu(F.linear(xe, w1).to(ct), F.linear(xe, w3).to(ct), self.limit)
            h = (weights[rows, slot, None] * h).to(x.dtype)
            y.index_add_(0, rows, F.linear(self._in(h), w2).to(ct))

    def _kernel_group(self, x: Tensor, y: Tensor, indices: Tensor, weights: Tensor, group: list[int]) -> bool:
        """transformers' kernel on each expert of ``group`` (CUDA, ``quantize="fp8"``), added to ``y`` only if
        every GEMM ran; ``False``: not used (the caller dequantizes)."""
        if not wants_kernel(self.numerics.kernels, x, self.w1, self.numerics.activations):
            return False
        part = torch.zeros_like(y)
        for e in group:
            rows, slot = torch.where(indices == e)
            gate, up = (kernel_linear(x[rows], getattr(self, n)[e], getattr(self, f"{n}_scale")[e], self.fmt)
                        for n in ("w1", "w3"))
            if gate is None or up is None:
                return False
            h = (weights[rows, slot, None] * swiglu(gate.to(y.dtype), up.to(y.dtype), self.limit)).to(x.dtype)
            out = kernel_linear(h, self.w2[e], self.w2_scale[e], self.fmt)
            if out is None:
                return False
            part.index_add_(0, rows, out.to(y.dtype))
        y += part
        return True


# the gate's score function per ``scoring_func`` (the config admits only these)
SCORES = {"softmax": lambda s: s.softmax(-1), "sigmoid": torch.sigmoid, "sqrtsoftplus": lambda s: F.softplus(s).sqrt()}


class Gate(nn.Module):
    def __init__(self, cfg: V41Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=compute_dtype(dtype)))
        self.topk, self.func, self.temp = cfg.num_experts_per_tok, cfg.scoring_func, cfg.gate_temp
        self.norm, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``[N, D]`` -> ``(weights [N, k] fp32, indices [N, k])``."""
        ct = compute_dtype(x.dtype)
        s = SCORES[self.func](F.linear(x.to(ct), self.weight.to(ct)) / self.temp)
        biased = s + self.bias.to(ct)
        indices = biased.topk(self.topk, dim=-1).indices
        if margins.active() is not None:
            margins.note_topk(biased, self.topk, dtype=x.dtype)
        w = s.gather(1, indices)
        if self.norm and self.topk > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, indices


class MoE(nn.Module):
    """``ffn``: ``gate``, ``experts`` (stacked) and ``shared_experts`` (checkpoint names)."""

    def __init__(self, cfg: V41Config, numerics: Numerics, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.n_shared_experts != 1:
            from phaselens.errors import UnsupportedModelError

            raise UnsupportedModelError(f"n_shared_experts={cfg.n_shared_experts}; the V4.1 reference has exactly 1.")
        D, F_ = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg, dtype)
        self.experts = RoutedExperts(cfg.n_routed_experts, D, F_, numerics, dtype, cfg.swiglu_limit)
        self.shared_experts = SharedExpert(D, F_, numerics, dtype, cfg.swiglu_limit)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat)
        y = self.experts(flat, indices, weights)
        y = y + self.shared_experts(flat).to(y.dtype)
        return y.to(x.dtype).view(shape)
