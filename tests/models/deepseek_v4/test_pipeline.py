"""The analyses run unchanged on the DeepSeek-V4 adapter (tiny random model, CPU, eager)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import phaselens
from phaselens.presentation.reporting import ReportSettings
from phaselens.tasks import KVRecall
from tests.support.deepseek import tiny_v4_model

TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    a = phaselens.from_hf(tiny_v4_model(seed=3))
    a.default_task = TASK
    return a


def test_geometry_and_protocol(adapter):
    assert isinstance(adapter, phaselens.contract.protocol.PhaseModel)
    specs = adapter.phase_specs
    assert specs[0] is None and specs[1] == phaselens.PhaseSpec(4, 8) and specs[2] == phaselens.PhaseSpec(16)
    assert adapter.analysis_spec.stride == 4 and adapter.cfg.n_key_value_heads == 1


def test_evaluate_record_ablate_map_pipeline(adapter):
    ev = phaselens.evaluate(adapter, n_per_residue=2, progress=False, n_permutations=99, n_bootstrap=0)
    assert len(ev.items) == 16 and ev.stride == 4
    rec = phaselens.record(adapter, n_per_residue=1, progress=False)
    e, loc, sink = (rec.read[q].values for q in ("entries", "local", "sink"))
    comp = [1, 2, 3]
    assert np.allclose((e + loc + sink)[comp], 1, atol=1e-4)
    assert np.isnan(e[0]).all() and np.allclose((loc + sink)[0], 1, atol=1e-4)  # sliding-only layer 0
    assert rec.gate_profile is not None and rec.gate_profile.coords["path"].tolist() == ["kv"]
    res = phaselens.ablate(adapter, "L1", phase=3, n_per_residue=2, method="zero", progress=False)
    assert len(res.per_residue()) == 2
    pm = phaselens.specialization_map(adapter, n_per_residue=1, progress=False, kinds=("layer",), n_bootstrap=0)
    assert pm.metadata["engine"] == "suffix" and pm.values("layer").shape == (4, 8)


def test_report_smoke_on_the_adapter(adapter, tmp_path):
    tiny = ReportSettings(n_eval=2, n_record=1, n_map=1, n_cycle=1, n_repair=1)
    out = phaselens.report([adapter], tmp_path / "rep", settings=tiny, progress=False, static=False)
    assert (out / "index.html").exists() and (out / "results.json").exists()


def test_chunked_analyses_compute_only_the_query_logits(adapter):
    """With chunked prefill the analyses ask for the query rows' logits only (the lm_head never sees the
    whole context) and agree with the unchunked adapter."""
    chunked = phaselens.from_hf(adapter.model, chunk=8)
    chunked.default_task = TASK
    assert chunked.returns_query_logits and not adapter.returns_query_logits
    rows_seen: list[int] = []
    handle = adapter.model.lm_head.register_forward_hook(lambda m, i, o: rows_seen.append(o.shape[1]))
    try:
        kw = dict(n_per_residue=2, progress=False, n_permutations=9, n_bootstrap=0)
        ev_c = phaselens.evaluate(chunked, **kw)
        assert max(rows_seen) == 1  # prefix chunks keep one row; the query chunk is the last token
        ab_c = phaselens.ablate(chunked, "L1", phase=3, n_per_residue=2, method="zero", progress=False)
    finally:
        handle.remove()
    ev = phaselens.evaluate(adapter, **kw)
    ab = phaselens.ablate(adapter, "L1", phase=3, n_per_residue=2, method="zero", progress=False)
    assert np.allclose(ev_c.items["logit_diff"], ev.items["logit_diff"], atol=1e-4)
    assert np.allclose(ab_c.items["logit_diff_ko"], ab.items["logit_diff_ko"], atol=1e-4)
