"""KVRecall: every frame column recomputed from the tokens, moment matching, pairing, twins and training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import ResidueError, TaskError
from phaselens.tasks import KVRecall, TaskBatch

SCHEMES = ["prefix", "in_sequence", "shared_prefix"]


def entries_brute(u: int, s: int, w: int) -> tuple[int, ...]:
    """Entries j whose window [jS + S - W, jS + S - 1] contains u (relative to the origin), by search."""
    return tuple(j for j in range(u // s + w // s + 2) if j * s + s - w <= u <= j * s + s - 1)


def check_against_tokens(task: KVRecall, batch: TaskBatch) -> None:
    """Recompute the target slot and all geometry columns from the token ids alone."""
    spec, m = batch.spec, batch.modulus
    s, w, o = spec.stride, spec.window, spec.origin
    toks = batch.tokens.numpy()
    f = batch.frame
    t = toks.shape[1]
    assert (batch.lengths == t).all() and (batch.query_pos == t - 1).all()  # query position fixed
    for i in range(len(batch)):
        row = toks[i]
        q = int(batch.query_pos[i])
        assert row[0] == task.bos_id and row[q - 1] == task.query_id and row[q] in task.key_ids
        hits = np.flatnonzero(row[:q] == row[q])
        assert hits.size == 1, "the target key occurs once before the query (demos never show it)"
        tk = int(hits[0])
        assert row[tk + 1] == batch.answer[i], "the answer is the value that follows the target key"
        u = tk - o
        k_ent, v_ent = entries_brute(u, s, w), entries_brute(u + 1, s, w)
        rec = f.iloc[i]
        assert (rec.t_K, rec.t_V) == (tk, tk + 1)
        assert (rec.residue, rec.phase) == (u % m, u % s)
        assert rec.key_entries == k_ent and rec.value_entries == v_ent
        assert rec.boundary == (u % s == s - 1)
        assert rec.shared_entry == bool(set(k_ent) & set(v_ent))
        assert rec.query_phase == (q - o) % s
        assert q - (tk + 1) >= task.min_distance
        # record index of the target = records (key tokens) before it in the region
        region = row[1:tk]
        assert rec.target_index == int(np.isin(region, list(task.key_ids)).sum())
        lo, hi = task.target_records or (0, task.n_records - 1)
        assert lo <= rec.target_index <= hi
        # corrupted twin: one position differs, the target's value, now `wrong`
        twin = batch.corrupted[i].numpy()
        diff = np.flatnonzero(twin != row)
        assert diff.tolist() == [tk + 1] and twin[tk + 1] == batch.wrong[i] != batch.answer[i]
        assert np.flatnonzero(twin[:q] == twin[q]).tolist() == [
            tk
        ]  # in the twin the key is followed by wrong
        # wrong is another record's value: once in the clean context, never in the demos
        assert np.flatnonzero(row == int(batch.wrong[i])).size == 1
        assert np.flatnonzero(row[: q - 1 - 3 * task.n_demos] == int(batch.wrong[i])).size == 1


@pytest.mark.parametrize("padding", SCHEMES)
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("spec", [PhaseSpec(4), PhaseSpec(4, 8), PhaseSpec(6, origin=1)], ids=str)
def test_frame_matches_tokens(padding: str, paired: bool, spec: PhaseSpec) -> None:
    task = KVRecall(n_records=10, n_demos=3, block_filler=6, padding=padding, paired=paired)
    batch = task.build(spec, n_per_residue=3, seed=7)
    assert len(batch) == 3 * 24 and sorted(set(batch.frame.residue)) == list(range(24))
    assert (batch.frame.groupby("residue").size() == 3).all()
    check_against_tokens(task, batch)
    assert batch.tokens.max() < task.vocab_size


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_records=st.integers(2, 9),
    block_filler=st.integers(0, 6),
    min_distance=st.integers(0, 80),
    stride=st.integers(1, 6),
    k=st.integers(1, 2),
    mult=st.integers(1, 3),
    origin=st.integers(0, 4),
    padding=st.sampled_from(SCHEMES),
    paired=st.booleans(),
    n_cycles=st.integers(1, 2),
    data=st.data(),
)
def test_properties_hold_for_random_configs(
    n_records, block_filler, min_distance, stride, k, mult, origin, padding, paired, n_cycles, data
) -> None:
    lo = data.draw(st.integers(0, n_records - 1))
    hi = data.draw(st.integers(lo, n_records - 1))
    task = KVRecall(
        n_records=n_records,
        n_demos=data.draw(st.integers(0, n_records - 2)),
        block_filler=block_filler,
        min_distance=min_distance,
        target_records=(lo, hi),
        modulus=stride * mult,
        n_cycles=n_cycles,
        padding=padding,
        paired=paired,
    )
    spec = PhaseSpec(stride, stride * k, origin)
    if task.plan().design.lowest < origin:
        with pytest.raises(TaskError):
            task.build(spec, n_per_residue=2)
        return
    batch = task.build(spec, n_per_residue=2, seed=data.draw(st.integers(0, 2**16)))
    assert batch.seq_len == task.seq_len(spec)
    check_against_tokens(task, batch)


@pytest.mark.parametrize("padding", SCHEMES)
def test_sample_moments_match_across_residues(padding: str) -> None:
    task = KVRecall(n_records=8, n_demos=2, block_filler=4, modulus=8, padding=padding)
    spec = PhaseSpec(4)
    design = task.design(spec)
    batch = task.build(spec, n_per_residue=3000, seed=3)
    for r, grp in batch.frame.groupby("residue"):
        xs, ps = design.pmf(int(r))
        mu = float(design.mean)
        var = float(design.variance)
        mu4 = float(np.dot((xs - mu) ** 4, ps))
        n = len(grp)
        t_k = grp["t_K"].to_numpy(dtype=float)
        assert abs(t_k.mean() - mu) < 4.5 * np.sqrt(var / n)
        se_var = np.sqrt((mu4 - var**2 * (n - 3) / (n - 1)) / n)  # exact sd of the sample variance
        assert abs(t_k.var(ddof=1) - var) < 4.5 * se_var
        assert set(np.unique(t_k)) <= set(xs.tolist())  # only designed slots are used


@pytest.mark.parametrize("padding", SCHEMES)
def test_paired_items_differ_only_in_padding(padding: str) -> None:
    task = KVRecall(n_records=8, n_demos=3, block_filler=5, padding=padding, paired=True, modulus=12)
    batch = task.build(PhaseSpec(4), n_per_residue=4, residues=[0, 3, 5, 11], seed=2)
    toks = batch.tokens.numpy()
    filler = np.isin(toks, list(task.filler_ids))
    for _, grp in batch.frame.groupby("item_id"):
        rows = grp.index.to_numpy()
        assert sorted(grp.residue) == [0, 3, 5, 11]
        content = [toks[i][~filler[i]].tolist() for i in rows]
        assert all(c == content[0] for c in content)  # records, demos, query identical; only filler moved
        assert grp.answer.nunique() == grp.wrong.nunique() == grp.target_index.nunique() == 1
        # Prefix: the block is rigid, so every record keeps its offset from the target key.
        key_pos = [
            np.flatnonzero(np.isin(toks[i][: toks.shape[1] - 2 - 9], list(task.key_ids))) for i in rows
        ]
        rel = [kp - t for kp, t in zip(key_pos, grp.t_K)]
        if padding == "prefix":
            assert all(np.array_equal(x, rel[0]) for x in rel)
            spans = [toks[i][kp[0] : kp[-1] + 2].tolist() for i, kp in zip(rows, key_pos)]
            assert all(sp == spans[0] for sp in spans)  # the block is the same token string
    if padding == "in_sequence":
        # Gaps vary: some item's distractor offsets change between residues.
        moved = 0
        for _, grp in batch.frame.groupby("item_id"):
            offs = {
                tuple(np.flatnonzero(np.isin(toks[i][:-11], list(task.key_ids))) - grp.t_K[i])
                for i in grp.index
            }
            moved += len(offs) > 1
        assert moved > 0


def test_deterministic_and_large() -> None:
    task = KVRecall(padding="in_sequence")
    a = task.build(PhaseSpec(4), n_per_residue=50, seed=11)
    b = task.build(PhaseSpec(4), n_per_residue=50, seed=11)
    c = task.build(PhaseSpec(4), n_per_residue=50, seed=12)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    big = task.build(PhaseSpec(4), n_per_residue=200, seed=0)  # 4,800 items (its speed: benchmarks/bench_eval.py)
    assert len(big) == 4800 and (big.frame.residue.value_counts() == 200).all()


def test_min_distance_and_seq_len() -> None:
    near = KVRecall(min_distance=0)
    far = KVRecall(min_distance=150)
    assert far.seq_len() > near.seq_len()
    batch = far.build(PhaseSpec(4), n_per_residue=20)
    assert int((batch.frame.query_pos - batch.frame.t_V).min()) >= 150
    assert far.vocab_size == 128


def test_bad_inputs() -> None:
    task = KVRecall()
    with pytest.raises(ResidueError):
        task.build(PhaseSpec(4), n_per_residue=1, residues=[24])
    with pytest.raises(ResidueError):
        task.build(PhaseSpec(4), n_per_residue=1, residues=[-1])
    with pytest.raises(ResidueError, match="multiple of the stride"):
        task.build(PhaseSpec(5), n_per_residue=1)
    with pytest.raises(ResidueError, match="duplicates"):
        task.build(PhaseSpec(4), n_per_residue=1, residues=[1, 1])
    with pytest.raises(TaskError, match="n_per_residue"):
        task.build(PhaseSpec(4), n_per_residue=0)
    with pytest.raises(TaskError):
        KVRecall(n_records=60)
    with pytest.raises(TaskError):
        KVRecall(n_demos=15)
    with pytest.raises(TaskError):
        KVRecall(padding="suffix")
    with pytest.raises(TaskError):
        KVRecall(target_records=(5, 16))
    with pytest.raises(TaskError):
        KVRecall().build(PhaseSpec(4, origin=60), n_per_residue=1)


def test_training_batch_masks_answers() -> None:
    task = KVRecall(n_records=10, n_demos=3)
    g = torch.Generator().manual_seed(0)
    tb = task.sample_training_batch(256, g)
    again = task.sample_training_batch(256, torch.Generator().manual_seed(0))
    assert torch.equal(tb.tokens, again.tokens)
    b, t = tb.tokens.shape
    assert t == task.seq_len() and (tb.loss_mask.sum(1) == 4).all()
    assert torch.equal(tb.loss_mask, tb.targets != -100)
    toks = tb.tokens.numpy()
    for i in range(b):
        pos = np.flatnonzero(tb.loss_mask[i].numpy())
        assert pos[-1] == t - 1
        for p in pos[:-1]:  # demo key positions: the target is the demo's value, the next token
            assert toks[i, p - 1] == task.query_id and tb.targets[i, p] == toks[i, p + 1]
        tk = np.flatnonzero(toks[i, : t - 1] == toks[i, t - 1])[0]
        assert tb.targets[i, t - 1] == toks[i, tk + 1] and tk == tb.t_key[i]
    assert set(tb.residue.tolist()) == set(range(24))  # random residues
    assert ((tb.t_key % 24) == tb.residue).all()
    tokens, targets = task.sample_training_batch(4, 2**40 + 7)  # (batch_size, seed) -> (tokens, targets)
    assert tokens.shape == targets.shape == (4, t)
    no_demo = task.sample_training_batch(8, 1, train_on_demos=False)
    assert (no_demo.loss_mask.sum(1) == 1).all()
    with pytest.raises(ResidueError):
        task.sample_training_batch(8, 1, spec=PhaseSpec(5))


def test_in_sequence_decorrelates_distractor_phases() -> None:
    # Phase of the record after the target, relative to the target's phase: fixed by the rigid block in the
    # prefix scheme (no block filler), spread over all phases in the in-sequence scheme.
    spec = PhaseSpec(4)
    rel = {}
    for padding in SCHEMES:
        task = KVRecall(
            n_records=8, n_demos=0, block_filler=0, target_records=(0, 6), padding=padding, modulus=8
        )
        batch = task.build(spec, n_per_residue=100, seed=5)
        toks = batch.tokens.numpy()
        out = []
        for i, tk in enumerate(batch.frame.t_K):
            later = np.flatnonzero(np.isin(toks[i, tk + 1 : -2], list(task.key_ids)))
            out.append((later[0] + 1) % 4)
        rel[padding] = np.bincount(out, minlength=4) / len(out)
    assert rel["prefix"][2] == 1.0
    # Gaps are random (roughly geometric), so every relative phase occurs and none dominates.
    assert rel["in_sequence"].min() > 0.1 and rel["in_sequence"].max() < 0.45
