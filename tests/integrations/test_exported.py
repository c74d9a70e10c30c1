"""phaselens' own tasks exported to lm-eval and run there by the ``phaselens`` model (issue 47, items 1, 3 and 4): on
zoo:w8s4, lm-eval's per-item answers are phaselens.evaluate's, and the battery read back from lm-eval's samples
is phaselens' own."""

from __future__ import annotations

import json

import numpy as np
import pytest

import phaselens
from phaselens.integrations.lm_eval import export_task, read_samples, register
from phaselens.tasks import Needle
from tests.support.lm_eval import evaluate

N, SEED = 2, 5
BATTERY = {"n_permutations": 400, "n_bootstrap": 200}  # the same resampling on both sides (smaller: a fast test)


@pytest.fixture(scope="module")
def zoo():
    return phaselens.load("zoo:w8s4")


def zoo_needle(model):
    """The needle in the zoo's own vocabulary: keys and values are its key and value ids as words (tN), the query
    marker t2, the padding a filler word; so the zoo reads it as it reads its training task."""
    kv = model.default_task
    return Needle(model.tokenizer, keys=tuple(f"t{i}" for i in kv.key_ids), values=tuple(f"t{i}" for i in kv.value_ids),
                  record_template=" {key} {value}", intro="", query_prefix=" t2", pad_unit=" t100", n_records=12,
                  n_demos=4, modulus=24, block_filler=40, min_distance=16, n_cycles=2)


def assert_same_battery(ours, theirs):
    """The read-back battery equals phaselens' own: counts and intervals exactly (they come from the same correct
    flags and seeds), the log-probability tests to rounding (a batch of another shape)."""
    assert ours.stride == theirs.stride and ours.modulus == theirs.modulus
    np.testing.assert_array_equal(ours.items["correct"].to_numpy(), theirs.items["correct"].to_numpy())
    np.testing.assert_array_equal(ours.items["residue"].to_numpy(), theirs.items["residue"].to_numpy())
    np.testing.assert_allclose(ours.items["nll"].to_numpy(), theirs.items["nll"].to_numpy(), atol=1e-4)
    np.testing.assert_allclose(ours.items["logit_diff"].to_numpy(), theirs.items["logit_diff"].to_numpy(), atol=1e-4)
    pr, tr = ours.per_residue(), theirs.per_residue()
    np.testing.assert_array_equal(pr[["residue", "n", "correct"]].to_numpy(), tr[["residue", "n", "correct"]].to_numpy())
    np.testing.assert_allclose(pr[["acc", "ci_low", "ci_high"]].to_numpy(float), tr[["acc", "ci_low", "ci_high"]]
                               .to_numpy(float), rtol=0, atol=1e-12)
    for name in ("gap", "worst", "best", "boundary", "worst_phase", "residue_gap", "worst_residue", "period"):
        assert getattr(ours, name) == getattr(theirs, name), name
    np.testing.assert_allclose(ours.gap_ci, theirs.gap_ci, atol=1e-12)
    assert ours.tests.counts.gap_test.pvalue == theirs.tests.counts.gap_test.pvalue
    assert ours.tests.omnibus.pvalue == pytest.approx(theirs.tests.omnibus.pvalue, abs=1e-12)


@pytest.mark.parametrize("which", ["kv_recall", "needle"])
def test_phaselens_model_answers_exported_items_as_evaluate_does(zoo, tmp_path, which):
    """lm-eval's ``phaselens`` model (found by name in lm-eval's registry) on zoo:w8s4 with the exported task gives
    the same per-item correct flags as phaselens.evaluate on the same items; both flavours (two-way multiple
    choice, one generated token) read back to phaselens' battery."""
    task = zoo.default_task if which == "kv_recall" else zoo_needle(zoo)
    ev = phaselens.evaluate(zoo, task, n_per_residue=N, seed=SEED, progress=False, **BATTERY)
    files = export_task(task, tmp_path, model=zoo, n_per_residue=N, seed=SEED)
    name = f"phaselens_{which}"
    assert [f.name for f in files] == [f"{name}.jsonl", f"{name}.yaml", f"{name}_gen.yaml"]
    register()
    out = evaluate("phaselens", [name, f"{name}_gen"], include=tmp_path, model_args={"model": "zoo:w8s4"},
                   batch_size=32)
    assert out["config"]["model"] == "phaselens"
    # the multiple-choice flavour's exact_match is phaselens' correct, item by item
    flags = np.array([s["exact_match"] for s in sorted(out["samples"][name], key=lambda s: s["doc_id"])], bool)
    np.testing.assert_array_equal(flags, ev.items["correct"].to_numpy())
    assert 0 < flags.mean() < 1  # the zoo misses some phases: a comparison that could fail
    back = read_samples(out, task=name, seed=SEED, **BATTERY)
    assert_same_battery(ev, back)
    gen = read_samples(out, task=f"{name}_gen", seed=SEED, **BATTERY)
    np.testing.assert_array_equal(gen.items["correct"].to_numpy(), ev.items["correct"].to_numpy())
    assert gen.gap == ev.gap and gen.worst_phase == ev.worst_phase and np.isnan(gen.items["nll"]).all()
    assert "accuracy alone" in gen.summary()


def test_every_exported_prompt_is_the_items_ids(zoo, tmp_path):
    """Each exported document's text encodes (BOS first) to the item's ids up to its query, and the two choices
    add exactly the answer and the distractor token; the record holds the item's residue and slot."""
    batch = zoo.default_task.build(zoo.dims.analysis_spec, n_per_residue=1, seed=1)
    (data, *_) = export_task(batch, tmp_path, tokenizer="zoo:w8s4")
    tok = zoo.tokenizer
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == len(batch) == 24
    for i, row in enumerate(rows):
        ids = batch.tokens[i, : int(batch.query_pos[i]) + 1].tolist()
        assert tok(row["context"])["input_ids"] == ids
        for choice, token in zip(row["choices"], (batch.answer[i], batch.wrong[i])):
            assert tok(row["context"] + choice)["input_ids"] == ids + [int(token)]
        meta = row["phaselens"]
        assert (meta["residue"], meta["t_K"]) == (batch.frame["residue"][i], batch.frame["t_K"][i])
        assert meta["residue"] == (meta["t_K"] - meta["origin"]) % meta["modulus"]
        assert tok(row["target"], add_special_tokens=False)["input_ids"] == [int(batch.answer[i])]


def test_items_that_would_run_at_other_slots_are_refused(zoo, tmp_path):
    """Export refuses items a backend would not run as built: ids that do not come back from their text (the
    zoo's ids read by a byte-level BPE, which merges them) and items that do not start with the tokenizer's
    special prefix (the BOS moved away); nothing is written."""
    from dataclasses import replace

    from phaselens.errors import TaskError, TokenizerMismatchError
    from tests.support.lm_eval import bpe_tokenizer

    batch = zoo.default_task.build(zoo.dims.analysis_spec, n_per_residue=1, seed=0)
    with pytest.raises(TokenizerMismatchError, match=r"item 0: its prompt does not survive text .* at slot \d+"):
        export_task(batch, tmp_path, tokenizer=bpe_tokenizer())
    no_bos = replace(batch, tokens=batch.tokens.roll(-1, dims=1))
    with pytest.raises(TaskError, match=r"special prefix \[1\]"):
        export_task(no_bos, tmp_path, tokenizer="zoo:w8s4")
    assert not list(tmp_path.iterdir())
