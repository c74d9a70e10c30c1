"""The analyses run on a DeepSeek-V4.1 checkpoint and agree with the same quantities computed by hand."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import phaselens
from phaselens.analyses.items import build_items
from tests.support.deepseek_v41 import write_tiny_checkpoint
from tests.support.models import tiny_task


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = write_tiny_checkpoint(tmp_path_factory.mktemp("v41a") / "tiny")
    model = phaselens.load(f"hf:{root}", dtype=torch.float32, index_topk="all")
    task = tiny_task()
    assert task.vocab_size <= model.cfg.d_vocab
    return model, task


def manual_logit_diff(model, batch, hooks=()):
    rows = torch.arange(len(batch.query_pos))
    with torch.no_grad():
        logits = model.run_with_hooks(batch.tokens, fwd_hooks=list(hooks))
    at = logits[rows, batch.query_pos]
    return (at[rows, batch.answer] - at[rows, batch.wrong]).numpy(), at.argmax(-1) == batch.answer


def test_evaluate(setup):
    model, task = setup
    ev = phaselens.evaluate(model, task, n_per_residue=2, progress=False, n_permutations=20, n_bootstrap=20)
    assert ev.stride == 2 and ev.modulus == 8 and len(ev.items) == 16
    assert ev.metadata["architecture"] == "deepseek_v41" and ev.metadata["index_topk"] == "all"
    _, _, batch = build_items(model, task, n_per_residue=2, seed=0)
    ld, _ = manual_logit_diff(model, batch)
    np.testing.assert_allclose(ev.items["logit_diff"].to_numpy(), ld, atol=1e-4)
    assert sorted(ev.items["phase"].unique()) == [0, 1]


def zero_l3_knockout(model, task):
    """Logit-difference change of zeroing layer 3's z at each item's query position, by hand."""
    _, _, batch = build_items(model, task, n_per_residue=1, seed=0)
    rows = torch.arange(len(batch.query_pos))

    def zero_z(z, hook):
        z = z.clone()
        z[rows, batch.query_pos] = 0
        return z

    clean, _ = manual_logit_diff(model, batch)
    ko, _ = manual_logit_diff(model, batch, [("blocks.3.attn.hook_z", zero_z)])
    return batch.frame["residue"].to_numpy(), ko - clean


def test_ablate_matches_manual_knockout(setup):
    model, task = setup
    ab = phaselens.ablate(model, "L3", task, method="zero", n_per_residue=1, progress=False, n_bootstrap=20)
    residue, delta = zero_l3_knockout(model, task)
    res = ab.per_residue().set_index("residue")["delta_logit_diff"]
    np.testing.assert_allclose(res.loc[residue].to_numpy(), delta, atol=1e-4)
    assert ab.stride == 2


@pytest.mark.slow
def test_specialization_map_matches_manual_knockout(setup):
    model, task = setup
    residue, delta = zero_l3_knockout(model, task)
    pm = phaselens.specialization_map(model, task, method="zero", n_per_residue=1, kinds=("layer",),
                                      progress=False, n_bootstrap=20)
    frame = pm.to_frame()
    assert sorted(frame["layer"].unique()) == list(range(7))
    l3 = frame[frame["label"] == "L3"].set_index("residue")["delta_logit_diff"]
    np.testing.assert_allclose(l3.loc[residue].to_numpy(), delta, atol=1e-4)


def test_record(setup):
    model, task = setup
    rec = phaselens.record(model, task=task, n_per_residue=2, progress=False)
    read = {k: v.sel(layer=3).values for k, v in rec.read.items()}  # a consumer layer: entries of layer 2
    np.testing.assert_allclose(read["local"] + read["entries"] + read["sink"], 1.0, atol=1e-5)
    assert np.nanmin(read["entries"]) > 0
    assert list(rec.gate_key.coords["layer"]) == [2, 3]  # the period-2 layers
    g2 = rec.gate_key.sel(layer=2).values
    assert np.all((g2 >= 0) & (g2 <= 1)) and not np.isnan(g2).all()
    assert np.isnan(rec.gate_key.sel(layer=3).values).all()  # layer 3 has no gate: it reads layer 2's entries
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rec.gate_profile.sel(layer=2).values.shape[-1] == 2  # W = 2 slots


def test_record_reads_ratio1_entries_per_token(setup):
    """On a ratio-1 layer the key's entry is the key's own token: key_entries is the query's probability on
    entry t_K, read here straight from hook_pattern_entry."""
    model, task = setup
    rec = phaselens.record(model, task=task, n_per_residue=1, progress=False)
    _, _, batch = build_items(model, task, n_per_residue=1, seed=0)
    rows = torch.arange(len(batch.query_pos))
    t_k = torch.as_tensor(batch.frame["t_K"].to_numpy().copy())
    kept = {}

    def keep(p, hook):
        kept[hook.layer()] = p[rows, :, batch.query_pos][rows, :, t_k]  # [N, H]

    with torch.no_grad():
        model.run_with_hooks(batch.tokens, fwd_hooks=[(f"blocks.{i}.attn.hook_pattern_entry", keep) for i in (4, 6)])
    for layer in (4, 6):
        np.testing.assert_allclose(rec.values["key_entries"][:, layer], kept[layer].numpy(), atol=1e-6)
        assert kept[layer].max() > 0  # the needle's entry is visible and picked (index_topk="all")
