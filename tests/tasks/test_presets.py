"""The paper's black-box measurements as presets, the shared-prefix padding that lets a prefix-caching server
prefill a haystack once per item, and the request plan that prices a served run."""

from __future__ import annotations

import numpy as np
import pytest

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import TaskError
from phaselens.runtime.request_plan import cacheable_tokens, plan_requests, shared_prefix
from phaselens.tasks import Needle, train_toy_tokenizer
from phaselens.tasks.presets import PRESETS, niah_128k, preset, vocabulary_words


@pytest.fixture(scope="module")
def tok():
    return train_toy_tokenizer()


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    d = np.flatnonzero(a != b)
    return int(d[0]) if d.size else len(a)


def test_shared_prefix_keeps_every_residue_of_an_item_identical_up_to_its_padding(tok):
    """Same draws as the prefix scheme (same t_K, answers, records); the residues of one item share every token
    before the target record but the last few pads, where the prefix scheme shares only BOS and the intro."""
    spec = PhaseSpec(4)
    kw = dict(n_records=16, n_demos=1, paired=True, modulus=8)
    shared = Needle(tok, padding="shared_prefix", **kw).build(spec, n_per_residue=4, seed=3)
    prefix = Needle(tok, padding="prefix", **kw).build(spec, n_per_residue=4, seed=3)
    for col in ("t_K", "residue", "answer", "wrong", "target_index"):
        assert shared.frame[col].tolist() == prefix.frame[col].tolist()
    toks, f = shared.tokens.numpy(), shared.frame
    ptoks = prefix.tokens.numpy()
    for _, grp in f.groupby("item_id"):
        rows = grp.index.to_numpy()
        first = int(grp.t_K.min()) - 1  # the earliest target key of the item, minus the record literal
        for i in rows[1:]:
            assert lcp(toks[rows[0]], toks[i]) >= first - 8  # all but the phase-setting pads
            assert lcp(ptoks[rows[0]], ptoks[i]) < lcp(toks[rows[0]], toks[i])
        # records before the target keep their absolute slots; the target moves by its residue
        assert (grp.t_K % 8 == grp.residue).all()
    # the prefix scheme shares its head pads too, but not the records before the target
    saving = cacheable_tokens(list(toks), block=1).sum() / toks.size
    assert saving > 1.3 * cacheable_tokens(list(ptoks), block=1).sum() / ptoks.size


def test_vocabulary_words_stay_one_token_in_the_record(tok):
    words = vocabulary_words(tok)
    assert {"cat", "dog"} <= set(words) and len(words) >= 32
    for w in words[:20]:
        ids = tok.encode(f" {w}: {w}.", add_special_tokens=False).ids
        assert len(ids) == 4 and ids[0] == ids[2]


def test_niah_preset_fills_the_length_with_four_token_records(tok):
    task = niah_128k(tok, n_records=20, length=400)
    assert task.n_records == 20 and task.seq_len() <= 400 and task.seq_len() >= 398  # filler up to the length
    assert task.padding == "shared_prefix" and task.paired and task.modulus == 8
    assert len(set(task.keys) & set(task.values)) == 0  # enough words for disjoint keys and values
    batch = task.build(PhaseSpec(4), n_per_residue=2)
    assert batch.tokens.shape == (16, task.seq_len())
    with pytest.raises(TaskError, match="single-token words"):
        niah_128k(tok, n_records=10**6)
    with pytest.raises(TaskError, match="more than length"):
        niah_128k(tok, n_records=20, length=100)
    assert set(PRESETS) == {"niah-128k", "fp8-probe"} and preset("fp8-probe", tok).name == "fp8_e4m3"


def test_the_request_plan_counts_requests_tokens_and_the_cache_saving(tok):
    task = niah_128k(tok, n_records=20, length=400)
    spec = PhaseSpec(4)
    plan = plan_requests(task, spec, n_per_residue=256, prefill_tokens_per_s=1000.0, sample=2)
    assert plan.requests == 256 * 8 and plan.seq_len == task.seq_len()
    assert plan.prompt_tokens == 256 * 8 * task.seq_len()  # every needle prompt is the full length
    # the saving scales from a sample: measure it on all 2 x 8 items by hand
    batch = task.build(spec, n_per_residue=2)
    rows = list(batch.tokens.numpy())
    by_hand = cacheable_tokens(rows).sum() / batch.tokens.numel()
    assert plan.cache_saving == pytest.approx(by_hand, abs=1e-3) and 0.2 < plan.cache_saving < 0.9
    assert plan.seconds == pytest.approx(plan.prefill_tokens / 1000.0)
    assert "requests" in str(plan) and plan.to_dict()["cache_saving"] > 0
    copies = plan_requests(task, spec, n_per_residue=256, copies=4)
    assert copies.requests == 4 * plan.requests and copies.cacheable_tokens == 0
    assert shared_prefix([np.arange(5), np.arange(5), np.r_[0, 9]]).tolist() == [0, 5, 1]
