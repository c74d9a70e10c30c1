"""``phaselens plan``: sizes of the released checkpoints from their config.json alone, against hand counts, and
the V4.1 memory estimate against the tensors a run really holds."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from typer.testing import CliRunner

from phaselens.contract.memory import MemoryEstimate
from phaselens.errors import CheckpointError, InputError, UnsupportedModelError
from phaselens.models.deepseek_v41 import load_v41
from phaselens.models.deepseek_v41.memory import estimate_memory
from phaselens.planning.checkpoint_plan import gpu_bytes, plan_model
from phaselens.presentation.cli import app
from tests.support.deepseek_v41 import write_tiny_checkpoint
from tests.support.paths import DATA

CONFIGS = DATA / "configs"
GiB = 2**30


@pytest.fixture(scope="module")
def v41_flash_dir(tmp_path_factory):
    """A directory that holds only the released V4.1-Flash config.json."""
    d = tmp_path_factory.mktemp("plan") / "DeepSeek-V4.1-Flash"
    d.mkdir()
    shutil.copy(CONFIGS / "DeepSeek-V4.1-Flash" / "config.json", d / "config.json")
    return d


def test_plan_json_gives_v41_flash_packed_size_not_the_dequantized_one(v41_flash_dir):
    """Acceptance: ``phaselens plan DIR --json`` on config.json alone prints the packed size: ~0.3 TB for the text
    model (``--engram drop``), ~0.5 TB with Engram's FP8 tables (load's default, ``engram="run"``)."""
    plans = {}
    for extra in ([], ["--engram", "drop"]):
        res = CliRunner().invoke(app, ["plan", str(v41_flash_dir), "--json", *extra])
        assert res.exit_code == 0, res.output
        plans[tuple(extra)] = json.loads(res.output)
    drop, run = plans[("--engram", "drop")], plans[()]
    assert drop["config_only"] and drop["model_type"] == "deepseek_v41"
    assert 0.28e12 < drop["weights_bytes"] < 0.32e12  # ~0.3 TB packed
    assert 1.08e12 < drop["weights_dequantized_bytes"] < 1.12e12  # the 1.1 TB of docs/deepseek_v41.md
    # with Engram: its two FP8 tables as stored, plus its two FP8 wkv projections (packed, with block scales)
    text = json.loads((v41_flash_dir / "config.json").read_text())["text_config"]
    cols = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"] * text["engram_head_dim"]
    out = text["hidden_size"] * (text["hc_mult"] + 1)
    wkv = cols * out + math.ceil(cols / 32) * math.ceil(out / 32)
    qk = 2 * text["hc_mult"] * text["hidden_size"] * 2  # q_weight, k_weight in bf16
    assert run["weights_bytes"] - drop["weights_bytes"] == run["engram_stored_bytes"] + 2 * (wkv + qk)
    assert 0.48e12 < run["weights_bytes"] < 0.52e12


def test_v41_flash_saving_equals_a_hand_count(v41_flash_dir):
    """Dequantized minus packed bytes, counted by hand from the config: every FP8 projection saves one byte per
    weight minus one scale byte per 32 x 32 block; every FP4 expert weight saves 2 - 1/2 - 1/32 bytes."""
    text = json.loads((v41_flash_dir / "config.json").read_text())["text_config"]
    D, H, d, F = text["hidden_size"], text["num_attention_heads"], text["head_dim"], text["moe_intermediate_size"]
    q, G, r, L = text["q_lora_rank"], text["o_groups"], text["o_lora_rank"], text["num_hidden_layers"]
    Hi, di = text["index_n_heads"], text["index_head_dim"]
    blocks = lambda o, i: math.ceil(o / 32) * math.ceil(i / 32)  # noqa: E731
    fp8 = [(q, D), (H * d, q), (d, D), (G * r, H * d // G), (D, G * r), (F, D), (D, F), (F, D)]
    per_layer = sum(o * i - blocks(o, i) for o, i in fp8)
    index = len(text["index_source_layer_ids"]) * (Hi * di * q - blocks(Hi * di, q))
    experts = L * text["n_routed_experts"] * 3 * F * D * (2 - 0.5 - 1 / 32)
    plan = plan_model(str(v41_flash_dir), engram="drop")
    assert plan.weights_dequantized_bytes - plan.weights_bytes == L * per_layer + index + experts
    assert plan.engram_stored_bytes == 202_758_032_400  # 768,022,850 rows x (256 FP8 values + 8 UE8M0 scales)
    assert any("Engram" in n for n in plan.notes)
    assert plan.map_node_gpus is not None and plan.per_gpu_bytes <= 0.9 * 141e9
    # Engram's 101 GB tables stay in host memory (device maps never put them on a GPU): one 8 x H100 node holds
    # the rest, as it holds the model without Engram (tests/models/test_plan_time.py checks the plan's Engram numbers)
    with_tables = plan_model(str(v41_flash_dir), gpu_memory="H100")
    assert with_tables.engram_placement == "host" and with_tables.engram_host_bytes == with_tables.engram_stored_bytes
    assert with_tables.gpus is not None and with_tables.gpus <= 8 and with_tables.map_node_gpus == 8


def test_v4_flash_and_pro_plans():
    """V4 as transformers holds it on CUDA (FP8Linear / FP8Experts): the dequantized bf16 size is the 529.7 GiB
    measured on the meta device in docs/scale.md; packed, FP4 experts make it less than a third."""
    flash = plan_model(str(CONFIGS / "DeepSeek-V4-Flash"), gpu_memory="H200")
    assert round(flash.weights_dequantized_bytes / GiB, 1) == 529.7
    assert flash.weights_bytes < 0.3 * flash.weights_dequantized_bytes
    assert flash.map_node_gpus in (1, 2, 4, 8)
    pro = plan_model(str(CONFIGS / "DeepSeek-V4-Pro"), gpu_memory="80GB", context=4096)
    assert pro.weights_bytes > 2 * flash.weights_bytes and pro.gpus is not None and pro.gpus >= 8
    assert pro.map_node_gpus is None  # 8 x 80 GB cannot hold V4-Pro's packed weights
    assert gpu_bytes("H100") == 80e9 and gpu_bytes("80GiB") == 80 * GiB and gpu_bytes(141) == 141e9


def test_plan_refuses_bad_sources(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        plan_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelError, match="deepseek_v41"):
        plan_model(f"hf:{tmp_path}")
    with pytest.raises(InputError, match="gpu-memory"):
        gpu_bytes("lots")
    res = CliRunner().invoke(app, ["plan", str(tmp_path / "nowhere")])
    assert res.exit_code == 3 and "no config.json" in res.output


def test_v41_memory_estimate_counts_the_tensors_a_run_holds(tmp_path):
    """Cache bytes equal the V41Cache's tensors after a chunked run; the attention estimate equals the score
    tensor ``[B, H, n, window + entries + sink]`` (fp32) of the run's largest call, read from the hooks."""
    model = load_v41(write_tiny_checkpoint(tmp_path / "t"), dtype=torch.float32, index_topk="all")
    T, chunk = 29, 8
    est = estimate_memory(model, T, batch=2, chunk=chunk, logits="query")
    cache = model.new_cache(2)
    x = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(0))
    widths = []
    with torch.no_grad(), model.hooks(fwd_hooks=[
            ("blocks.4.attn.hook_pattern_entry", lambda t, hook: widths.append(t.shape))]):
        for a in range(0, T - chunk, chunk):  # the same pieces forward(chunk=8) runs
            model(x[:, a : min(a + chunk, T - chunk)], cache=cache)
        model(x[:, T - chunk :], cache=cache)
    held = sum(t.numel() * t.element_size() for t in cache.window.values())
    held += sum(t.numel() * t.element_size() for s in cache.sources.values()
                for t in (s.entries, s.index_keys, s.pending_kv, s.pending_score))
    assert est.cache == held
    L = model.config.sliding_window
    B, H, n, E = max(widths, key=lambda s: s[2] * (L + s[3] + 1))  # layer 4 (ratio 1) attends the most entries
    assert est.attention == B * H * n * (L + E + 1) * 4
    assert est.logits == 2 * chunk * 128 * 4 and est.weights > 0
    # the contract's one type (the V4 adapter returns it too), and its total counts four score tensors
    assert type(est) is MemoryEstimate and est.activations > 0
    assert est.total() == est.weights + est.cache + 4 * est.attention + est.activations + est.logits
