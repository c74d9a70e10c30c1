"""``phaselens.knockout``: the evaluation of a model with heads knocked out (issue 45, item 6).

Its accuracy per phase is ``ablate``'s knocked-out accuracy on the same items, and ``evaluate`` run inside the
``knocked_out`` context manager gives the same items' answers; bad heads get ablate's error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phaselens
from phaselens.analyses import knocked_out
from phaselens.errors import HeadSpecError, InputError

KW = dict(n_per_residue=3, seed=3, progress=False)


@pytest.fixture(scope="module")
def model():
    return phaselens.load("zoo:w8s4")


@pytest.mark.parametrize(("heads", "method"), [("L0H3", "zero"), ("L0H3", "mean"), (["L0H1", "L1H2"], "mean"),
                                               ("L1", "resample")])
def test_knockout_is_ablates_knocked_out_run(model, heads, method):
    ev = phaselens.knockout(model, heads, method=method, n_permutations=1, n_bootstrap=0, **KW)
    ab = phaselens.ablate(model, heads, method=method, engine="full", n_bootstrap=0, **KW)
    assert isinstance(ev, phaselens.PhaseEval)
    assert ev.items["residue"].tolist() == ab.items["residue"].tolist()  # the same items, in order
    assert ev.items["correct"].tolist() == ab.items["correct_ko"].tolist()
    np.testing.assert_allclose(ev.items["logit_diff"], ab.items["logit_diff_ko"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ev.per_phase()["acc"], ab.per_phase()["ko_acc"])
    # the knockout moves the answers, so the comparison can fail
    assert np.abs(ab.items["logit_diff_ko"] - ab.items["logit_diff"]).max() > 0.1


@pytest.mark.parametrize("method", ["zero", "mean"])
def test_knockout_is_evaluate_inside_knocked_out(model, method):
    opts = dict(n_permutations=99, n_bootstrap=50, **KW)
    ev = phaselens.knockout(model, "L0H3", method=method, **opts)
    with knocked_out(model, "L0H3", method=method):
        inside = phaselens.evaluate(model, **opts)
    clean = phaselens.evaluate(model, **opts)
    assert ev.items["correct"].tolist() == inside.items["correct"].tolist()
    np.testing.assert_allclose(ev.items["logit_diff"], inside.items["logit_diff"], rtol=0, atol=1e-5)
    # the full statistics: per-phase CIs, worst and boundary phase, the phase-sensitivity battery
    np.testing.assert_allclose(ev.per_phase()[["acc", "ci_low", "ci_high"]], inside.per_phase()[["acc", "ci_low",
                                                                                                  "ci_high"]])
    assert (ev.worst, ev.boundary) == (inside.worst, inside.boundary)
    assert ev.gap == pytest.approx(inside.gap) and ev.gap_ci == pytest.approx(inside.gap_ci)
    assert ev.items["correct"].tolist() != clean.items["correct"].tolist()


def test_metadata_names_the_knockout(model):
    ev = phaselens.knockout(model, ["L0KV1"], method="mean", n_permutations=1, n_bootstrap=0, **KW)
    assert ev.metadata["knocked_out"] == ["L0H1"]  # the KV head's query heads (no sharing in w8s4)
    assert ev.metadata["method"] == "mean" and "task items" in ev.metadata["calibration"]
    assert ev.metadata["arguments"]["heads"] == ["L0KV1"] and ev.metadata["arguments"]["positions"] == "last"
    assert phaselens.knockout(model, "L0H0", method="zero", n_permutations=1, n_bootstrap=0,
                              **KW).metadata["calibration"] is None


@pytest.mark.parametrize("bad", ["L9H0", "L0H9", "head3", []])
def test_bad_heads_get_ablates_error_before_any_item(model, bad, monkeypatch):
    import phaselens.analyses.items as items

    built = []
    monkeypatch.setattr(items, "check_ids", lambda m, b: built.append(b))  # an item built would call it
    with pytest.raises(HeadSpecError) as ko:
        phaselens.knockout(model, bad, **KW)
    with pytest.raises(HeadSpecError) as ab:
        phaselens.ablate(model, bad, **KW)
    assert str(ko.value) == str(ab.value) and built == []


def test_positions_are_checked(model):
    with pytest.raises(InputError, match="from 0"):
        phaselens.knockout(model, "L0H0", positions=-1, **KW)
    with pytest.raises(InputError, match="one slot per item"):
        phaselens.knockout(model, "L0H0", positions=torch.tensor([3, 4]), **KW)


def test_per_item_positions_are_each_items_slot(model):
    """A ``[N]`` tensor of each item's query slot is ``"last"`` (the query is each item's last token)."""
    batch = model.default_task.build(model.analysis_spec, n_per_residue=1, seed=3)
    kw = dict(method="zero", progress=False, n_permutations=1, n_bootstrap=0)
    last = phaselens.knockout(model, "L0H3", batch, **kw)
    slots = phaselens.knockout(model, "L0H3", batch, positions=batch.query_pos, **kw)
    assert last.items["correct"].tolist() == slots.items["correct"].tolist()
    first = phaselens.knockout(model, "L0H3", batch, positions=torch.zeros(len(batch), dtype=torch.long), **kw)
    assert not np.allclose(first.items["logit_diff"], last.items["logit_diff"])


def test_the_context_manager_lives_in_analyses():
    assert "Knockout" not in phaselens.__all__ and "knockout" in phaselens.__all__
    with pytest.raises(AttributeError, match=r"lives in phaselens\.analyses"):
        phaselens.Knockout  # noqa: B018
    with pytest.raises(AttributeError, match=r"lives in phaselens\.analyses"):
        phaselens.knocked_out  # noqa: B018
    assert phaselens.analyses.knocked_out is knocked_out and phaselens.analyses.Knockout.__name__ == "Knockout"
