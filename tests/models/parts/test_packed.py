"""Packed FP8 / FP4 weights: byte layouts and block scales, decoded against the formats' tables."""

from __future__ import annotations

import pytest
import torch

from phaselens.errors import CheckpointError
from phaselens.models.parts.formats import E2M1_VALUES
from phaselens.models.parts.packed import FP4_ROWS, PackedFormat, as_bytes, dequantize, dequantize_rows


def ue8m0(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).to(torch.float8_e8m0fnu).view(torch.uint8)


def test_fp4_bytes_are_two_codes_low_nibble_first_with_a_sign_bit():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8)  # values 0..15 in order
    w = dequantize(packed.repeat(1, 4), ue8m0([[1.0, 1.0]]).reshape(1, 2), PackedFormat("fp4", (1, 32)),
                   torch.float32)
    table = [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
    assert w[0, :16].tolist() == table and FP4_ROWS == PackedFormat("fp4", (1, 32))


def test_fp8_blocks_take_their_own_scale():
    values = torch.ones(4, 4).to(torch.float8_e4m3fn)
    scale = ue8m0([[1.0, 2.0], [4.0, 0.5]])
    w = dequantize(as_bytes(values), scale, PackedFormat("fp8", (2, 2)), torch.bfloat16)
    assert w.dtype == torch.bfloat16
    assert w.float().tolist() == [[1, 1, 2, 2], [1, 1, 2, 2], [4, 4, 0.5, 0.5], [4, 4, 0.5, 0.5]]
    rows = dequantize_rows(as_bytes(values[:, :2]), ue8m0([[1.0], [2.0], [4.0], [8.0]]), PackedFormat("fp8", (1, 2)),
                           torch.tensor([[3, 0]]), torch.float32)
    assert rows.tolist() == [[[8.0, 8.0], [1.0, 1.0]]]
    with pytest.raises(CheckpointError, match="scales of shape"):
        dequantize(as_bytes(values), scale[:1], PackedFormat("fp8", (2, 2)), torch.float32)
