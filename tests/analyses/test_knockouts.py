"""Knockouts: head specs, equality with a manual hook, nnsight parity, and no leaked hooks."""

from __future__ import annotations

import pytest
import torch

import phaselens
from phaselens.core.heads import Head, parse_heads
from phaselens.errors import HeadSpecError
from tests.support.models import LAYOUTS, task_model, tiny_task


@pytest.fixture(scope="module")
def model():
    return task_model(LAYOUTS["w8s4-deepseek"])


def test_head_specs_expand_and_errors(model):
    cfg = model.cfg  # 2 layers, 4 heads, 2 KV heads
    assert parse_heads("L1H3", cfg) == (Head(1, 3),)
    assert parse_heads((0, 2), cfg) == (Head(0, 2),)
    assert parse_heads("L1", cfg) == tuple(Head(1, h) for h in range(4))
    assert parse_heads("L0KV1", cfg) == (Head(0, 2), Head(0, 3))
    assert parse_heads(["L0H1", (0, 1), "L1KV0"], cfg) == (Head(0, 1), Head(1, 0), Head(1, 1))
    for bad, match in [("L2H0", "layers are 0..1"), ("L0H4", "heads are 0..3"), ("L0KV2", "KV heads are 0..1"),
                       ("head3", "not a head spec"), ((0, 9), "heads are 0..3"), ([], "empty")]:
        with pytest.raises(HeadSpecError, match=match):
            parse_heads(bad, cfg)


def test_zero_knockout_equals_manual_hook(model):
    tokens = tiny_task().build(model.analysis_spec, n_per_residue=2).tokens

    def manual(z, hook):
        z = z.clone()
        z[:, -1, 1] = 0
        z[:, -1, 2] = 0
        return z

    ref = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", manual)])
    with phaselens.analyses.knocked_out(model, ["L1H1", "L1H2"], method="zero"):
        out = model(tokens)
    assert torch.equal(out, ref)
    assert not torch.allclose(out, model(tokens))


def test_mean_knockout_uses_disjoint_calibration_mean(model):
    task = tiny_task()
    cal = task.build(model.analysis_spec, n_per_residue=4, seed=99)
    batch = task.build(model.analysis_spec, n_per_residue=2, seed=0)
    _, cache = model.run_with_cache(cal.tokens, names_filter="blocks.0.attn.hook_z")
    mean = cache["blocks.0.attn.hook_z"][torch.arange(len(cal)), cal.query_pos, 3].mean(0)

    def manual(z, hook):
        z = z.clone()
        z[:, -1, 3] = mean
        return z

    ref = model.run_with_hooks(batch.tokens, fwd_hooks=[("blocks.0.attn.hook_z", manual)])
    with phaselens.analyses.knocked_out(model, "L0H3", method="mean", calibration=cal):
        out = model(batch.tokens)
    assert torch.allclose(out, ref, atol=1e-6)


def test_per_row_positions(model):
    tokens = torch.randint(0, 100, (3, 20))
    pos = torch.tensor([5, 10, 19])
    with phaselens.analyses.knocked_out(model, "L0H0", method="zero", positions=pos):
        out = model(tokens)
    base = model(tokens)
    for b, p in enumerate(pos.tolist()):
        assert torch.allclose(out[b, :p], base[b, :p], atol=1e-6)
        assert not torch.allclose(out[b, p], base[b, p])


def _all_hooks(model) -> int:
    n = sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values())
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(getattr(m, "_backward_pre_hooks", {}))
    return n


@pytest.mark.parametrize("where", ["hook", "with-block", "keyboard-interrupt", "metric"])
def test_no_hooks_leak_after_errors(model, where):
    tokens = torch.randint(0, 100, (2, 20))
    before = _all_hooks(model)
    exc = {"keyboard-interrupt": KeyboardInterrupt, "hook": phaselens.errors.InputError}.get(where, RuntimeError)
    with pytest.raises(exc):
        with phaselens.analyses.knocked_out(model, "L0H0", method="zero", positions="all" if where != "hook" else torch.tensor([999, 999])):
            if where == "hook":
                model(tokens)  # the hook raises on the bad positions value
            model(tokens)
            if where == "metric":
                raise RuntimeError("metric failed")
            raise exc("user code failed")
    assert _all_hooks(model) == before == 0
    assert torch.allclose(model(tokens), model(tokens))


def test_nnsight_zeroing_matches_knockout_zero(model):
    from nnsight import NNsight

    tokens = torch.randint(0, 100, (2, 20))
    with phaselens.analyses.knocked_out(model, "L1H2", method="zero"):
        expected = model(tokens)
    wrapped = NNsight(model)
    with wrapped.trace(tokens):
        z = wrapped.blocks[1].attn.hook_z.output
        z[:, -1, 2] = 0
        out = wrapped.output.save()
    assert torch.allclose(out, expected, atol=1e-6)
    assert _all_hooks(model) == 0
