"""The shared FP8 / FP4 round trips against the formats themselves: torch's ``float8_e4m3fn`` cast for E4M3, and
the published E2M1 value table {0, 0.5, 1, 1.5, 2, 3, 4, 6} with round-half-to-even for FP4.

The table rounding here is written independently of :func:`round_e2m1` (nearest table value, ties to the even
code, in float64 numpy), so the two agreeing is evidence, not a restatement. Before the shared core, DeepSeek-V4
(a step rounding) and V4.1 (a midpoint table) each had their own E2M1 rounding; they agreed bit for bit on every
fp32 value in [-6, 6] (2,172,649,474 values), so unifying them moved no output; only NaN differed (V4.1's gave
+-6, the shared one keeps NaN, as a cast does).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from phaselens.errors import InputError
from phaselens.models.parts.formats import (
    E2M1_VALUES,
    FP8_MAX,
    fp4_round_trip,
    fp8_round_trip,
    pow2_scale,
    round_e2m1,
)

TABLE = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the published E2M1 magnitudes, codes 0..7


def table_round_half_even(v: np.ndarray) -> np.ndarray:
    """Nearest E2M1 magnitude (ties to the even code), sign kept; float64."""
    a = np.abs(v)[..., None]
    dist = np.abs(a - TABLE)
    best = dist.min(-1, keepdims=True)
    tied = (dist == best).sum(-1) > 1
    codes = np.where(tied, np.argmax((dist == best) & (np.arange(8) % 2 == 0), -1), np.argmin(dist, -1))
    return np.copysign(TABLE[codes], v)


def critical_values() -> torch.Tensor:
    """Every tie and its fp32 neighbours, the grid and its neighbours, a dense sweep and random values in [-6, 6]."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, mids])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(-1.0)), torch.nextafter(points, torch.tensor(7.0))])
    sweep = torch.linspace(0, 6, 600_001, dtype=torch.float32)
    rand = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 6
    v = torch.cat([near, sweep, rand]).clamp(0, 6)
    return torch.cat([v, -v])


def test_the_table_is_the_formats_value_set():
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    # decoded from the bit layout (1 sign, 2 exponent bits of bias 1, 1 mantissa bit; exponent 0 is subnormal)
    decoded = [(m / 2) * 2.0**0 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1) for e in range(4) for m in range(2)]
    assert decoded == list(E2M1_VALUES)


def test_e2m1_rounding_is_the_table_with_round_half_to_even():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # each to its even code
    assert round_e2m1(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    v = critical_values()
    ours = round_e2m1(v).double().numpy()
    assert np.array_equal(ours, table_round_half_even(v.double().numpy()))
    assert np.array_equal(np.signbit(ours), np.signbit(v.numpy()))  # -0.0 stays signed, as in the format
    assert round_e2m1(torch.tensor([float("nan")])).isnan().all()
    assert round_e2m1(v.double()).dtype == torch.float64 and torch.equal(round_e2m1(v.double()).float(), round_e2m1(v))


def test_pow2_scale_is_exact_at_and_around_powers_of_two():
    amax = torch.tensor([448.0, 448.0 * 1.0000001, 1.0, 2.0**-20, 6.0, 3.0])
    s = pow2_scale(amax, FP8_MAX)
    assert s[:4].tolist() == [1.0, 2.0, 2.0**-8, 2.0**-28]
    assert pow2_scale(torch.tensor([6.0, 3.0, 3.1]), 6.0).tolist() == [1.0, 0.5, 1.0]
    g = torch.Generator().manual_seed(1)
    a = torch.rand(10_000, generator=g) * 1e3 + 1e-3
    got = pow2_scale(a, FP8_MAX).double().numpy()
    ratio = (a * torch.tensor(1 / FP8_MAX, dtype=torch.float32)).double().numpy()  # the fp32 product, exactly
    want = 2.0 ** np.ceil(np.log2(ratio))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fp8_round_trip_is_the_e4m3_cast_under_power_of_two_block_scales(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 128, generator=g) * torch.logspace(-6, 4, 5)[:, None]).to(dtype)
    out = fp8_round_trip(x, 32)
    assert out.dtype == dtype and out.shape == x.shape
    b = x.double().reshape(3, 5, 4, 32)
    amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = torch.exp2(torch.ceil(torch.log2((amax.float() * torch.tensor(1 / 448.0)).double())))
    cast = (b / s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * s  # torch's own cast: RNE
    assert torch.equal(out.double(), cast.reshape(x.shape).to(dtype).double())
    one = torch.linspace(-448, 448, 64)  # amax 448: scale 1, the round trip is the plain cast
    assert torch.equal(fp8_round_trip(one, 64), one.to(torch.float8_e4m3fn).float())


def test_fp8_blocks_do_not_share_scales():
    x = torch.ones(2, 64)
    x[0, :32] *= 1000
    out = fp8_round_trip(x, 32)
    assert torch.equal(out[0, 32:], torch.ones(32)) and torch.equal(out[1], torch.ones(64))
    assert fp8_round_trip(torch.full((32,), 1e-6), 32)[0].item() == pytest.approx(1e-6, rel=0.07)  # floor 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_round_trip_with_ue8m0_scales_is_the_table(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 96, generator=g) * 3).to(dtype)
    out = fp4_round_trip(x, 32)
    assert out.dtype == dtype and torch.equal(out, fp4_round_trip(x, 32, "ue8m0"))
    b = x.double().numpy().reshape(4, 3, 32)
    s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0**-126) / 6))
    want = (table_round_half_even(np.clip(b / s, -6, 6)) * s).reshape(4, 96)
    assert np.array_equal(out.double().numpy(), torch.tensor(want).to(dtype).double().numpy())


def test_fp4_round_trip_with_e4m3_scales():
    x = torch.zeros(2, 16)
    x[0, :3] = torch.tensor([2.6, 1.0, -0.2])  # amax 2.6: scale e4m3(2.6 / 6) = 0.4375 (not a power of two)
    out = fp4_round_trip(x, 16, "e4m3")
    s = float(torch.tensor(2.6 / 6).to(torch.float8_e4m3fn).float())
    assert s == 0.4375
    assert out[0, :3].tolist() == pytest.approx([6 * s, 2 * s, -0.5 * s])  # 5.94 -> 6, 2.29 -> 2, 0.457 -> 0.5
    assert out[1].abs().max() == 0  # an all-zero block: floored scale, zeros back


def test_bad_blocks_and_scales_are_refused():
    with pytest.raises(InputError, match="multiple of 64"):
        fp8_round_trip(torch.ones(2, 48), 64)
    with pytest.raises(InputError, match="multiple of 32"):
        fp4_round_trip(torch.ones(2, 16), 32)
    with pytest.raises(InputError, match="'ue8m0' or 'e4m3'"):
        fp4_round_trip(torch.ones(2, 16), 16, "e5m2")  # type: ignore[arg-type]
    assert isinstance(InputError("x"), ValueError)  # callers catching ValueError keep working
    assert math.isclose(FP8_MAX, float(torch.finfo(torch.float8_e4m3fn).max))
