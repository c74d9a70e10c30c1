"""DeepSeek's reference V4 compressor, written from the description of its ``inference/model.py`` (no cache).

For a compressor of stride S on hidden states ``h`` ``[B, T, D]``: projections ``kv = h Wkv^T``,
``score = h Wgate^T + ape`` (``C = 2d`` channels with overlap (CSA), ``d`` without (HCA)); entry ``j`` pools the
slots of its window with a per-channel softmax over the slots, where with overlap slots ``0..S-1`` are the
previous block's first ``d`` channels (none for ``j = 0``) and slots ``S..2S-1`` the block's own last ``d``;
then an RMSNorm and RoPE at position ``j S`` on the trailing rope dims: YaRN frequencies (θ 160000, factor 16
from 65,536 tokens, β 32 / 1), interleaved pairs, no magnitude scaling. Every step's dtype is a parameter, so
the same formula gives the float64 truth, the reference's bf16 pipeline (fp32 projections and pooling, the
pooled rows cast to bf16 before the norm, fp32 RoPE tables) and transformers' (everything in bf16).

The quantization steps: each block of channels becomes ``q(clamp(x / s)) * s`` with one power-of-two scale
``s = 2**ceil(log2(amax / qmax))`` (the ``ue8m0`` scale format), ``amax`` floored at 1e-4 (FP8) or 6 * 2**-126
(FP4), ``q`` rounding to nearest, ties to even, on the format's grid (decoded here from the formats' bit
layouts). That is what ``inference/kernel.py``'s ``fp4_act_quant(inplace=True)`` computes for FP4, and what an
FP8 KV cache does for e4m3; the published ``act_quant(inplace=True)`` instead casts ``x / s`` through its
input's own dtype (bf16), which changes nothing (:func:`act_quant_emulated`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def yarn_inv_freq(
    dim: int, base: float = 160000.0, factor: float = 16.0, original: int = 65536,
    beta_fast: float = 32.0, beta_slow: float = 1.0,
) -> Tensor:
    """YaRN frequencies of ``dim`` rotated channels (float64): full frequency below the correction range,
    ``1/factor`` of it above, a linear ramp between."""
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def rope_rows(x: Tensor, positions: Tensor, inv_freq: Tensor, table_dtype: torch.dtype) -> Tensor:
    """Rotate the trailing ``2 len(inv_freq)`` channels of ``x`` ``[..., E, d]`` by ``positions`` ``[E]``,
    pairs ``(2i, 2i+1)``; the angles' cos/sin in ``table_dtype``, the product in float64 at least fp32."""
    r = 2 * inv_freq.shape[0]
    angle = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = angle.cos().to(table_dtype), angle.sin().to(table_dtype)
    ct = torch.promote_types(torch.float32, x.dtype)
    a, b = x[..., -r::2].to(ct), x[..., -r + 1 :: 2].to(ct)
    ra, rb = a * cos.to(ct) - b * sin.to(ct), a * sin.to(ct) + b * cos.to(ct)
    rotated = torch.stack([ra, rb], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], rotated], dim=-1)


@torch.no_grad()
def reference_rows(
    comp, hidden: Tensor, *, proj: torch.dtype, out: torch.dtype, table: torch.dtype, rope_dims: int,
    inv_freq: Tensor | None = None,
) -> Tensor:
    """The rows ``[B, T // S, d]`` a reference compressor emits for ``hidden`` (module weights of ``comp``,
    a transformers CSA / HCA compressor or indexer)."""
    S, d = int(comp.compress_rate), int(comp.head_dim)
    overlap = comp.kv_proj.weight.shape[0] == 2 * d
    x = hidden.to(proj)
    kv = x @ comp.kv_proj.weight.to(proj).T
    score = (x @ comp.gate_proj.weight.to(proj).T).to(torch.promote_types(proj, torch.float32))
    B, T = hidden.shape[:2]
    E = T // S
    kv = kv[:, : E * S].reshape(B, E, S, -1)
    score = score[:, : E * S].reshape(B, E, S, -1) + comp.position_bias.to(score.dtype)
    if overlap:
        lay_kv = kv.new_zeros(B, E, 2 * S, d)
        lay_score = score.new_full((B, E, 2 * S, d), float("-inf"))
        lay_kv[:, :, S:], lay_score[:, :, S:] = kv[..., d:], score[..., d:]
        lay_kv[:, 1:, :S], lay_score[:, 1:, :S] = kv[:, :-1, :, :d], score[:, :-1, :, :d]
        kv, score = lay_kv, lay_score
    weights = score.softmax(dim=2)
    pooled = (kv * weights.to(kv.dtype)).sum(dim=2).to(out)
    p = pooled.to(torch.promote_types(out, torch.float32))
    normed = (p * torch.rsqrt(p.square().mean(-1, keepdim=True) + 1e-6)) * comp.kv_norm.weight.to(p.dtype)
    normed = normed.to(out)
    freqs = yarn_inv_freq(rope_dims) if inv_freq is None else inv_freq
    return rope_rows(normed, torch.arange(E) * S, freqs, table)


def _grid(exp_bits: int, man_bits: int, bias: int, nan_codes: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative value of a small float format, and whether its mantissa is even."""
    values, even = [], []
    for code in range(2 ** (exp_bits + man_bits)):
        if code in nan_codes:
            continue
        e, m = code >> man_bits, code & (2**man_bits - 1)
        frac = m / 2**man_bits
        values.append(frac * 2.0 ** (1 - bias) if e == 0 else (1 + frac) * 2.0 ** (e - bias))
        even.append(m % 2 == 0)
    return np.array(values), np.array(even)


E4M3, E4M3_EVEN = _grid(4, 3, 7, {0x7F})  # float8_e4m3fn: no infinities, S.1111.111 is NaN
E2M1, E2M1_EVEN = _grid(2, 1, 1, set())


def nearest_even(v: np.ndarray, grid: np.ndarray, even: np.ndarray) -> np.ndarray:
    """Round |v| to the nearest grid value, ties to the even mantissa; keep the sign."""
    a = np.abs(v)[..., None]
    dist = np.abs(a - grid)
    best = dist.min(axis=-1, keepdims=True)
    tied = dist == best
    pick = np.where(tied.sum(-1) > 1, np.argmax(tied & even, axis=-1), np.argmin(dist, axis=-1))
    return np.sign(v) * grid[pick]


def reference_block_quant(x: torch.Tensor, block: int, qmax: float, floor: float, grid, even) -> np.ndarray:
    """The reference's fused quant-dequant, in float64 numpy."""
    b = x.double().numpy().reshape(-1, block)
    amax = np.maximum(np.abs(b).max(axis=1, keepdims=True), floor)
    s = 2.0 ** np.ceil(np.log2(amax / qmax))
    return (nearest_even(np.clip(b / s, -qmax, qmax), grid, even) * s).reshape(x.shape)


# ---- DeepSeek's kernels (``inference/kernel.py``), emulated on the CPU from their description ---------------
# The reference imports ``act_quant``, ``fp4_act_quant``, ``sparse_attn`` and ``hc_split_sinkhorn`` from its
# TileLang ``kernel.py`` (CUDA only). These functions compute what those kernels are written to compute, so
# that the reference ``model.py`` runs on a CPU (``tests/reference/v4_parity.py``) and so that tests can
# hold the adapter against them. Where a kernel leaves a choice open (the block size of the online softmax,
# whether its bf16 rounding of the probabilities is kept), the parameter names it: two settings are two
# legitimate emulations, and their difference is the floor any implementation is measured against.


def kernel_pow2_scale(amax: Tensor, qmax: float) -> Tensor:
    """``2**ceil(log2(amax * fp32(1/qmax)))`` from the fp32 bit pattern (exponent, plus one unless the mantissa
    is zero), as ``fast_round_scale`` reads it."""
    v = amax.float() * torch.tensor(1.0 / qmax, dtype=torch.float32)
    bits = v.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(v), exponent)


def act_quant_emulated(x: Tensor, block: int, *, through: torch.dtype | None) -> Tensor:
    """``act_quant(x, block, "ue8m0", fp32, inplace=True)``: per block ``cast(clamp(x / s)) * s`` back in
    ``x``'s dtype, where ``cast`` is to ``through``. As written the kernel casts to its output dtype, which for
    ``inplace=True`` is the input's (bf16): pass ``through=None`` for that. ``torch.float8_e4m3fn`` rounds as an
    FP8 kernel (or an FP8 KV cache) does."""
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = kernel_pow2_scale(b.abs().amax(-1, keepdim=True).clamp_min(1e-4), 448.0)
    q = (b / s).clamp(-448.0, 448.0).to(through or x.dtype).float()
    return (q * s).reshape(x.shape).to(x.dtype)


def fp4_quant_emulated(x: Tensor, block: int = 32) -> Tensor:
    """``fp4_act_quant(x, block, inplace=True)``: per block FP4 (e2m1) round trip with a power-of-two scale."""
    b = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = kernel_pow2_scale(b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126), 6.0)
    v = (b / s).clamp(-6.0, 6.0)
    q = torch.as_tensor(nearest_even(v.double().numpy(), E2M1, E2M1_EVEN), dtype=torch.float32)
    return (q * s).reshape(x.shape).to(x.dtype)


def hadamard_emulated(x: Tensor, scale: float) -> Tensor:
    """``fast_hadamard_transform.hadamard_transform(x, scale)``: Sylvester-ordered Walsh-Hadamard in fp32."""
    import scipy.linalg

    h = torch.tensor(scipy.linalg.hadamard(x.shape[-1]), dtype=torch.float32)
    return ((x.float() @ h) * scale).to(x.dtype)


def sparse_attn_emulated(
    q: Tensor, kv: Tensor, sink: Tensor, idx: Tensor, scale: float, *, block: int = 64, round_probs: bool = True
) -> Tensor:
    """``sparse_attn(q [b, m, h, d], kv [b, n, d], sink [h], idx [b, m, k], scale)`` -> ``[b, m, h, d]``.

    The kernel walks the ``k`` picked keys (``-1`` = none) in blocks of ``block`` with an online softmax: fp32
    scores ``q . kv * scale``, a running max ``m_t`` (over keys only; the sink joins the denominator at the
    end as ``exp(sink - m)``), probabilities ``exp(s - m_t)`` rounded to bf16 before they multiply the values
    (``round_probs``), fp32 accumulators rescaled by ``exp(m_t - m_{t+1})``, one division at the end. The
    blocks are done here at once: block ``t``'s terms carry ``exp(m_t - m_final)``.
    """
    b, m, h, d = q.shape
    k = idx.shape[-1]
    nb = -(-k // block)
    idx = torch.nn.functional.pad(idx.long(), (0, nb * block - k), value=-1)
    valid = idx >= 0
    keys = torch.gather(kv.float(), 1, idx.clamp_min(0).reshape(b, -1, 1).expand(-1, -1, d)).reshape(b, m, -1, d)
    keys = keys * valid.unsqueeze(-1)
    s = torch.einsum("bmhd,bmkd->bmhk", q.float(), keys) * scale
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf")).reshape(b, m, h, nb, block)
    run = s.amax(-1).cummax(-1).values  # [b, m, h, nb]: the running max after each block
    live = torch.isfinite(run)
    p = torch.where(live.unsqueeze(-1), torch.exp(s - run.unsqueeze(-1)), 0.0)
    total = p.sum(-1)
    if round_probs:
        p = p.to(torch.bfloat16).float()
    pv = torch.einsum("bmhnk,bmnkd->bmhnd", p, keys.reshape(b, m, nb, block, d))
    final = run[..., -1:]
    r = torch.where(live, torch.exp(run - final), 0.0)
    num = (pv * r.unsqueeze(-1)).sum(-2)
    den = (total * r).sum(-1) + torch.exp(sink.float().view(1, 1, h) - final[..., 0])
    return (num / den.unsqueeze(-1)).to(q.dtype)


def hc_split_sinkhorn_emulated(
    mixes: Tensor, hc_scale: Tensor, hc_base: Tensor, hc_mult: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6
) -> tuple[Tensor, Tensor, Tensor]:
    """``hc_split_sinkhorn``: ``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``, ``comb`` = row softmax + eps,
    then a column normalisation and ``iters - 1`` (row, column) normalisations (each dividing by sum + eps)."""
    hc = hc_mult
    pre = torch.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc])
    comb = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * hc_scale[2] + hc_base[2 * hc :].view(hc, hc)
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):  # iterations of one algorithm, not a loop over data
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb
