"""Per-phase patching agrees with TransformerLens's own generic_activation_patch."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from transformer_lens import patching

import phaselens
from tests.support.models import LAYOUTS, task_model, tiny_task


@pytest.fixture(scope="module")
def model():
    return task_model(LAYOUTS["w8s4-deepseek"], init_std=0.5).eval()


@pytest.mark.parametrize("engine", ["suffix", "full"])
def test_denoising_matches_transformer_lens(model, engine):
    res = phaselens.patch(model, heads=["L0", "L1"], n_per_residue=3, engine=engine)
    batch = tiny_task().build(model.analysis_spec, n_per_residue=3, seed=0)
    q = int(batch.query_pos[0])
    index_df = pd.DataFrame({"layer": [0, 1, 1], "head": [2, 0, 3]})

    def setter(corrupted, index, clean):
        corrupted[:, q, index[1]] = clean[:, q, index[1]]
        return corrupted

    for r in (0, 3, 5):
        rows = torch.as_tensor(np.flatnonzero(batch.frame["residue"].to_numpy() == r))
        clean, corrupt = batch.tokens[rows], batch.corrupted[rows]
        ans, wrong = batch.answer[rows], batch.wrong[rows]

        def metric(logits, _ans=ans, _wrong=wrong):
            idx = torch.arange(len(_ans))
            last = logits[idx, q]
            return (last[idx, _ans] - last[idx, _wrong]).mean()

        _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_z"))
        tl = patching.generic_activation_patch(model, corrupt, clean_cache, metric, setter, "z", index_df=index_df)
        for k, (layer, head) in enumerate(index_df.itertuples(index=False)):
            assert abs(float(tl[k]) - res.m_patched[layer, head, r]) <= 1e-6
        with torch.no_grad():
            m_clean, m_corrupt = float(metric(model(clean))), float(metric(model(corrupt)))
        assert abs(m_clean - res.m_clean[r]) <= 1e-6 and abs(m_corrupt - res.m_corrupt[r]) <= 1e-6
        expect = (res.m_patched[1, 3, r] - m_corrupt) / (m_clean - m_corrupt)
        if not res.undefined[1, 3, r]:
            assert res.recovery.values[1, 3, r] == pytest.approx(expect, abs=1e-5)


def test_noising_direction_and_undefined_flag(model):
    res = phaselens.patch(model, heads="L1H0", direction="noise", n_per_residue=2, eps=1e9)
    assert res.undefined[1, 0].all() and np.isnan(res.recovery.values[1, 0]).all()  # |M_clean - M_corrupt| < eps
    with pytest.raises(phaselens.PhaseLensError, match="site"):
        phaselens.patch(model, site="resid")
    with pytest.raises(phaselens.PhaseLensError, match="direction"):
        phaselens.patch(model, direction="sideways")
