"""PaddingProbe: the L sweep, phases, right padding, the FP8 example and its errors (in-test BPE)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import PaddingError, ResidueError, TaskError
from phaselens.tasks import PaddingProbe, task_from_dict, train_toy_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_toy_tokenizer()


@pytest.mark.parametrize("spec", [PhaseSpec(4), PhaseSpec(4, 8, origin=3), PhaseSpec(6)], ids=str)
def test_fp8_sweep_covers_two_periods_and_phases_cycle(tok, spec: PhaseSpec) -> None:
    probe = PaddingProbe.fp8_example(tok)
    batch = probe.build(spec, n_per_residue=1)
    f = batch.frame
    s, m = spec.stride, batch.modulus
    assert m == 2 * s and len(batch) == m
    lengths = f.L.to_numpy()
    assert np.array_equal(lengths, np.arange(lengths[0], lengths[0] + m))  # consecutive lengths
    assert np.array_equal(lengths, probe.length(0) + f.n_units.to_numpy())
    assert f.n_units.min() == probe.min_units
    assert np.array_equal(f.phase, (lengths - 1 - spec.origin) % s)  # phase of the cursor
    assert np.array_equal(f.residue, (lengths - 1 - spec.origin) % m)
    assert (np.bincount(f.phase, minlength=s) == 2).all()  # each phase twice: two full periods
    assert np.array_equal(batch.query_pos.numpy(), lengths - 1)
    assert np.array_equal(batch.lengths.numpy(), lengths)
    assert f.t_K.isna().all()


def test_items_are_the_tokenized_prompt_right_padded(tok) -> None:
    probe = PaddingProbe.fp8_example(tok)
    batch = probe.build(PhaseSpec(4), n_per_residue=2)
    head, rest = probe.prompt.split("<|pad|>")
    for i, n in enumerate(batch.frame.n_units):
        text = head + " =" * n + rest.split("<|cursor|>")[0]
        assert text.endswith("torch.float")
        want = tok.encode(text).ids  # BOS included
        ln = int(batch.lengths[i])
        assert batch.tokens[i, :ln].tolist() == want
        assert (batch.tokens[i, ln:] == batch.pad_id).all()  # right padding only
    assert tok.id_to_token(int(batch.answer[0])) == "8"
    assert tok.id_to_token(int(batch.wrong[0])) == "32"
    # item_id is the period index: each period is one paired item across all residues
    assert (batch.frame.groupby("item_id").residue.nunique() == 8).all()


def test_short_sweeps_are_rejected(tok) -> None:
    probe = PaddingProbe.fp8_example(tok)
    with pytest.raises(TaskError, match="two full periods"):
        probe.build(PhaseSpec(4), n_per_residue=1, residues=[0, 1, 2, 3, 4, 5])
    short = PaddingProbe.fp8_example(tok, modulus=4)
    with pytest.raises(TaskError, match="two full periods"):
        short.build(PhaseSpec(4), n_per_residue=1)
    assert len(short.build(PhaseSpec(4), n_per_residue=2)) == 8
    with pytest.raises(TaskError, match="raise max_units"):
        PaddingProbe.fp8_example(tok, max_units=6).build(PhaseSpec(4), n_per_residue=1)
    with pytest.raises(TaskError):
        probe.build(PhaseSpec(4), n_per_residue=0)
    with pytest.raises(ResidueError):
        probe.build(PhaseSpec(4), n_per_residue=1, residues=[8])
    with pytest.raises(ResidueError):
        PaddingProbe.fp8_example(tok, modulus=6).build(PhaseSpec(4), n_per_residue=1)


def test_merging_unit_is_named(tok) -> None:
    with pytest.raises(PaddingError, match=r"'='.*inner seam"):
        PaddingProbe.fp8_example(tok, unit="=").build(PhaseSpec(4), n_per_residue=1)
    # A unit that is one token on its own but merges with the text before the pad line.
    merging = train_toy_tokenizer(["a.:b c.:d e.:f"] * 200)
    assert len(merging.encode(".:", add_special_tokens=False).ids) == 1
    probe = PaddingProbe(
        merging, prompt="end.<|pad|> y = torch.float<|cursor|>", correct="8", wrong="32", unit=":"
    )
    with pytest.raises(PaddingError, match=r"':'.*left seam \(text 'end\.' \| unit ':'\)"):
        probe.build(PhaseSpec(4), n_per_residue=1)


def test_custom_prompt_and_markers(tok) -> None:
    probe = PaddingProbe(
        tok,
        prompt="x = 1 #<|pad|>\ny = torch.float<|cursor|>",
        correct="8",
        wrong="32",
        min_units=0,
        max_units=20,
    )
    batch = probe.build(PhaseSpec(2), n_per_residue=3)
    assert len(batch) == 12 and batch.frame.n_units.tolist() == list(range(12))
    with pytest.raises(TaskError, match="exactly once"):
        PaddingProbe(tok, prompt="no markers", correct="8", wrong="32")
    with pytest.raises(TaskError):
        PaddingProbe(tok, prompt="<|pad|><|cursor|>", correct="8", wrong="8")


def test_json_round_trip(tok) -> None:
    probe = PaddingProbe.fp8_example(tok, prefix_ids=(1, 30), modulus=8)
    d = json.loads(json.dumps(probe.to_dict()))
    assert d["kind"] == "padding_probe" and d["prefix_ids"] == [1, 30]
    back = task_from_dict(d, tokenizer=tok)
    assert back == probe
    assert (
        back.build(PhaseSpec(4), n_per_residue=1).tokens.tolist()
        == probe.build(PhaseSpec(4), n_per_residue=1).tokens.tolist()
    )
    assert probe.seq_len() == probe.length(probe.max_units)
