"""DeepSeek-V4.1 number formats: the loader's dequantization and the forward's round trips, against formulas
written from the reference (``inference/model.py``, ``kernel.py``, ``convert.py``) element by element."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from phaselens.models.deepseek_v41 import load_v41
from phaselens.models.deepseek_v41.weights import shard_map
from phaselens.models.parts.formats import fp4_round_trip, fp8_round_trip, round_e2m1
from tests.support.deepseek_v41 import write_tiny_checkpoint

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41f") / "tiny", seed=1)


def raw(root, name):
    files = shard_map(root)
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def fp4_value(byte: int, high: bool) -> float:
    code = (byte >> 4) & 0xF if high else byte & 0xF
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def test_checkpoint_formats_are_the_references(ckpt):
    assert raw(ckpt, "layers.0.attn.wq_a.weight").dtype == torch.float8_e4m3fn
    assert raw(ckpt, "layers.0.attn.wq_a.scale").dtype == torch.float8_e8m0fnu
    assert raw(ckpt, "layers.0.attn.wq_a.scale").shape == (1, 2)  # [32, 64] in 32 x 32 blocks
    assert raw(ckpt, "layers.3.ffn.experts.1.w2.weight").dtype == torch.int8
    assert raw(ckpt, "layers.3.ffn.experts.1.w2.weight").shape == (64, 16)  # [64, 32] packed two per byte
    assert raw(ckpt, "layers.3.ffn.experts.1.w2.scale").shape == (64, 1)


@pytest.mark.parametrize("weights", ["packed", "dequantized"])
def test_fp8_block_dequantization(ckpt, weights):
    """w[i, j] = e4m3[i, j] * scale[i // 32, j // 32] (a power of two), exact in bf16 and fp32: dequantized at
    load, or kept packed and dequantized when the forward needs it."""
    for dtype in (torch.float32, torch.bfloat16):
        model = load_v41(ckpt, dtype=dtype, weights=weights)
        for name, param in (("layers.2.attn.wq_b", model.blocks[2].attn.wq_b.dense_weight()),
                            ("layers.5.attn.wo_a", model.blocks[5].attn.wo_a.dense_weight()),
                            ("layers.1.ffn.shared_experts.w2", model.blocks[1].ffn.shared_experts.w2.dense_weight())):
            assert param.dtype == dtype
            q, s = raw(ckpt, name + ".weight"), raw(ckpt, name + ".scale")
            g = torch.Generator().manual_seed(0)
            for _ in range(40):
                i = int(torch.randint(q.shape[0], (1,), generator=g))
                j = int(torch.randint(q.shape[1], (1,), generator=g))
                scale = float(s[i // 32, j // 32].float())
                assert math.log2(scale).is_integer()
                assert float(param.detach()[i, j]) == float(q[i, j].float()) * scale


@pytest.mark.parametrize("weights", ["packed", "dequantized"])
def test_fp4_expert_dequantization(ckpt, weights):
    """w[i, j] = E2M1[nibble] * scale[i, j // 32], the first of each pair in the low nibble."""
    model = load_v41(ckpt, dtype=torch.bfloat16, weights=weights)
    for layer, e, w in ((0, 0, "w1"), (3, 1, "w2"), (6, 3, "w3")):
        packed = raw(ckpt, f"layers.{layer}.ffn.experts.{e}.{w}.weight").view(torch.uint8)
        s = raw(ckpt, f"layers.{layer}.ffn.experts.{e}.{w}.scale")
        param = model.blocks[layer].ffn.experts.dense(w, torch.tensor([e]))[0]
        for i in range(0, packed.shape[0], 7):
            for j in range(0, 2 * packed.shape[1], 5):
                expect = fp4_value(int(packed[i, j // 2]), high=j % 2 == 1) * float(s[i, j // 32].float())
                assert float(param.detach()[i, j]) == expect
    assert model.blocks[0].ffn.experts.dense("w1", torch.arange(4)).abs().sum() > 0


def test_unquantized_tensors_keep_their_dtype_rules(ckpt):
    model = load_v41(ckpt, dtype=torch.bfloat16)
    a = model.blocks[2].attn
    assert a.compressor.wkv.weight.dtype == torch.float32  # ratio 2 pools in fp32: weights promoted
    assert model.blocks[4].attn.compressor.wkv.weight.dtype == torch.bfloat16  # ratio 1 stays bf16
    assert a.attn_sink.dtype == model.head.weight.dtype == model.blocks[2].hc_attn_fn.dtype == torch.float32
    ref = raw(ckpt, "layers.2.attn.compressor.wgate.weight")
    assert torch.equal(a.compressor.wgate.weight, ref.float())


def test_e2m1_rounds_half_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 0.26, 5.01, 0.0])
    assert round_e2m1(v).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, 0.5, 6.0, 0.0]


def test_fp4_round_trip_scales():
    # ue8m0 (indexer, groups of 32): amax 3 -> scale 2^ceil(log2(3/6)) = 0.5
    x = torch.zeros(32)
    x[:4] = torch.tensor([3.0, 0.3, -1.2, 0.8])
    y = fp4_round_trip(x, 32, "ue8m0")
    assert y[:4].tolist() == [3.0, 0.25, -1.0, 0.75]  # x/0.5: 0.6->0.5, 2.4->2, 1.6->1.5; times 0.5
    # e4m3 (compressed KV, groups of 16): amax 3 -> scale e4m3(0.5) = 0.5; amax 2.6 -> e4m3(0.4333) = 0.4375
    x = torch.zeros(16)
    x[:3] = torch.tensor([2.6, 1.0, -0.2])
    y = fp4_round_trip(x, 16, "e4m3")
    s = 0.4375
    assert float(torch.tensor(2.6 / 6).to(torch.float8_e4m3fn).float()) == s
    assert y[:3].tolist() == pytest.approx([6 * s, 2 * s, -0.5 * s])  # 5.94->6, 2.29->2, 0.457->0.5
    # an all-zero group keeps a nonzero scale and returns zeros
    assert fp4_round_trip(torch.zeros(16), 16, "e4m3").abs().max() == 0


def test_fp8_round_trip():
    x = torch.zeros(32)
    x[:3] = torch.tensor([448.0, 1.0625, 300.0])
    y = fp8_round_trip(x, 32)  # amax 448 -> scale 1; e4m3 has 3 mantissa bits, ties to even
    assert y[:3].tolist() == [448.0, 1.0, 288.0]
    x = torch.full((32,), 1e-6)  # amax floored at 1e-4 -> scale 2^ceil(log2(1e-4/448)) = 2^-22
    assert fp8_round_trip(x, 32)[0].item() == pytest.approx(1e-6, rel=0.07)
    b = torch.randn(4, 64, dtype=torch.bfloat16)
    assert fp8_round_trip(b, 32).dtype == torch.bfloat16
