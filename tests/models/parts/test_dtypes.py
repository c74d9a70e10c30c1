"""The compute dtype and RMSNorm in it."""

from __future__ import annotations

import torch

from phaselens.models.parts.dtypes import compute_dtype
from phaselens.models.parts.norms import rms_norm


def test_compute_dtype_is_at_least_fp32():
    assert [compute_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)] == [
        torch.float32, torch.float32, torch.float32, torch.float64]


def test_rms_norm_runs_in_fp32_and_casts_back():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, 16, generator=g).bfloat16(), torch.randn(16, generator=g).bfloat16()
    out = rms_norm(x, w, 1e-6)
    xf = x.double()
    want = (w.double() * xf / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and (out.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    assert rms_norm(x.double(), w, 1e-6).dtype == torch.float64
