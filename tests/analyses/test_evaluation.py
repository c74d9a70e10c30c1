"""phaselens.evaluate: per-item scoring, per-residue summaries, the battery, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phaselens
from phaselens.errors import ContextLengthError, NoDefaultTaskError, ResidueError, TaskError
from tests.support.models import task_model, tiny_task


@pytest.fixture(scope="module")
def model():
    return task_model()


def test_items_agree_with_a_manual_forward(model):
    ev = phaselens.evaluate(model, n_per_residue=6, progress=False, n_permutations=99, n_bootstrap=50)
    batch = tiny_task().build(model.analysis_spec, n_per_residue=6, seed=0)
    with torch.no_grad():
        logits = model(batch.tokens)[torch.arange(len(batch)), batch.query_pos]
    assert np.array_equal(ev.items["correct"].to_numpy(), (logits.argmax(-1) == batch.answer).numpy())
    lp = logits.log_softmax(-1)
    assert np.allclose(ev.items["nll"].to_numpy(), -lp[torch.arange(len(batch)), batch.answer].numpy(), atol=1e-5)
    ld = logits[torch.arange(len(batch)), batch.answer] - logits[torch.arange(len(batch)), batch.wrong]
    assert np.allclose(ev.items["logit_diff"].to_numpy(), ld.detach().numpy(), atol=1e-5)
    assert set(["item_id", "residue", "phase", "t_K", "p_correct", "p_wrong", "rank"]) <= set(ev.items.columns)


def test_per_residue_summary_and_headline(model):
    ev = phaselens.evaluate(model, n_per_residue=5, progress=False, n_permutations=99, n_bootstrap=50)
    pr = ev.per_residue()
    assert list(pr["residue"]) == list(range(8)) and (pr["n"] == 5).all()
    assert np.allclose(pr["acc"], pr["correct"] / 5)
    assert (pr["ci_low"] <= pr["acc"]).all() and (pr["acc"] <= pr["ci_high"]).all()
    ph = ev.per_phase()
    assert len(ph) == 4 and ph["boundary"].tolist() == [False, False, False, True]
    assert ev.boundary == pytest.approx(ph["acc"].iloc[3])
    assert ev.worst == pytest.approx(ph["acc"].min()) and ev.gap == pytest.approx(ph["acc"].max() - ph["acc"].min())
    assert "worst phase" in repr(ev) and ev.tests.counts.modulus == 8


def test_stride_override_folds_a_control_like_the_compressed_model():
    control = task_model(None)
    assert control.analysis_spec.stride == 1
    ev = phaselens.evaluate(control, n_per_residue=3, progress=False, stride=4, n_permutations=99, n_bootstrap=0)
    assert ev.stride == 4 and len(ev.per_phase()) == 4


def test_bad_input_errors(model):
    bare = task_model()
    bare.default_task = None
    with pytest.raises(NoDefaultTaskError, match="pass a task"):
        phaselens.evaluate(bare)
    with pytest.raises(TaskError, match="n_per_residue must be an integer >= 1"):
        phaselens.evaluate(model, n_per_residue=0)
    with pytest.raises(ResidueError):
        phaselens.evaluate(model, residues=[9], n_per_residue=1, progress=False)
    with pytest.raises(ContextLengthError, match="context"):
        phaselens.evaluate(task_model(n_ctx=40), n_per_residue=1, progress=False)
    with pytest.raises(ResidueError, match="multiple"):
        phaselens.evaluate(model, tiny_task(modulus=6), n_per_residue=1, progress=False)


def test_analyses_accept_a_task_whose_modulus_follows_the_stride():
    """Needle's modulus defaults to 2S (None): evaluate, mean-knockout ablate by phase, and patch all work."""
    from phaselens.tasks import Needle
    from phaselens.tasks.toy_tokenizer import train_toy_tokenizer
    from tests.support.models import LAYOUTS, make_model

    tok = train_toy_tokenizer()
    task = Needle(tok, n_records=6, n_demos=1)
    model = make_model(LAYOUTS["w4s4-scalar"], d_vocab=tok.get_vocab_size(), n_ctx=256)
    model.default_task = task
    ev = phaselens.evaluate(model, n_per_residue=2, progress=False, n_permutations=9, n_bootstrap=0)
    assert ev.modulus == 8
    res = phaselens.ablate(model, "L1H0", phase=1, n_per_residue=2, progress=False, n_bootstrap=0)
    assert sorted(res.per_residue()["residue"]) == [1, 5]
    assert phaselens.patch(model, heads="L0H0", phase=[0], n_per_residue=1).recovery.shape == (2, 4, 8)
