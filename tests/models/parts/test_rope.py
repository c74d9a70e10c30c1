"""RoPE / YaRN frequencies against transformers' ``_compute_yarn_parameters`` (which, like DeepSeek's reference
``precompute_freqs_cis``, widens a zero-width ramp by 0.001 and divides an inverted one as it is), and the
rotation's pairings."""

from __future__ import annotations

import math

import pytest
import torch

from phaselens.models.parts.rope import apply_rope, inverse_frequencies, yarn_ramp

# (dims, theta, factor, original): DeepSeek-V4's compressed RoPE, the tiny V4.1 of the tests, a zero-width ramp
# (low == high == 0), an inverted one (high = -1 < low = 0) and one inverted at the top (low = 14 > high = 7)
CASES = [(64, 160000.0, 16.0, 65536), (16, 160000.0, 16.0, 64), (16, 10000.0, 4.0, 6), (16, 10000.0, 4.0, 1),
         (8, 10.0, 4.0, 10**6)]


def transformers_yarn(dims: int, theta: float, factor: float, original: int) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=2 * dims, num_attention_heads=2, head_dim=dims,
                         max_position_embeddings=int(original * factor),
                         rope_parameters={"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                                          "original_max_position_embeddings": original, "beta_fast": 32.0,
                                          "beta_slow": 1.0})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")[0]


@pytest.mark.parametrize("case", CASES, ids=["v4", "tiny-v41", "zero-width", "inverted-low", "inverted-high"])
def test_yarn_frequencies_are_transformers(case):
    dims, theta, factor, original = case
    ours = inverse_frequencies(dims, theta, factor=factor, original=original)
    assert ours.dtype == torch.float32 and ours.shape == (dims // 2,)
    assert torch.equal(ours, transformers_yarn(dims, theta, factor, original))


def test_degenerate_ramps_follow_the_reference():
    assert yarn_ramp(16, 10000.0, 6, 32.0, 1.0).tolist() == [0.0] + [1.0] * 7  # low == high == 0: widened by 0.001
    assert yarn_ramp(16, 10000.0, 1, 32.0, 1.0).tolist() == [0.0] * 8  # high < low: (i - 0) / -1, clamped
    assert yarn_ramp(8, 10.0, 10**6, 32.0, 1.0).tolist() == [1.0] * 4  # low 14 > high 7: every pair interpolated
    plain = inverse_frequencies(16, 10000.0)
    assert torch.equal(inverse_frequencies(16, 10000.0, factor=4.0, original=1), plain)  # nothing interpolated


def test_plain_frequencies():
    inv = inverse_frequencies(8, 10000.0)
    assert torch.allclose(inv.double(), torch.tensor([10000.0 ** (-i / 8) for i in range(0, 8, 2)], dtype=torch.float64))
    assert torch.equal(inverse_frequencies(8, 10000.0, factor=16.0, original=0), inv)  # original 0: no YaRN


def test_rotation_pairings_and_inverse():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 12, generator=g)  # [batch, pos, head, d]: the trailing 8 channels rotate
    inv, pos = inverse_frequencies(8, 100.0), torch.arange(5)
    y = apply_rope(x, pos, inv)
    assert torch.equal(y[..., :4], x[..., :4])
    angle = pos[:, None, None] * inv  # [pos, 1, pairs]
    a, b = x[..., 4::2], x[..., 5::2]  # interleaved pairs (2i, 2i + 1)
    assert torch.allclose(y[..., 4::2], a * angle.cos() - b * angle.sin(), atol=1e-6)
    assert torch.allclose(y[..., 5::2], b * angle.cos() + a * angle.sin(), atol=1e-6)
    h = apply_rope(x, pos, inv, style="half")
    a, b = x[..., 4:8], x[..., 8:]  # half pairs (i, i + 4)
    assert torch.allclose(h[..., 4:8], a * angle.cos() - b * angle.sin(), atol=1e-6)
    assert torch.allclose(apply_rope(y, pos, inv, inverse=True), x, atol=1e-5)
    scaled = apply_rope(x, pos, inv, attention_scaling=2.0)
    assert torch.allclose(scaled[..., 4:], 2 * y[..., 4:], atol=1e-5)
    assert apply_rope(x.bfloat16(), pos, inv).dtype == torch.bfloat16
    assert apply_rope(x, pos, inv[:0]) is x
    assert math.isclose(float(inv[0]), 1.0)
