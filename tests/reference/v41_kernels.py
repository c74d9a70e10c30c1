"""CPU emulation of the kernel API that DeepSeek-V4.1's reference ``inference/model.py`` imports from ``kernel``.

The official V4.1 ``kernel.py`` (TileLang, CUDA only) is not public. Its call signatures are those model.py
uses; its semantics are taken from the published V4 ``kernel.py`` (the same kernels: block FP8 quantization,
FP4 quantization with power-of-two or E4M3 scales, FP8 x FP8 and FP8 x FP4 GEMMs with fp32 accumulation, sparse
attention with a sink and an online softmax, the hyper-connection Sinkhorn split). Written for phaselens'
comparison script (``tests/reference/v41_parity.py``); it imports nothing from phaselens, so the comparison stays
independent of the code it checks.

Options (:func:`configure`), because the unpublished kernel leaves some choices open:

* ``round_trips``: ``"e4m3"`` (default) rounds the in-place FP8 round trip (``act_quant(..., inplace=True)``,
  the window KV) to E4M3 as an FP8 kernel does; ``"bf16"`` casts through the input dtype instead, as the
  published V4 kernel's simulation path does (so the FP8 round trip is a no-op there); ``"off"`` skips every
  in-place round trip (FP8 and FP4) to compare with ``quantize=None``.
* ``probs``: ``"bf16"`` (default, as the V4 kernel) rounds the attention probabilities to bf16 before P . V when
  the inputs are bf16; ``"fp32"`` keeps them in fp32 (a second legitimate emulation, for the bf16 floor).
* ``block``: key block of the online softmax (64 as the V4 kernel).
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
OPTIONS = {"round_trips": "e4m3", "probs": "bf16", "block": 64}


def configure(**options) -> None:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)}")
    OPTIONS.update(options)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 x) exactly, for positive fp32 x (as the kernel's exponent-bit arithmetic)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), e - (m == 0.5).to(e.dtype))


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (|v| <= 6), ties to the even code: steps 0.5 below 2, 1 below 4, 2 above."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)  # torch.round: half to even on the step grid


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    """FP8 (E4M3) per ``block_size`` along the last axis; amax floored at 1e-4; power-of-two scales when
    ``scale_fmt`` is set. ``inplace``: quantize-dequantize into ``x`` (see ``round_trips``)."""
    g = x.float().unflatten(-1, (-1, block_size))
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _pow2_ceil(amax * (1 / 448.0)) if scale_fmt is not None else amax * (1 / 448.0)
    q = (g / s).clamp(-448.0, 448.0)
    if inplace:
        mode = OPTIONS["round_trips"]
        if mode == "off":
            return x
        r = q.to(torch.float8_e4m3fn) if mode == "e4m3" else q.to(x.dtype)
        x.copy_((r.float() * s).flatten(-2).to(x.dtype))
        return x
    return q.to(torch.float8_e4m3fn).flatten(-2), s.squeeze(-1).to(scale_dtype)


def fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
    """FP4 (E2M1) per ``block_size``: power-of-two scales (amax floored at 6 * 2^-126) or E4M3 scales (amax
    floored at 6 * 2^-9). Only the in-place round trip is used by the V4.1 model."""
    assert inplace, "the V4.1 reference calls fp4_act_quant in place only"
    if OPTIONS["round_trips"] == "off":
        return x
    g = x.float().unflatten(-1, (-1, block_size))
    amax = g.abs().amax(-1, keepdim=True)
    if scale_dtype == torch.float8_e4m3fn:
        s = (amax.clamp_min(6 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn).float()
    else:
        s = _pow2_ceil(amax.clamp_min(6 * 2.0**-126) * (1 / 6.0))
    x.copy_((_round_e2m1((g / s).clamp(-6.0, 6.0)) * s).flatten(-2).to(x.dtype))
    return x


def _dequant_act(a, a_s, block):
    return (a.float().unflatten(-1, (-1, block)) * a_s.float().unsqueeze(-1)).flatten(-2)


def fp8_gemm(a, a_s, b, b_s, scale_dtype=torch.float32, block_size=128):
    """``a`` FP8 ``[..., K]`` (scales per ``block_size``) times ``b`` FP8 ``[N, K]`` (scales per block x block)^T,
    fp32 accumulation, output in torch's default dtype."""
    n, k = b.shape
    w = b.float() * b_s.float().repeat_interleave(block_size, 0)[:n].repeat_interleave(block_size, 1)[:, :k]
    return (_dequant_act(a, a_s, block_size) @ w.T).to(torch.get_default_dtype())


def _unpack_fp4(b):
    codes = b.view(torch.uint8)
    table = torch.tensor(E2M1, device=b.device)

    def dec(c):
        return torch.where((c & 8) != 0, -table[(c & 7).long()], table[(c & 7).long()])

    return torch.stack((dec(codes & 0x0F), dec(codes >> 4)), -1).flatten(-2)  # low nibble first


def fp4_gemm(a, a_s, b, b_s, scale_dtype=torch.float32, act_block_size=128):
    """``a`` FP8 times packed FP4 ``b`` ``[N, K / 2]`` (UE8M0 scales per row and 32 inputs)^T; fp32 accumulation."""
    w = (_unpack_fp4(b).unflatten(-1, (-1, 32)) * b_s.float().unsqueeze(-1)).flatten(-2)
    return (_dequant_act(a, a_s, act_block_size) @ w.T).to(torch.get_default_dtype())


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    """``o[b, m, h] = softmax over the picked keys and the sink`` of ``q . kv`` (K = V); ``-1`` picks nothing.

    As the V4 kernel: fp32 scores and running max over key blocks, probabilities rounded to ``q``'s dtype
    before P . V (``probs="bf16"``), fp32 sums, output in ``q``'s dtype.
    """
    B, M, H, D = q.shape
    idx = topk_idxs.long()
    valid = idx >= 0
    keys = torch.gather(kv.float().unsqueeze(1).expand(B, M, -1, D), 2,
                        idx.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, D))  # [B, M, k, D]
    keys = keys * valid.unsqueeze(-1)
    s = torch.einsum("bmhd,bmkd->bmhk", q.float(), keys) * softmax_scale
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    blk = OPTIONS["block"]
    low = OPTIONS["probs"] == "bf16" and q.dtype != torch.float32
    acc = torch.zeros(B, M, H, D)
    total = torch.zeros(B, M, H)
    run_max = torch.full((B, M, H), float("-inf"))
    for start in range(0, s.shape[-1], blk):  # the kernel's online softmax, block by block
        sb = s[..., start : start + blk]
        new_max = torch.maximum(run_max, sb.amax(-1))
        rescale = torch.exp(run_max - new_max).nan_to_num(0.0)
        p = torch.exp(sb - new_max.unsqueeze(-1)).nan_to_num(0.0)
        total = total * rescale + p.sum(-1)
        pv = p.to(q.dtype).float() if low else p
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", pv, keys[:, :, start : start + blk])
        run_max = new_max
    total = total + torch.exp(attn_sink.float() - run_max)
    return (acc / total.unsqueeze(-1)).to(q.dtype)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``, ``comb`` = row softmax + eps, then column and row
    normalisations (``sinkhorn_iters`` column steps in all), all in fp32."""
    hc = hc_mult
    m = mixes.float()
    pre = torch.sigmoid(m[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * hc_scale[2] + hc_base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.softmax(comb, -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb
