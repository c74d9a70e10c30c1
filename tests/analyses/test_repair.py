"""Phase repair: shifted copies, combining rules, the wrapper's protocol, errors, and the zoo measurements."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phaselens
from phaselens.errors import ContextLengthError, PaddingError, PhaseLensError
from phaselens.repair.shifts import combine, resolve_shifts, shifted_copies
from tests.support.models import LAYOUTS, task_model


def test_shifted_copies_insert_pads_after_bos_and_align_back():
    tokens = torch.tensor([[1, 10, 11, 12], [1, 20, 21, 22]])
    out = shifted_copies(tokens, (0, 2), pad_id=0)
    assert out.tolist() == [[1, 10, 11, 12, 0, 0], [1, 20, 21, 22, 0, 0], [1, 0, 0, 10, 11, 12], [1, 0, 0, 20, 21, 22]]
    from phaselens.repair.shifts import align

    logits = out.float()[..., None].expand(-1, -1, 3)  # logits that echo the token id
    aligned = align(logits, (0, 2), B=2, rows=torch.arange(4))
    assert torch.equal(aligned[1, :, :, 0].long(), tokens)  # copy 2 read back at the original positions
    last = align(logits[:, 3:], (0, 2), B=2, rows=torch.arange(3, 4), first=3)  # only the inner rows 3.. given
    assert torch.equal(last[:, :, 0, 0].long(), tokens[:, 3].expand(2, -1))


def test_resolve_shifts_and_errors():
    assert resolve_shifts("all", 4) == (0, 1, 2, 3) and resolve_shifts("opposite", 4) == (0, 2)
    assert resolve_shifts([2, 0, 2], 4) == (0, 2)
    with pytest.raises(PhaseLensError, match="0..3"):
        resolve_shifts([4], 4)
    with pytest.raises(PhaseLensError, match="must be 'all'"):
        resolve_shifts(3, 4)


def test_combining_rules():
    # copy 0: confident in token 0; copy 1: unsure, leaning to token 1; copy 2: leaning to token 1
    per = torch.tensor([[[5.0, 0.0, 0.0]], [[0.0, 0.5, 0.0]], [[0.0, 0.4, 0.0]]])
    out, chosen = combine(per, "max_conf")
    assert int(chosen) == 0 and int(out.argmax()) == 0
    assert int(combine(per, "vote")[0].argmax()) == 1  # two of three copies vote for token 1
    for rule in ("mean_logprob", "mean_prob"):
        lp = combine(per, rule)[0]
        assert torch.allclose(lp.exp().sum(-1), torch.ones(1), atol=1e-5)
    with pytest.raises(PhaseLensError, match="combine must be"):
        combine(per, "median")


def test_single_unshifted_copy_is_the_model_itself():
    model = task_model(LAYOUTS["w4s4-scalar"])
    fixed = phaselens.phase_ensemble(model, shifts=[0])
    tokens = model.default_task.build(model.analysis_spec, n_per_residue=1).tokens[:3]
    with torch.no_grad():
        assert torch.allclose(fixed(tokens), model(tokens).log_softmax(-1), atol=1e-5)
    assert fixed.cost == 1 and "PhaseEnsemble" in repr(fixed)


def test_wrapper_satisfies_the_protocol_and_records_cost():
    """The wrapper passes the protocol's members through (not just has them), hooks see every copy's rows,
    and analyses record the cost."""
    model = task_model(LAYOUTS["w4s4-scalar"])
    fixed = phaselens.phase_ensemble(model, shifts="opposite", combine="vote")
    assert fixed.cfg is model.cfg and fixed.phase_specs == model.phase_specs
    assert fixed.analysis_spec == model.analysis_spec and fixed.default_task is model.default_task
    assert fixed.hook_dict is model.hook_dict and fixed.cost == 2 and list(fixed.shifts) == [0, 2]
    tokens = model.default_task.build(model.analysis_spec, n_per_residue=1).tokens[:3]
    seen = []
    out = fixed.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", lambda z, hook: seen.append(z.shape[0]))])
    assert seen == [2 * 3]  # one call over both copies of the 3 rows
    with torch.no_grad():
        assert torch.equal(out, fixed(tokens)) and all(not h._forward_hooks for h in model.hook_dict.values())
    assert fixed.last_choice.shape == tokens.shape and set(fixed.last_choice.unique().tolist()) <= {0, 1}
    ev = phaselens.evaluate(fixed, n_per_residue=2, progress=False, n_permutations=9, n_bootstrap=0)
    assert ev.metadata["repair"]["forward_multiple"] == 2 and ev.metadata["repair"]["combine"] == "vote"
    res = phaselens.ablate(fixed, "L1H0", phase=0, n_per_residue=2, method="zero", progress=False)
    assert res.per_residue()["residue"].tolist() == [0, 4] and res.metadata["repair"]["forward_multiple"] == 2


def test_context_overflow_and_pad_errors():
    model = task_model(LAYOUTS["w4s4-scalar"], n_ctx=62)
    fixed = phaselens.phase_ensemble(model, shifts="all")
    with pytest.raises(ContextLengthError, match="at most 59 tokens"):
        fixed(torch.ones(1, 61, dtype=torch.long))

    class TwoTokens:
        def encode(self, text, add_special_tokens=False):
            return [5, 6]

    with pytest.raises(PaddingError, match="not one"):
        phaselens.phase_ensemble(model, pad_unit=" ==", tokenizer=TwoTokens())


def test_shift_moves_the_phase_on_the_zoo():
    """Copy k of an item whose key is at phase p reads the key at phase (p + k) mod S. The query moves too
    (from phase 2 to (2 + k) mod 4 on this task), so the copies' per-phase accuracy should match the
    unshifted model's at (p + k) mod S only up to that change; we check agreement within 10 points."""
    model = phaselens.load("zoo:w4s4")
    table = phaselens.repair_table(model, n_per_residue=40, seed=11, progress=False, shift_sets=((1,), (2,), (3,)),
                                   combines=("max_conf",), n_permutations=99, n_bootstrap=0, batch_size=256)
    base = table.base.per_phase()["acc"].to_numpy()
    assert int(model.default_task.build(model.analysis_spec, n_per_residue=1).frame["query_phase"].iloc[0]) == 2
    for k in (1, 2, 3):
        shifted = table.evals[(str(k), "max_conf")].per_phase()["acc"].to_numpy()
        predicted = base[(np.arange(4) + k) % 4]
        assert np.abs(shifted - predicted).max() < 0.12, (k, shifted, predicted)
        assert np.corrcoef(shifted, predicted)[0, 1] > 0.9


@pytest.mark.parametrize("name", ["w4s4", "full"])
def test_repair_on_the_zoo_fast(name):
    model = phaselens.load(f"zoo:{name}")
    table = phaselens.repair_table(model, n_per_residue=32, seed=5, progress=False, shift_sets=("all",),
                                   combines=("max_conf",), stride=4 if name == "full" else None, batch_size=256,
                                   n_permutations=499, n_bootstrap=200)
    base, rep = table.rows.iloc[0], table.rows.iloc[1]
    if name == "full":
        assert abs(rep["mean"] - base["mean"]) < 0.015
    else:
        assert rep["gap"] < base["gap"] / 3 and rep["worst"] > base["worst"] + 0.2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4s4", "w8s4", "w4s4-mean", "w4s4-norope", "w4s4-seed1"])
def test_repair_removes_phase_dependence_at_1000_items(name):
    model = phaselens.load(f"zoo:{name}")
    table = phaselens.repair_table(model, n_per_residue=1000, seed=3, progress=False, shift_sets=("all",),
                                   combines=("max_conf",), batch_size=256)
    base, rep = table.rows.iloc[0], table.rows.iloc[1]
    assert rep["p_chi2"] > 0.01 and rep["gap_ci_high"] < base["gap"] / 3


def test_knockout_through_the_wrapper_hits_each_copys_query():
    model = task_model(LAYOUTS["w4s4-scalar"])
    fixed = phaselens.phase_ensemble(model, shifts=(0, 2), combine="mean_logprob")
    tokens = model.default_task.build(model.analysis_spec, n_per_residue=1).tokens[:3]
    T = tokens.shape[1]
    with phaselens.analyses.knocked_out(fixed, "L1H1", method="zero"):
        got = fixed(tokens)

    def manual(z, hook):
        z = z.clone()
        z[:3, T - 1, 1] = 0  # copy 0: the query at its original slot
        z[3:, T + 1, 1] = 0  # copy 2: two pads later
        return z

    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_z", manual)]):
        want = fixed(tokens)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got[:, -1], fixed(tokens)[:, -1])
    assert not hasattr(model.hook_dict["blocks.1.attn.hook_z"], "row_shift")  # cleaned up
