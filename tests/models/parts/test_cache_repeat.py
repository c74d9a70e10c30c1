"""The transformers-cache repeat every engine over a transformers cache shares (parts/cache_repeat.py): per-row state
repeated along the batch, counters and dicts copied per pass, anything else refused by name."""

from __future__ import annotations

import pytest
import torch

from phaselens.errors import UnsupportedModelError
from phaselens.models.causal_lm.engine import ROWS as CAUSAL_ROWS
from phaselens.models.deepseek_v4.engine import ROWS as V4_ROWS


class Layer:
    def __init__(self, **extra):
        self.keys = self.values = torch.arange(2 * 3.0).view(2, 1, 3, 1)  # K = V: one tensor
        self.compressed_kv = {"compressor": torch.ones(2, 4, 5)}
        self.entry_count = {"compressor": 4}
        self.window = 8  # not per-row state
        self.__dict__.update(extra)


@pytest.mark.parametrize("rows", [CAUSAL_ROWS, V4_ROWS], ids=["causal_lm", "deepseek_v4"])
def test_unknown_batch_state_is_refused_by_name(rows):
    for mystery in (torch.zeros(2, 5), {"a": torch.zeros(2)}, [torch.zeros(2)]):
        with pytest.raises(UnsupportedModelError, match=r"Layer\.mystery is cache state .*engine='full'"):
            rows.repeated(Layer(mystery=mystery, compressed_kv={}, entry_count={}) if rows is CAUSAL_ROWS
                          else Layer(mystery=mystery), 3)


def test_rows_repeat_copy_by_copy_and_each_pass_gets_its_own_dicts():
    layer = Layer()
    new = V4_ROWS.repeated(layer, 3)
    assert new.keys.shape == (6, 1, 3, 1) and new.values is new.keys  # K = V stays one tensor
    assert torch.equal(new.keys[2:4], layer.keys) and new.compressed_kv["compressor"].shape == (6, 4, 5)
    a, b = V4_ROWS.fresh(new), V4_ROWS.fresh(new)
    a.entry_count["compressor"] += 1
    a.compressed_kv["compressor"] = None
    assert new.entry_count == b.entry_count == {"compressor": 4} and b.compressed_kv["compressor"] is not None
    assert layer.keys.shape == (2, 1, 3, 1) and new.window == 8  # the prefix's own layer is untouched


def test_held_counts_the_per_row_state_only():
    class Cache:
        layers = [Layer(), Layer()]

    per_layer = 2 * 6 * 4 + 40 * 4  # keys and values (one tensor, counted twice) and the entries, fp32
    assert V4_ROWS.held(Cache(), 0) == 2 * per_layer and V4_ROWS.held(Cache(), 1) == per_layer
