"""Needle with a small BPE trained in-test (no downloads): positions, padding checks, twins, right padding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import PaddingError, ResidueError, TaskError
from phaselens.tasks import Needle, TaskBatch, task_from_dict, train_toy_tokenizer

SPEC = PhaseSpec(4, 8)


@pytest.fixture(scope="module")
def tok():
    return train_toy_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def check_item(tok, task: Needle, batch: TaskBatch, i: int) -> None:
    """Recompute the target from the ids: find the query key in the haystack and read what follows."""
    row = batch.tokens[i, : int(batch.lengths[i])].tolist()
    rec = batch.frame.iloc[i]
    # The tokenizer, run on the decoded text, reproduces the ids slot for slot (BOS included).
    assert tok.encode(tok.decode(row, skip_special_tokens=True)).ids == row
    key_id = ids(tok, " " + rec.key)
    assert len(key_id) == 1
    q = int(batch.query_pos[i])
    assert row[q - 1] == key_id[0] and row[q] == ids(tok, ":")[0]
    hits = [p for p in range(q - 1) if row[p] == key_id[0]]
    assert len(hits) == 1  # the target key is in the haystack once and in no demo
    tk = hits[0]
    assert (rec.t_K, rec.t_V) == (tk, tk + 2)  # " key" ":" " value"
    assert row[tk + 2] == batch.answer[i] == ids(tok, " " + rec.value)[0]
    u = tk - batch.spec.origin
    assert rec.residue == u % batch.modulus and rec.phase == u % batch.spec.stride
    st, w = batch.spec.stride, batch.spec.window
    assert rec.boundary == (u % st == st - 1)

    def entries(x: int) -> tuple[int, ...]:  # entries j whose window [jS + S - W, jS + S - 1] holds x
        return tuple(j for j in range(x // st + w // st + 2) if j * st + st - w <= x <= j * st + st - 1)

    assert rec.key_entries == entries(u) and rec.value_entries == entries(u + 2)
    assert rec.shared_entry == bool(set(entries(u)) & set(entries(u + 2)))
    # Twin: the target's value replaced by the neighbouring record's value.
    twin = batch.corrupted[i, : int(batch.lengths[i])].tolist()
    assert [p for p in range(len(row)) if row[p] != twin[p]] == [tk + 2]
    assert twin[tk + 2] == batch.wrong[i] != batch.answer[i]
    assert row.count(int(batch.wrong[i])) == 1  # wrong = another record's value, not in any demo


@pytest.mark.parametrize("padding", ["prefix", "in_sequence", "shared_prefix"])
@pytest.mark.parametrize("paired", [False, True])
def test_positions_match_tokenizer(tok, padding: str, paired: bool) -> None:
    task = Needle(
        tok, n_records=12, n_demos=2, block_filler=3, min_distance=20, padding=padding, paired=paired
    )
    batch = task.build(SPEC, n_per_residue=3, seed=4)
    assert len(batch) == 24 and (batch.frame.groupby("residue").size() == 3).all()
    assert (batch.query_pos == batch.query_pos[0]).all() and batch.seq_len == task.seq_len(SPEC)
    assert int((batch.frame.query_pos - batch.frame.t_V).min()) >= 20
    for i in range(len(batch)):
        check_item(tok, task, batch, i)
    if paired:
        unit = ids(tok, " .")[0]
        for _, grp in batch.frame.groupby("item_id"):
            content = [[x for x in batch.tokens[i].tolist() if x != unit] for i in grp.index]
            assert all(c == content[0] for c in content) and grp.residue.nunique() == 8


def test_prefix_ids_count_as_slots(tok) -> None:
    prefix = (tok.token_to_id("<bos>"), *ids(tok, "x == y"))
    task = Needle(tok, n_records=6, n_demos=1, prefix_ids=prefix)
    spec = PhaseSpec(4, origin=2)
    batch = task.build(spec, n_per_residue=2, seed=1)
    assert batch.tokens[:, : len(prefix)].tolist() == [list(prefix)] * len(batch)
    for i in range(len(batch)):
        row = batch.tokens[i].tolist()
        rec = batch.frame.iloc[i]
        assert row[rec.t_K] == ids(tok, " " + rec.key)[0]
        assert rec.residue == (rec.t_K - 2) % 8  # counted from the origin, in full-sequence slots


def test_merging_unit_raises_padding_error(tok) -> None:
    assert len(ids(tok, "==")) == 1  # precondition: "==" is a learned merge
    with pytest.raises(PaddingError, match=r"'='.*inner seam"):
        Needle(tok, n_records=4, n_demos=0, pad_unit="=").build(SPEC, n_per_residue=1)


def test_seam_merge_names_the_seam() -> None:
    tok = train_toy_tokenizer(["a.:b c.:d e.:f"] * 200)
    assert len(ids(tok, ".:")) == 1 and len(ids(tok, ":::")) == 3  # merges with '.', not with itself
    task = Needle(tok, n_records=4, n_demos=0, pad_unit=":")
    with pytest.raises(PaddingError, match=r"':'.*left seam \(text '.*\.' \| unit ':'\)"):
        task.build(SPEC, n_per_residue=1)


def test_non_merging_units_pass(tok) -> None:
    for unit in (" .", " =", " x"):
        batch = Needle(tok, n_records=4, n_demos=1, pad_unit=unit).build(SPEC, n_per_residue=1)
        assert len(batch) == 8


def test_multi_token_unit_rejected(tok) -> None:
    with pytest.raises(PaddingError, match="exactly one"):
        Needle(tok, n_records=4, pad_unit=" qqqz").build(SPEC, n_per_residue=1)


def test_right_padding_never_left(tok) -> None:
    short = Needle(tok, n_records=4, n_demos=1).build(SPEC, n_per_residue=1, seed=0)
    long = Needle(tok, n_records=9, n_demos=1).build(SPEC, n_per_residue=1, seed=0)
    both = TaskBatch.concat([short, long])
    n = len(short)
    assert both.seq_len == long.seq_len > short.seq_len
    assert torch.equal(both.tokens[:n, : short.seq_len], short.tokens)  # positions unchanged
    assert bool((both.tokens[:n, short.seq_len :] == both.pad_id).all())
    assert both.pad_id == tok.token_to_id("<pad>")
    assert torch.equal(both.lengths[:n], short.lengths) and torch.equal(both.query_pos[:n], short.query_pos)
    sub = both[:n]  # selecting the short items trims the padding again
    assert sub.seq_len == short.seq_len


def test_transformers_tokenizer_gives_the_same_items(tok) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    a = Needle(tok, n_records=6).build(SPEC, n_per_residue=2, seed=3)
    b = Needle(fast, n_records=6).build(SPEC, n_per_residue=2, seed=3)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.answer, b.answer)


def test_json_round_trip(tok) -> None:
    task = Needle(
        tok,
        n_records=5,
        keys=("cat", "dog", "cow", "pig", "fox", "owl"),
        target_records=(1, 3),
        prefix_ids=(1,),
        padding="in_sequence",
        modulus=8,
    )
    d = json.loads(json.dumps(task.to_dict()))
    assert d["kind"] == "needle" and "tokenizer" not in d
    back = task_from_dict(d, tokenizer=tok)
    assert back == task and back.to_dict() == task.to_dict()
    assert torch.equal(back.build(SPEC, n_per_residue=1).tokens, task.build(SPEC, n_per_residue=1).tokens)


def test_bad_inputs(tok) -> None:
    with pytest.raises(ResidueError):
        Needle(tok, n_records=4, modulus=8).build(PhaseSpec(3), n_per_residue=1)
    with pytest.raises(ResidueError):
        Needle(tok, n_records=4).build(SPEC, n_per_residue=1, residues=[8])
    with pytest.raises(TaskError):
        Needle(tok, n_records=4).build(SPEC, n_per_residue=0)
    with pytest.raises(TaskError, match="same number of tokens"):
        Needle(tok, n_records=2, n_demos=0, keys=("cat", "dog", "qzxv")).build(SPEC, n_per_residue=1)
    with pytest.raises(TaskError):
        Needle(tok, record_template="{value} {key}")
    with pytest.raises(TaskError, match="pass spec"):
        Needle(tok).seq_len()


def test_moments_match(tok) -> None:
    task = Needle(tok, n_records=6, n_demos=1, padding="in_sequence")
    design = task.design(SPEC)
    batch = task.build(SPEC, n_per_residue=400, seed=9)
    means = batch.frame.groupby("residue").t_K.mean().to_numpy()
    assert np.all(np.abs(means - float(design.mean)) < 4.5 * np.sqrt(float(design.variance) / 400))
    assert {round(float(np.dot(*design.pmf(r)[::-1])), 9) for r in range(8)} == {float(design.mean)}


def test_pad_site_check_compares_n_and_n_plus_one() -> None:
    # With zero units at a site nothing merges yet; adding one unit must still shift later ids by exactly one.
    from phaselens.tasks.text import Piece, check_pad_site, piece

    tok = train_toy_tokenizer(["a.:b c.:d e.:f"] * 200)
    pieces = [piece(tok, "end."), piece(tok, " cat")]
    good = Piece(" =", tuple(ids(tok, " =")), unit=True)
    check_pad_site(tok, pieces, 1, good, what="test")
    bad = Piece(":", tuple(ids(tok, ":")), unit=True)
    with pytest.raises(PaddingError, match=r"one more unit.*left seam \(text 'end\.' \| unit ':'\)"):
        check_pad_site(tok, pieces, 1, bad, what="test")
