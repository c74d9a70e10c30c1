"""The quantization formulas against value tables and scales written from DeepSeek's reference description.

A block-scaled round trip takes each block of channels to ``q(clamp(x / s)) * s`` with one power-of-two scale
``s = 2**ceil(log2(amax / qmax))`` per block (the ``ue8m0`` scale format), ``amax`` floored at 1e-4 (FP8) or
6 * 2**-126 (FP4), ``q`` round-to-nearest-even on the format's grid: what ``inference/kernel.py``'s
``fp4_act_quant(inplace=True)`` does for FP4 (e2m1), and what an FP8 KV cache does for e4m3. (The published
``act_quant(inplace=True)`` casts through bf16 instead and changes nothing: see
``tests/models/deepseek_v4/test_reference_numerics.py``.) The grids here are decoded from the formats' bit layouts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from phaselens.errors import InputError
from phaselens.models.deepseek_v4.quantization import FP4_BLOCK, fp8_simulate, hadamard, indexer_simulate
from phaselens.models.parts.formats import fp4_round_trip, pow2_scale, round_e2m1
from tests.support.deepseek_reference import (
    E2M1,
    E2M1_EVEN,
    E4M3,
    E4M3_EVEN,
    nearest_even,
    reference_block_quant,
)


def test_the_decoded_grids_are_the_formats():
    assert E4M3.max() == 448.0 and E4M3[E4M3 > 0].min() == 2.0**-9 and len(E4M3) == 127
    assert sorted(E2M1) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_torch_float8_cast_rounds_to_nearest_even_on_the_e4m3_grid():
    g = torch.Generator().manual_seed(0)
    v = torch.cat([
        torch.randn(20000, generator=g) * 50,
        torch.rand(5000, generator=g) * 2.0**-6,  # subnormals
        torch.tensor((E4M3[1:] + E4M3[:-1]) / 2, dtype=torch.float32),  # every tie
    ]).clamp(-448, 448)
    ours = v.to(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(ours, nearest_even(v.double().numpy(), E4M3, E4M3_EVEN))


def test_e2m1_rounding_ties_go_to_the_even_mantissa():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0])
    assert round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -2.0, -4.0]
    v = torch.linspace(-6, 6, 24001, dtype=torch.float32)
    assert np.array_equal(round_e2m1(v).double().numpy(), nearest_even(v.double().numpy(), E2M1, E2M1_EVEN))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_simulation_matches_the_reference_formula(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 448, generator=g) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    out = fp8_simulate(x)
    assert out.dtype == dtype and out.shape == x.shape
    expected = reference_block_quant(x, 64, 448.0, 1e-4, E4M3, E4M3_EVEN)
    assert np.array_equal(out.double().numpy(), expected)
    assert not torch.equal(out, x)  # it really rounds (3 mantissa bits)
    rel = ((out.float() - x.float()).norm() / x.float().norm()).item()
    assert 0.005 < rel < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_simulation_matches_the_reference_formula(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 4, 128, generator=g) * 3).to(dtype)
    out = fp4_round_trip(x, FP4_BLOCK)
    assert out.dtype == dtype
    expected = reference_block_quant(x, 32, 6.0, 6 * 2.0**-126, E2M1, E2M1_EVEN)
    assert np.array_equal(out.double().numpy(), expected)


def test_scales_are_per_block_powers_of_two_and_edges_are_exact():
    x = torch.zeros(2, 128)
    x[0, :64] = torch.linspace(-1, 1, 64) * 448 * 2.0**-3  # amax exactly 448 * 2**-3: scale 2**-3, no clamping
    x[0, 64:] = 1e-7  # amax under the 1e-4 floor: the scale is 2**-22 (2**-32 without the floor)
    x[1, :64] = 3.0
    out = fp8_simulate(x)
    assert out[0, 0] == -56.0 and out[0, 63] == 56.0
    floored = nearest_even(np.array([float(x[0, 64]) * 2**22]), E4M3, E4M3_EVEN)[0] * 2.0**-22
    assert floored != float(x[0, 64]) and torch.equal(out[0, 64:], torch.full((64,), floored))
    assert torch.equal(out[1, :64], torch.full((64,), 3.0)) and torch.equal(out[1, 64:], torch.zeros(64))
    changed = x.clone()
    changed[1, :64] *= 1000  # one block's values never touch another block's scale
    assert torch.equal(fp8_simulate(changed)[1, 64:], out[1, 64:])
    amax = torch.tensor([448.0, 448.0 * 1.0000001, 1.0, 2.0**-20])
    s = pow2_scale(amax, 448.0)
    assert s.tolist() == [1.0, 2.0, 2.0**-8, 2.0**-28]
    assert all(math.log2(v).is_integer() for v in s.tolist())


def test_hadamard_is_sylvester_over_sqrt_n_and_orthogonal():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 128, generator=g, dtype=torch.float64).float()
    h = torch.tensor(scipy.linalg.hadamard(128), dtype=torch.float64) / math.sqrt(128)
    assert torch.allclose(hadamard(x).double(), x.double() @ h, atol=1e-5)
    y = torch.randn(3, 7, 128, generator=g)
    assert torch.allclose((hadamard(x) * hadamard(y)).sum(-1), (x * y).sum(-1), atol=1e-3)
    assert hadamard(x.bfloat16()).dtype == torch.bfloat16


def test_indexer_simulation_is_rotation_then_fp4():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 128, generator=g).bfloat16()
    rotated = hadamard(x)
    assert torch.equal(indexer_simulate(x), fp4_round_trip(rotated, FP4_BLOCK))
    expected = reference_block_quant(rotated, 32, 6.0, 6 * 2.0**-126, E2M1, E2M1_EVEN)
    assert np.array_equal(indexer_simulate(x).double().numpy(), expected)


def test_bad_sizes_are_refused():
    with pytest.raises(InputError, match="multiple of 64"):
        fp8_simulate(torch.ones(2, 48))
    with pytest.raises(InputError, match="multiple of 32"):
        fp4_round_trip(torch.ones(2, 16), FP4_BLOCK)
    with pytest.raises(InputError, match="power-of-two"):
        hadamard(torch.ones(2, 96))
