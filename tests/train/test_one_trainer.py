"""One trainer for the zoo and the family: the zoo's ``train`` is the family's loop at world size 1.

The loss curves below were taken with the zoo's own loop before the two were merged (main 0359975; the merged
loop reproduced them bit for bit there, and its weights' digests). Weights digests are not portable: fp32 kernels
sum in another order on another CPU (``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512`` on one machine
give three digests), so here:

* the loss curve equals the pinned one to a relative ``RTOL`` = 1e-4 (the three capabilities agree to 2e-7;
  a change of the loop or the objective moves a loss by far more);
* two runs in this process are bit-identical (the trainer is deterministic on any one machine).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from phaselens.models import CompressedTransformer
from phaselens.train.loop import TrainSettings, train
from phaselens.train.zoo_recipes import get_recipe
from tests.train.test_loop import CFG, batch_fn

RTOL = 1e-4
SMALL = TrainSettings(steps=12, batch_size=8, lr=3e-3, warmup=3, checkpoint_every=5, threads=1)
SMALL_LOSSES = [4.874063, 4.857233, 4.842621, 4.776114, 4.784236, 4.676354, 4.727118, 4.560613, 4.563985, 4.53694,
                4.612322, 4.481677]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_a_small_run_follows_the_pinned_curve_and_repeats_bit_for_bit(tmp_path):
    first = train(CFG, batch_fn, SMALL, tmp_path / "a", progress=False)
    np.testing.assert_allclose(first.losses, SMALL_LOSSES, rtol=RTOL, atol=0)
    second = train(CFG, batch_fn, SMALL, tmp_path / "b", progress=False)
    assert second.losses == first.losses
    assert_same_weights(first.model, second.model)


@pytest.mark.parametrize(("name", "losses"), [
    ("w4s4", [4.861827, 4.855542, 4.849136, 4.840685]),
    ("full", [4.865651, 4.858099, 4.864772, 4.864487]),
])
def test_zoo_recipes_follow_the_curves_of_the_loop_before_the_merge(tmp_path, name, losses):
    recipe = get_recipe(name)
    settings = dataclasses.replace(recipe.settings, steps=4, checkpoint_every=2, threads=1)
    res = train(recipe.config, recipe.batch_fn(), settings, tmp_path, progress=False)
    np.testing.assert_allclose(res.losses, losses, rtol=RTOL, atol=0)


def _freeze_query(model):
    with torch.no_grad():
        model.blocks[0].attn.W_Q.mul_(0.5)  # through TransformerLens's view: reaches the parameter
    model.blocks[0].attn.flat("W_Q").requires_grad_(False)


def test_a_run_with_frozen_planted_weights_keeps_them_and_repeats_bit_for_bit(tmp_path):
    settings = TrainSettings(steps=6, batch_size=8, warmup=2, checkpoint_every=3, threads=1)
    first = train(CFG, batch_fn, settings, tmp_path / "a", progress=False, init_fn=_freeze_query)
    second = train(CFG, batch_fn, settings, tmp_path / "b", progress=False, init_fn=_freeze_query)
    assert_same_weights(first.model, second.model)
    planted = CompressedTransformer(CFG)
    _freeze_query(planted)
    assert torch.equal(first.model.blocks[0].attn.W_Q, planted.blocks[0].attn.W_Q)  # frozen: never updated
    assert not torch.equal(first.model.blocks[0].attn.W_K, planted.blocks[0].attn.W_K)  # the rest trained
    free = train(CFG, batch_fn, settings, tmp_path / "c", progress=False)
    assert not torch.equal(free.model.blocks[0].attn.W_Q, planted.blocks[0].attn.W_Q)
