"""The cost model against measurement: FLOPs against ``torch.utils.flop_counter.FlopCounterMode`` (the real
training call at the tiny and small sizes, the meta-device model at 0.6b), activations against the tensors
autograd saves, and what the plan makes of them (recompute in GPU-hours, when recompute is needed)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from phaselens.models.compressed.attention import NoPast
from phaselens.models.compressed.transformer import CompressedTransformer
from phaselens.train.family.costs import activation_bytes, flops_per_token, layer_kinds
from phaselens.train.family.recipes import family_recipe, paper_task
from phaselens.train.family.training_plan import GiB, plan_run

LAYOUTS = ["paper-full", "paper-w4s4", "paper-w8s4"]


def _count(cfg, model, seq, trained):
    n = sum(p.numel() for p in model.parameters())
    return flops_per_token(cfg, n, model.embed.weight.numel(), seq=seq, trained=trained)


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flops_per_token_match_the_flop_counter(layout, size):
    """The trainer's own call (loss at the trained positions, backward) under FlopCounterMode. The counter sees
    matrix products only; the local window's scores are elementwise, so they are compared apart (exactly)."""
    cfg = family_recipe(layout, size).config
    torch.manual_seed(0)
    model = CompressedTransformer(cfg)
    tokens, targets = paper_task().sample_training_batch(2, 0)
    counter = FlopCounterMode(display=False)
    with counter:
        model(tokens, targets=targets, return_type="loss", reduction="sum").backward()
    measured = counter.get_total_flops() / tokens.numel()
    c = _count(cfg, model, tokens.shape[1], float((targets != -100).sum()) / len(targets))
    assert (targets != -100).sum(1).tolist() == [9, 9]  # the unembedding runs at 9 of 351 positions
    # measured: tiny w4s4 1.0039, full 1.0020; small 1.0010 and 1.0007 (the norms' weights in 6(N - emb))
    assert c.model - c.local_window == pytest.approx(measured, rel=0.01)
    windows = sum(kind != "full" for kind in layer_kinds(cfg))
    assert c.local_window == 12 * cfg.n_heads * cfg.d_head * cfg.local_window * windows
    assert c.model == pytest.approx(measured, rel=0.05)  # with the window: within the 5%


def _meta_flops(cfg, seq=351, trained=9):
    """FlopCounterMode on the meta device (nothing allocated): the forward's own modules in order, unembedding
    the last ``trained`` positions (the same products as the loss at ``trained`` positions), and backward."""
    with torch.device("meta"):
        model = CompressedTransformer(cfg)
        tokens = torch.zeros(2, seq, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        resid = model.embed(tokens)
        for block in model.blocks:
            resid = block(resid, NoPast())
        model.unembed(model.ln_final(resid[:, -trained:])).float().sum().backward()
    return counter.get_total_flops() / tokens.numel(), _count(cfg, model, seq, trained)


@pytest.mark.parametrize(("layout", "low", "high"), [("paper-w4s4", 2.70e9, 2.78e9), ("paper-full", 2.87e9, 2.95e9)])
def test_flops_per_token_at_0_6b(layout, low, high):
    """The issue's target: 2.7-2.9e9 FLOPs per token at 0.6b (6 N counted 3.58e9). Measured on the meta device:
    w4s4 2.7290e9 of matrix products (count 2.7294e9 + window 1.1e7), full 2.9079e9 (count 2.9083e9)."""
    cfg = family_recipe(layout, "0.6b").config
    measured, c = _meta_flops(cfg)
    assert c.model - c.local_window == pytest.approx(measured, rel=0.005)
    assert low < c.model < high and low < measured < high
    assert 6 * (c.dense / 6 + cfg.d_vocab * cfg.d_model) > 1.2 * c.model  # what 6 N over-counted
    plan = plan_run(family_recipe(layout, "0.6b"), gpus=8)
    assert plan.per_token.model == pytest.approx(c.model)
    assert plan.flops == pytest.approx(c.model * plan.tokens, rel=0.02)  # the warm-up's rows are shorter


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("layout", ["paper-full", "paper-w4s4", "paper-w8s4", "paper-w12s12"])
def test_activation_count_matches_the_saved_tensors(layout, size, bf16):
    """Distinct storages autograd saves for one block (not the weights themselves); measured: fp32 0.997-1.000,
    autocast 0.998-1.0003 of the count."""
    cfg = family_recipe(layout, size).config
    model = CompressedTransformer(cfg)
    tokens, _ = paper_task().sample_training_batch(3, 0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = model.embed(tokens).detach().requires_grad_()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        model.blocks[0](x, NoPast())
    weights = sum(p.numel() for p in model.blocks[0].parameters() if p.dim() >= 2)
    count = activation_bytes(cfg, layer_kinds(cfg)[0], rows=3, seq=tokens.shape[1], cbytes=2 if bf16 else 4,
                             block_weights=weights)
    assert count == pytest.approx(sum(seen.values()), rel=0.01)


def test_the_plan_prices_the_recompute_and_says_when_it_is_needed():
    recipe = family_recipe("paper-w4s4", "0.6b", batch_size=64)
    on = plan_run(recipe, gpus=1, micro_batch=32, recompute_activations=True)
    off = plan_run(recipe, gpus=1, micro_batch=32, recompute_activations=False)
    assert on.flops == off.flops and off.executed_flops == off.flops
    t = on.per_token  # the recompute: one more forward of the blocks (a third of their fwd + bwd)
    assert t.recompute == pytest.approx((t.dense + t.attention + t.local_window) / 3)
    assert on.gpu_hours / off.gpu_hours == pytest.approx(on.executed_flops / on.flops)
    assert 1.30 < on.gpu_hours / off.gpu_hours < 1.34  # 256.0 against 192.4 GPU-hours
    assert on.model_flops_utilisation == pytest.approx(0.40 * on.flops / on.executed_flops)
    # an 80 GB GPU at micro-batch 32 holds the run without recompute (44.1 GiB); at 64 it does not (78.4)
    assert not off.needs_recompute and 40 < off.memory_per_gpu / GiB < 48
    big = plan_run(recipe, gpus=1, micro_batch=64, recompute_activations=False)
    assert big.needs_recompute and big.memory_per_gpu / GiB > 0.9 * 80e9 / GiB
    assert off.largest_micro_batch_without_recompute == big.largest_micro_batch_without_recompute == 53
    assert "recompute not needed on a 80 GB GPU" in str(off) and "recompute needed" in str(big)
