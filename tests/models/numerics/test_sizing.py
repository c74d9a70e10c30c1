"""Element and module sizes for memory estimates."""

from __future__ import annotations

import torch
from torch import nn

from phaselens.models.numerics.sizing import held_bytes


def test_item_sizes_the_estimates_read_from_torch():
    assert [d.itemsize for d in (torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32, torch.float64)] \
        == [1, 1, 2, 4, 8]


def test_held_bytes_counts_parameters_and_buffers_as_held_also_on_meta():
    m = nn.Linear(8, 4, dtype=torch.bfloat16)  # 32 + 4 bf16 values
    m.register_buffer("codes", torch.zeros(10, dtype=torch.uint8))
    assert held_bytes(m) == 36 * 2 + 10
    with torch.device("meta"):
        meta = nn.Linear(8, 4, dtype=torch.bfloat16)
    assert held_bytes(meta) == 36 * 2
