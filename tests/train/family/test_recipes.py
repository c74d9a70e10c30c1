"""The family's recipes, data and plan: published Qwen3-0.6B sizes, the paper's task, user tokens mixed at a
stated ratio, and a plan of the 0.6B x 100B-token run printed without building the model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import phaselens
from phaselens.errors import ConfigError, InputError
from phaselens.train.family.data import FamilyData, TokenFiles
from phaselens.train.family.recipes import (
    LAYOUTS,
    family_config,
    family_recipe,
    paper_task,
    recipe_names,
    training_tasks,
)
from phaselens.train.family.run import family_data
from phaselens.train.family.training_plan import plan_run
from tests.support.paths import ROOT


def test_the_0_6b_control_has_qwen3_0_6b_parameters():
    """Counted on transformers' own Qwen3ForCausalLM (meta device) built from the published config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    published = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                     tie_word_embeddings=True)
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(Qwen3Config(**published))
    theirs = sum(p.numel() for p in hf.parameters())
    plan = plan_run(family_recipe("paper-full", "0.6b"), gpus=8)
    assert plan.parameters == theirs == 596_049_920  # Qwen3-0.6B: "0.6B parameters, 0.44B non-embedding"
    assert plan.non_embedding == 440_467_456
    cfg = family_config("full", "0.6b")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp, cfg.d_vocab) == \
        (28, 1024, 16, 8, 128, 3072, 151936)
    assert cfg.rope.theta == 1e6 and cfg.tie_embeddings and cfg.qk_norm and cfg.mlp == "swiglu"


def test_the_paper_layouts_are_recipes():
    overlaps: dict[int, set[int]] = {}
    for comp, _ in LAYOUTS.values():
        if comp is not None:
            overlaps.setdefault(comp.stride, set()).add(comp.window // comp.stride)
    assert overlaps == {4: {1, 2}, 6: {1, 2}, 8: {1, 2}, 12: {1, 2}}  # strides 4-12, with and without overlap
    assert "paper-full" in recipe_names() and family_config("full", "tiny").compression is None
    r = family_recipe("paper-w8s4", "0.6b")
    assert r.tokens() >= 100e9 > r.tokens(r.settings.steps - 1)  # the paper's budget, warm-up rows included
    data = family_data(r)
    assert data.tokens_until(r.settings.steps, 512) == r.tokens()  # the plan counts what the data gives
    with pytest.raises(ConfigError, match="no family recipe"):
        family_recipe("paper-w5s5")
    with pytest.raises(ConfigError, match="no family size"):
        family_recipe("paper-w4s4", "1b")


def test_the_paper_task_holds_the_query_and_the_target_moments_fixed():
    assert {(t.n_records, t.padding) for t in training_tasks()} == {
        (n, p) for n in (16, 32, 64) for p in ("prefix", "in_sequence")}
    for task in [paper_task(p) for p in ("prefix", "in_sequence")] + list(training_tasks()):
        padding = task.padding
        batch = task.build(phaselens.PhaseSpec(4), n_per_residue=40, seed=0)
        f = batch.frame
        assert task.n_demos == 8 and batch.tokens.shape[1] == 351 and padding in ("prefix", "in_sequence")
        assert batch.query_pos.unique().tolist() == [350]  # one query position
        design = task.plan().design  # exact (rational) moments of the target's slot, residue by residue
        assert len({design.moments(r) for r in range(24)}) == 1
        assert all(set(f.loc[f.residue == r, "t_K"]) <= set(design.pmf(r)[0].tolist()) for r in range(24))
        # the target value lies beyond the 16-token local window: reachable only through entries
        assert (batch.query_pos - (torch.tensor(f["t_K"].to_numpy()) + 1) >= 16).all()


def test_token_files_mix_at_the_stated_ratio(tmp_path):
    ids = np.arange(5000, dtype=np.uint16) % 150
    np.save(tmp_path / "a.npy", ids)
    ids.astype(np.uint16).tofile(tmp_path / "b.bin")
    files = TokenFiles((str(tmp_path / "a.npy"), str(tmp_path / "b.bin")))
    data = FamilyData(training_tasks(), files, ratio=0.25, d_vocab=160)
    tokens, targets = data(16, seed=3)
    assert tokens.shape == targets.shape == (16, 351)
    dense = (targets != -100).all(1)  # user rows train every position on the next token
    assert int(dense.sum()) == 4
    assert ((targets[~dense] != -100).sum(1) == 9).all()  # task rows: the answer and the 8 demonstrations
    rows = tokens[dense]
    assert torch.equal(targets[dense][:, :-1], rows[:, 1:])
    assert ((rows[:, 1:] - rows[:, :-1]) % 150 == 1).all()  # consecutive ids: windows of the files
    t2, g2 = data(16, seed=3)
    assert torch.equal(tokens, t2) and torch.equal(targets, g2)  # a pure function of the seed
    assert not torch.equal(tokens, data(16, seed=4)[0])
    too_big = FamilyData(training_tasks(), files, ratio=0.5, d_vocab=100)
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        too_big(8, seed=0)
    with pytest.raises(InputError, match="does not exist"):
        TokenFiles((str(tmp_path / "missing.bin"),))
    with pytest.raises(InputError, match="needs token files"):
        FamilyData(training_tasks(), None, ratio=0.5)


def test_the_plan_prints_in_seconds_without_allocating_the_model():
    """`phaselens train --recipe paper-w4s4 --size 0.6b --plan`: the model (2.6 GB in fp32) is never allocated,
    so the process stays far below its size."""
    # VmHWM, this process's own peak: not ru_maxrss, which exec inherits from the parent (here a pytest worker)
    code = ("import re, sys; from phaselens.presentation.cli import app; sys.argv = ['phaselens', 'train', '--recipe', "
            "'paper-w4s4', '--size', '0.6b', '--plan', '--gpus', '1,8']\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "print('maxrss_kb', re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "596,517,632" in out and "100,000,132,608" in out and "557,609 steps" in out
    # 2.74e9 FLOPs per task token (6 (N - embedding) + attention + the unembedding at 9 of 351 positions), the
    # recompute of activation recompute in the GPU-hours (6 N D counted 3.58e20 without it)
    assert "2.74e+20 + recompute 9.05e+19" in out and "per task token 2.74e+09" in out
    assert "256.0 at 40% of 989 TFLOP/s per GPU, MFU 30%" in out and "32.0 h on 8 GPUs" in out
    rss_gb = int(out.split("maxrss_kb")[1].split()[0]) / 2**20
    assert rss_gb < 1.0, rss_gb  # measured 0.42 (import torch alone: 0.34); the embedding alone is 0.62


def test_plan_arithmetic():
    p = plan_run(family_recipe("paper-full", "0.6b"), gpus=8, mfu=0.5, peak_tflops=1000.0)
    assert p.flops == pytest.approx(p.per_token.model * p.tokens, rel=0.02)  # the warm-up rows are shorter
    assert p.flops < 0.85 * 6 * p.parameters * p.tokens  # 6 N D counted the embedding at every token
    assert p.gpu_hours == pytest.approx(p.executed_flops / (1000e12 * 0.5) / 3600)
    assert p.executed_flops > p.flops  # recompute (the plan's default) runs the blocks' forward twice
    assert p.wall_hours == pytest.approx(p.gpu_hours / 8)
    one = plan_run(family_recipe("paper-full", "0.6b"), gpus=1, micro_batch=64)
    assert one.memory["sharded state"] == 8 * p.memory["sharded state"]  # 16 bytes per parameter, split 8 ways


def test_the_warm_up_trains_shorter_items_first():
    r = family_recipe("paper-w4s4", "tiny")
    data = family_data(r)
    assert r.warmup_steps == 1200 and data.uses_step
    early, warm_targets = data(8, 0, 1199)
    late, targets = data(8, 0, 1200)
    assert early.shape == (8, 147) and late.shape == (8, 351)
    # a quarter each: records in both padding schemes (answer + 4 demonstrations) and induction rows (repeats of
    # 24 and of 12 tokens)
    assert sorted((warm_targets != -100).sum(1).tolist()) == [5] * 4 + [11] * 2 + [23] * 2
    assert ((targets != -100).sum(1) == 9).all()
    assert r.tokens() == 32 * (1200 * 147 + 1200 * 351) == data.tokens_until(2400, 32)


def test_the_control_warms_up_on_induction_and_trains_as_long_on_the_task():
    comp, full = family_recipe("paper-w4s4", "tiny"), family_recipe("paper-full", "tiny")
    assert (comp.warmup_kind, full.warmup_kind) == ("records", "induction")
    assert comp.settings.steps - comp.warmup_steps == full.settings.steps - full.warmup_steps == 1200
    tokens, targets = family_data(full)(8, 0, 0)  # 96-token induction rows: the 23 repeated tokens trained
    assert tokens.shape == (8, 96) and (targets != -100).sum(1).tolist() == [23] * 8
    assert full.tokens() == 32 * (1000 * 96 + 1200 * 351) == family_data(full).tokens_until(2200, 32)
