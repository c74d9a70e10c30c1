"""Time in ``phaselens plan`` (issue "DeepSeek-V4.1 at its real size", item 4): the FLOPs of a forward per layer
kind against ``torch.utils.flop_counter.FlopCounterMode`` on tiny V4.1 models (measured/estimated: 1.000 for
every kind, every case below), a hand count on the released config, and the plan's time fields (forward-
equivalents of a head map with the query-suffix engine, seconds, GPU-hours, overridable peaks)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from phaselens.errors import InputError
from phaselens.models.deepseek_v41 import IndexTopKWarning, load_v41
from phaselens.models.deepseek_v41.checkpoint import meta_v41
from phaselens.models.deepseek_v41.layer_table import layer_table
from phaselens.models.parts.chunks import plan_chunks
from phaselens.planning.checkpoint_plan import head_map_layers, plan_model
from phaselens.planning.flops import pass_cost, prefill_calls
from phaselens.planning.gpu_time import GPU_SPECS, HOST_LINK_GBPS, map_cost
from phaselens.presentation.cli import app
from tests.support.deepseek_v41 import TINY_TEXT, write_tiny_checkpoint
from tests.support.paths import DATA

pytestmark = pytest.mark.filterwarnings("ignore::phaselens.models.deepseek_v41.IndexTopKWarning")
CONFIGS = DATA / "configs"
FLASH = CONFIGS / "DeepSeek-V4.1-Flash"
ROOT = "DeepSeekV41"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cost") / "tiny-v41-engram", engram=True)


def load(root, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        return load_v41(root, dtype=torch.float32, **kw)


def measured_by_kind(model, run) -> dict[str, float]:
    """FlopCounterMode's FLOPs of ``run()`` summed per layer kind (blocks without Engram), Engram and the head
    (everything outside the blocks: the final collapse and the head)."""
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        run()
    flops = {k: float(sum(v.values())) for k, v in counter.get_flop_counts().items()}
    out: dict[str, float] = {}
    blocks = 0.0
    for i, role in enumerate(model.roles):
        block, engram = flops.get(f"{ROOT}.blocks.{i}", 0.0), flops.get(f"{ROOT}.blocks.{i}.engram", 0.0)
        kind = "sliding" if role.ratio == 0 else f"ratio {role.ratio}"
        out[kind] = out.get(kind, 0.0) + block - engram
        out["engram"] = out.get("engram", 0.0) + engram
        blocks += block
    out["head"] = flops[ROOT] - blocks
    return out


@pytest.mark.parametrize("index_topk", [None, "all"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_flops_per_layer_kind_match_the_flop_counter(ckpt, index_topk, chunk):
    """A tiny V4.1 (7 layers: sliding, ratio-2 and ratio-1 KV / index / candidate sources and reusers, Engram
    at layers 1 and 2) in fp32 on the CPU, 2 x 29 tokens, in one call or prefilled in chunks of 8: the count of
    ``phaselens.planning.flops`` per layer kind against FlopCounterMode's (measured ratio 1.000 for each kind)."""
    model = load(ckpt, index_topk=index_topk)
    T, B = 29, 2
    x = torch.randint(0, TINY_TEXT["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))
    measured = measured_by_kind(model, lambda: model(x, chunk=chunk, logits="query"))
    plan = plan_chunks(T, chunk, None)
    est = pass_cost(layer_table(model), plan.calls, batch=B, head_rows=plan.query_rows if chunk else T).by_kind()
    assert set(measured) == set(est) == {"sliding", "ratio 2", "ratio 1", "engram", "head"}
    ratios = {k: measured[k] / est[k].total_flops for k in est}
    assert all(abs(r - 1) < 0.10 for r in ratios.values()), ratios


def test_a_query_row_pass_matches_the_flop_counter(ckpt):
    """The suffix engine's unit: one query row per item through a cached prefix (here from layer 0), with one row
    of logits; and the part of it from a cell's layer up is the layers' sum from there."""
    model = load(ckpt)
    x = torch.randint(0, TINY_TEXT["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(2)
    with torch.no_grad():
        model(x[:, :23], cache=cache)
    measured = measured_by_kind(model, lambda: model(x[:, 23:], cache=cache, logits="query", query_len=1))
    est = pass_cost(layer_table(model), [(23, 24)], batch=2, head_rows=1)
    for kind, cost in est.by_kind().items():
        assert measured[kind] == pytest.approx(cost.total_flops, rel=0.10), kind
    upper = pass_cost(layer_table(model), [(23, 24)], batch=2, head_rows=1, first_layer=3)
    assert upper.total.total_flops == pytest.approx(sum(c.total_flops for c in est.layers[3:]) + est.head.total_flops)
    assert 2 not in upper.engram and 1 not in upper.engram  # Engram layers below the cell are not rerun


def test_sparse_attention_equals_computed_when_every_entry_is_a_pick(ckpt):
    """``attended="sparse"`` (window + top-k) equals what phaselens computes when no layer has more entries than
    index_topk, and is less when it does."""
    model = load(ckpt, index_topk=64)
    calls = prefill_calls(29, 8)
    assert pass_cost(layer_table(model), calls, attended="sparse").total == pass_cost(layer_table(model), calls).total
    flash = meta_v41(FLASH)
    long = prefill_calls(8192, 1024)
    assert pass_cost(layer_table(flash), long, attended="sparse").total.total_flops < pass_cost(layer_table(flash), long).total.total_flops


def test_released_flash_per_token_flops_by_hand():
    """One token at slot 0 through the released V4.1-Flash's layer 0 (sliding), counted by hand from config.json:
    the model-dtype matmuls are the attention projections and 6 routed + 1 shared experts; fp32 the
    hyper-connections, the router (384 experts) and the 128-key window."""
    text = json.loads((FLASH / "config.json").read_text())["text_config"]
    D, H, d, qr, R, G, F = (text[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank",
                                              "o_lora_rank", "o_groups", "moe_intermediate_size"))
    hc, L = text["hc_mult"], text["sliding_window"]
    flash = meta_v41(FLASH)
    layer0 = pass_cost(layer_table(flash), [(0, 1)]).layers[0]
    assert layer0.flops == 2 * (D * qr + qr * H * d + D * d + H * d * R + G * R * D + 7 * 3 * D * F)
    mix = (2 + hc) * hc
    assert layer0.flops_fp32 == 2 * (2 * hc * D * mix + 2 * hc * D + 2 * hc * hc * D) + 2 * D * 384 + 4 * H * d * L
    assert 7.0e8 < layer0.flops < 8.0e8  # ~0.37 B activated weights per layer (7 experts of 35 M: two thirds)


@pytest.fixture(scope="module")
def flash_plan():
    return plan_model(str(FLASH), gpu_memory="H100")


def seconds_from(entry: dict, t: dict) -> float:
    u = t["mfu"]
    return (entry["flops"] / (t["bf16_tflops"] * 1e12 * u) + entry["flops_fp32"] / (t["fp32_tflops"] * 1e12 * u)
            + entry["bytes"] / (t["hbm_tbps"] * 1e12 * u) + entry["host_bytes"] / (t["host_link_gbps"] * 1e9))


def test_the_plan_prices_a_forward_and_a_head_map(flash_plan):
    """V4.1-Flash on H100 at 128K: the forward and the head map (8 items, batch 1, 40 x 64 cells) with their
    FLOPs, bytes, seconds (the sum of the parts at 40% of an H100's peaks) and GPU-hours (seconds x GPUs)."""
    t = flash_plan.time
    assert t["gpu"] == "H100" and (t["bf16_tflops"], t["fp32_tflops"], t["hbm_tbps"]) == (989.0, 67.0, 3.35)
    assert t["mfu"] == 0.4 and t["host_link_gbps"] == HOST_LINK_GBPS
    f, m = t["forward"], t["map"]
    for entry, gpus in ((f, flash_plan.gpus), (m, flash_plan.map_node_gpus)):
        assert entry["seconds"] == pytest.approx(seconds_from(entry, t))
        assert entry["gpus"] == gpus and entry["gpu_hours"] == pytest.approx(entry["seconds"] * gpus / 3600)
        assert entry["total_flops"] == pytest.approx(sum(k["total_flops"] for k in entry["by_kind"].values()))
        assert entry["sparse_attention_flops"] < entry["total_flops"]
    assert f["context"] == 131072 and f["chunk"] == flash_plan.chunk == 128
    assert m["cells"] == 40 * 64 and m["prefix_passes"] == 8 and m["query_passes"] == 8 * (1 + 40 * 64)
    assert 8 < m["forward_equivalents"] < 9  # the prefixes, plus the query rows (cheap in FLOPs)
    assert set(f["by_kind"]) == {"sliding", "ratio 2", "ratio 1", "engram", "head"}
    # phaselens scores every entry of a compressed layer: fp32 attention dominates at 128K
    assert f["flops_fp32"] > 5 * f["flops"] and 3e16 < f["total_flops"] < 4.5e16
    assert f["host_bytes"] == 131072 * 12_672


def test_peaks_and_utilisation_are_overridable(flash_plan):
    """``--peak-tflops``, ``--fp32-tflops``, ``--hbm-tbps`` and ``--mfu`` change the seconds, not the counts; a GPU
    type named by ``--gpu-memory`` brings its own peaks; a bad rate is refused."""
    fast = plan_model(str(FLASH), gpu_memory="H100", peak_tflops=1978, fp32_tflops=134, hbm_tbps=6.7, mfu=0.8)
    base, quick = flash_plan.time["forward"], fast.time["forward"]
    assert quick["total_flops"] == base["total_flops"] and quick["bytes"] == base["bytes"]
    host = base["host_bytes"] / (HOST_LINK_GBPS * 1e9)  # the host link is not a GPU peak
    assert quick["seconds"] - host == pytest.approx((base["seconds"] - host) / 4)
    h200 = plan_model(str(FLASH), gpu_memory="141")
    assert h200.time["gpu"] == "H200" and h200.time["hbm_tbps"] == GPU_SPECS["H200"].hbm_tbps
    for bad in ({"mfu": 0}, {"mfu": 1.5}, {"peak_tflops": -1.0}, {"hbm_tbps": float("nan")}):
        with pytest.raises(InputError):
            plan_model(str(FLASH), **bad)


def test_item_batches_share_prefix_passes_not_flops():
    """Items in batches of 4: a quarter of the passes, the same FLOPs, fewer bytes (weights read once per batch)."""
    flash = meta_v41(FLASH)
    cells = head_map_layers(flash, 8192, 8, 1)  # the map's own declared cells: 40 layers x 64 heads
    assert len(cells) == 2560 and cells.count(0) == cells.count(39) == 64
    one = map_cost(layer_table(flash), 8192, cells, items=8, item_batch=1, chunk=1024)
    four = map_cost(layer_table(flash), 8192, cells, items=8, item_batch=4, chunk=1024)
    assert (four.prefix_passes, four.query_passes) == (2, 2 * (1 + 2560))
    assert four.cost.total_flops == pytest.approx(one.cost.total_flops)
    assert four.cost.bytes < one.cost.bytes
    assert math.isclose(one.forward_equivalents, four.forward_equivalents, rel_tol=1e-9)


def test_cli_prints_the_time_lines_and_v4_is_not_priced():
    res = CliRunner().invoke(app, ["plan", str(FLASH), "--gpu-memory", "H100", "--items", "4", "--mfu", "0.5"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    fwd = next(x for x in lines if x.startswith("  time (H100"))
    assert "a forward at 131,072 tokens (chunk 128)" in fwd and "GPU-hours" in fwd and "50% of peak" in fwd
    mp = next(x for x in lines if x.startswith("  time of a per-head map"))
    assert "4 items in batches of 1, 2,560 cells" in mp and "4 prefix + 10,244 query-row passes" in mp
    assert CliRunner().invoke(app, ["plan", str(FLASH), "--mfu", "0"]).exit_code == 3
    v4 = plan_model(str(CONFIGS / "DeepSeek-V4-Flash"), gpu_memory="H200")
    assert v4.time is None and any("DeepSeek-V4.1 only" in n for n in v4.notes)
