"""The phaselens compressor against transformers' DeepSeek-V4 CSA / HCA compressors."""

from __future__ import annotations

import pytest
import torch

from phaselens.models import Compressor
from tests.support.deepseek import tiny_v4_model


@pytest.fixture(scope="module")
def v4():
    return tiny_v4_model()


@pytest.mark.parametrize("layer, kind, overlap", [(1, "CSA", True), (2, "HCA", False), (3, "CSA", True)])
@pytest.mark.parametrize("T", [37, 64])
def test_from_hf_matches_transformers_rows_after_norm_and_rope(v4, layer, kind, overlap, T):
    hf = v4.model.layers[layer].self_attn.compressor
    assert type(hf).__name__ == f"DeepseekV4{kind}Compressor"
    hidden = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(layer + T))
    pos = torch.arange(T)[None].expand(2, -1)
    q_res = torch.randn(2, T, 32)  # only the CSA indexer reads it; pooled rows do not depend on it
    ref = hf(hidden, q_res, pos, None, layer)[0][:, 0]  # [B, E, d]
    ours = Compressor.from_hf(hf)
    assert ours.spec.overlap_split is overlap and ours.spec.window == (8 if overlap else 16)
    out = ours.compress_sequence(hidden)["kv"][:, :, 0]
    assert out.shape == ref.shape and ref.shape[1] == T // hf.compress_rate
    assert (out - ref).abs().max() <= 1e-5


def test_from_hf_streaming_matches_transformers_cached_compressor(v4):
    """Chunked through our PoolerState and through transformers' DynamicCache: same rows."""
    from transformers import DynamicCache

    from phaselens.models.compressed.compressor import Pooler

    layer = 1
    hf = v4.model.layers[layer].self_attn.compressor
    ours = Compressor.from_hf(hf)
    hidden = torch.randn(1, 30, 64, generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=v4.config)
    rows_hf, rows_ours, state, start = None, [], None, 0
    for n in (3, 6, 1, 12, 8):
        chunk = hidden[:, start : start + n]
        pos = torch.arange(start, start + n)[None]
        rows_hf = hf(chunk, torch.randn(1, n, 32), pos, cache, layer)[0][:, 0]
        pooler = ours.poolers["kv"]
        alpha, windows, state, first = pooler.gates(chunk, start, state)
        rows_ours.append(ours.finish("kv", Pooler.pool(alpha, windows), first))
        start += n
    assert (torch.cat(rows_ours, 1)[:, :, 0] - rows_hf).abs().max() <= 1e-5


def test_from_hf_copies_frequencies_and_our_yarn_agrees(v4):
    hf = v4.model.layers[1].self_attn.compressor
    ours = Compressor.from_hf(hf)
    theirs = hf.rotary_emb.compress_inv_freq
    assert torch.equal(ours.inv_freq, theirs)  # copied, not recomputed
    assert ours.spec.rope.yarn is not None and ours.spec.rope.yarn.factor == 16.0
    recomputed = ours.spec.rope.inv_freq(16)  # our own YaRN from the spec
    assert torch.allclose(recomputed, theirs, rtol=1e-6)
    plain = ours.spec.rope.__class__(dims=16, theta=160000.0).inv_freq(16)
    assert not torch.allclose(plain, theirs)  # YaRN really changes the frequencies


def test_position_bias_and_gates_matter(v4):
    """Guard against a vacuous parity: zeroing the bias changes the rows."""
    hf = v4.model.layers[1].self_attn.compressor
    ours = Compressor.from_hf(hf)
    hidden = torch.randn(1, 16, 64)
    a = ours.compress_sequence(hidden)["kv"]
    with torch.no_grad():
        ours.poolers["kv"].position_bias.zero_()
    assert (ours.compress_sequence(hidden)["kv"] - a).abs().max() > 1e-3
