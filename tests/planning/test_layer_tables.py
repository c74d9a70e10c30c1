"""One per-layer table per model kind: memory and FLOPs are computed from it, never summed by the kind.

The tables' numbers are held elsewhere against real tensors and counters (the V4.1 cache and scores in
tests/planning/test_checkpoint_plan.py, the V4 cache in tests/models/deepseek_v4/test_released.py, the FLOPs
against ``FlopCounterMode`` in tests/planning/test_gpu_time.py); here: what the tables say, by hand from the
configs, and that both the run-time price and the plan read them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from phaselens.contract.layer_table import LayerRow, LayerTable, Store
from phaselens.errors import NotApplicableError
from phaselens.models.deepseek_v4.layer_table import STREAM_COPIES
from phaselens.models.deepseek_v4.layer_table import layer_table as v4_table
from phaselens.models.deepseek_v4.memory import estimate_memory as v4_estimate
from phaselens.models.deepseek_v41 import load_v41
from phaselens.models.deepseek_v41.layer_table import layer_table as v41_table
from phaselens.models.deepseek_v41.memory import estimate_memory as v41_estimate
from phaselens.planning.flops import pass_cost
from tests.support.deepseek import tiny_v4_model
from tests.support.deepseek_v41 import write_tiny_checkpoint


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return load_v41(write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "t"), dtype=torch.float32,
                    index_topk="all")


@pytest.fixture(scope="module")
def v4():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_v4_model(seed=1)


def test_the_v41_table_states_each_layer_from_the_config(v41):
    c, t = v41.config, v41_table(v41)
    assert [r.layer for r in t.rows] == list(range(c.num_hidden_layers))
    assert [r.ratio for r in t.rows] == [role.ratio for role in v41.roles]
    assert t.window == c.sliding_window and t.vocab == c.vocab_size and (t.keys, t.sink) == ("unfold", 1)
    for row, role in zip(t.rows, v41.roles):  # every layer its window; a KV source its entries and open group
        stores = {s.rows: s for s in row.cache}
        assert stores["window"].width == c.head_dim
        assert ("entries" in stores) == bool(role.ratio and role.is_kv_source)
        if "entries" in stores:
            assert stores["entries"].width == c.head_dim + c.index_head_dim and stores["open"].item == 4
    T = 29
    hand = sum(min(T, c.sliding_window - 1) * c.head_dim * 4 for _ in v41.roles)
    hand += sum((T // r.ratio) * (c.head_dim + c.index_head_dim) * 4 + (T % r.ratio) * c.head_dim * 4 * 2
                for r in v41.roles if r.ratio and r.is_kv_source)
    assert t.cache_bytes(T, 3) == 3 * hand


def test_v41s_run_time_price_is_its_tables(v41):
    """``estimate_memory`` (every run's price, ``phaselens.plan``) is the table's memory of the chunk plan."""
    t = v41_table(v41)
    e = v41_estimate(v41, 29, batch=2, chunk=8, logits="query")
    calls = [(0, 8), (8, 16), (16, 21), (21, 29)]  # the prefix in pieces of 8, then the last 8 (the query)
    assert e.attention == max(t.score_bytes(a, b, 2) for a, b in calls)
    assert e.activations == max(t.transient_bytes(a, b, 2) for a, b in calls) + t.fixed
    assert e.cache == t.cache_bytes(29, 2) and e.weights == t.weights
    assert e.logits == 2 * 8 * t.vocab * 4


def test_v4s_table_prices_the_adapter_and_counts_the_streams_it_leaves_out(v4):
    c, t = v4.config, v4_table(v4)
    kinds = {r.kind for r in t.rows}
    assert "sliding" in kinds and any(k.startswith("ratio") for k in kinds) and (t.keys, t.sink) == ("cached", 0)
    assert t.per_token == STREAM_COPIES * c.hc_mult * c.hidden_size * 4
    e = v4_estimate(v4, 40, batch=2, chunk=8)
    assert e.activations == 0  # the adapter's run-time price: weights, cache, attention, logits
    assert e.cache == t.cache_bytes(40, 2) and e.attention == max(
        t.score_bytes(a, b, 2) for a, b in [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)])
    assert v4_estimate(v4, 40).cache == 0  # one uncached call keeps no cache


def test_a_layer_without_work_is_not_priced_in_time(v4, v41):
    """DeepSeek-V4's table states no work (its time is not priced): pass_cost says so, naming the layers; a
    V4.1 pass prices every layer kind."""
    with pytest.raises(NotApplicableError, match="describes no work for layers"):
        pass_cost(v4_table(v4), [(0, 16)])
    cost = pass_cost(v41_table(v41), [(0, 16)], head_rows=1)
    assert set(cost.kinds) == {r.kind for r in v41_table(v41).rows} and cost.total.total_flops > 0


def test_stores_count_rows_by_their_rule():
    """A hand-built table: window, finished entries, the open block and an overlapping compressor's previous
    block, each ``rows x width x item x copies``."""
    stores = (Store("window", 4, 2, copies=2), Store("entries", 8, 2, ratio=4), Store("open", 16, 4, copies=2, ratio=4),
              Store("block", 4, 4, ratio=4))
    t = LayerTable((LayerRow(0, "ratio 4", 2, 4, ratio=4, cache=stores),), weights=0, window=8, vocab=10,
                   logits_item=4, score_item=2)
    assert t.cache_bytes(3) == 3 * 4 * 2 * 2 + 0 + 3 * 16 * 4 * 2 + 0  # T < ratio: no entry, no previous block
    assert t.cache_bytes(10) == 7 * 4 * 2 * 2 + 2 * 8 * 2 + 2 * 16 * 4 * 2 + 4 * 4 * 4
    # a call on slots 8..11 attends 7 cached + 4 own keys and every entry so far (12 // 4)
    assert t.score_bytes(8, 12, batch=2) == 2 * 2 * 4 * (7 + 4 + 3) * 2
