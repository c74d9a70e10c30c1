"""One trainer for the zoo and the family: the zoo's ``train`` is the family's loop at world size 1.

The digests below were taken with the zoo's own loop before the two were merged (main 0359975); the merged
loop must reproduce them bit for bit (the zoo ships trained weights, and its cards record these runs)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from phaselens.train.loop import TrainSettings, train
from phaselens.train.recipes import get_recipe
from tests.train.test_loop import CFG, batch_fn


def digest(model) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def test_a_small_run_is_bit_identical_to_the_zoo_loop_before_the_merge(tmp_path):
    res = train(CFG, batch_fn, TrainSettings(steps=12, batch_size=8, lr=3e-3, warmup=3, checkpoint_every=5,
                                             threads=1), tmp_path, progress=False)
    assert digest(res.model) == "b8398a301434a9f2" and res.losses[-1] == 4.481677


@pytest.mark.parametrize(("name", "pinned", "losses"), [
    ("w4s4", "5278e824373ee8b7", [4.861827, 4.855542, 4.849136, 4.840685]),
    ("full", "1765cec561f966b8", [4.865651, 4.858099, 4.864772, 4.864487]),
])
def test_zoo_recipes_train_bit_identically_to_the_loop_before_the_merge(tmp_path, name, pinned, losses):
    recipe = get_recipe(name)
    settings = dataclasses.replace(recipe.settings, steps=4, checkpoint_every=2, threads=1)
    res = train(recipe.config, recipe.batch_fn(), settings, tmp_path, progress=False)
    assert digest(res.model) == pinned and res.losses == losses


def _freeze_query(model):
    with torch.no_grad():
        model.blocks[0].attn.W_Q.mul_(0.5)
    model.blocks[0].attn.W_Q.requires_grad_(False)


def test_a_run_with_frozen_planted_weights_is_bit_identical_too(tmp_path):
    res = train(CFG, batch_fn, TrainSettings(steps=6, batch_size=8, warmup=2, checkpoint_every=3, threads=1),
                tmp_path, progress=False, init_fn=_freeze_query)
    assert digest(res.model) == PLANTED


PLANTED = "2f842af8d3cb070a"
