"""record(): invariants of the read and write sides on a random model."""

from __future__ import annotations

import numpy as np
import pytest

import phaselens
from tests.support.models import LAYOUTS, task_model


@pytest.fixture(scope="module", params=["w4s4-scalar", "w8s4-deepseek"])
def rec(request):
    model = task_model(LAYOUTS[request.param], init_std=0.5)
    return phaselens.record(model, n_per_residue=3, progress=False), LAYOUTS[request.param]


def test_read_side_masses_partition_the_attention(rec):
    r, spec = rec
    k, v, o, e = (r.read[q].values for q in ("key_entries", "value_entries", "other_entries", "entries"))
    loc, sink = r.read["local"].values, r.read["sink"].values
    assert np.allclose(e + loc + sink, 1, atol=1e-5)  # one softmax over local window, entries and sink
    # key and value entries may coincide: their union lies between the larger of the two and their sum
    union = e - o
    assert (union >= np.maximum(k, v) - 1e-6).all() and (union <= k + v + 1e-6).all()
    assert (k > 0).all() and (o >= -1e-6).all()
    assert r.read["key_entries"].ci_low is not None and r.read["key_entries"].dims == ("layer", "head", "residue")


def test_write_side_profiles_and_concentration(rec):
    r, spec = rec
    prof = r.gate_profile.values  # [layer, path, kv_head, offset]
    assert np.allclose(np.nansum(prof, -1), 1, atol=1e-4)  # E[alpha] is a distribution over offsets
    conc = r.concentration.values
    assert (conc >= 1 - 1e-5).all() and (conc <= spec.window + 1e-5).all()
    assert (r.gate_key.values >= 0).all() and (r.gate_key.values <= 1).all()
    assert set(r.to_frame()["quantity"]) >= {"mass_key_entries", "gate_key", "gate_value"}
    assert set(r.to_frame("model")["quantity"]) == {"gate_profile", "gate_concentration"}
    ph = r.per_phase()  # folding the items by phase agrees with pooling the residue means of equal sizes
    key = ph[(ph["quantity"] == "gate_key")].set_index(["layer", "kv_head", "phase"])["value"]
    res = r.gate_key.values  # [layer, kv_head, residue]
    folded = res.reshape(*res.shape[:2], -1, r.stride).mean(2)
    assert np.allclose(key.to_numpy().reshape(folded.shape), folded, equal_nan=True)
    assert "PhaseRecording(" in repr(r)


@pytest.mark.parametrize("layout_name", ["w4s4-scalar", "w8s4-deepseek"])
def test_write_side_equals_a_loop_over_items_and_entries(layout_name):
    """Gate weights at the target, E[alpha] and both concentration measures, recomputed item by item with
    scipy's entropy."""
    import scipy.stats as sps

    model = task_model(LAYOUTS[layout_name], init_std=0.5)
    batch = model.default_task.build(model.analysis_spec, n_per_residue=3, seed=0)
    r = phaselens.record(model, batch, progress=False, batch_size=7)  # uneven batches: sums must still add up
    _, cache = model.run_with_cache(batch.tokens, names_filter=lambda n: "hook_gate" in n)
    name = next(n for n in cache if n.startswith("blocks.0."))
    path = name.rsplit("_", 1)[-1] if name.endswith(("_k", "_v")) else "kv"
    alpha = cache[name].double().numpy()  # [N, E, W, Hkv(, d)]
    if alpha.ndim == 4:
        alpha = alpha[..., None]
    geo = model.phase_specs[0]
    W = geo.window
    skip = geo.blocks_per_window - 1  # entries whose window starts before the origin
    windows = [alpha[i, e] for i in range(alpha.shape[0]) for e in range(skip, alpha.shape[1])]  # [W, Hkv, d]
    prof = np.mean(windows, 0)  # [W, Hkv, d]
    per_window = np.mean([np.exp(sps.entropy(a, axis=0)) for a in windows], 0).mean(-1)  # [Hkv]
    static = np.exp(sps.entropy(prof, axis=0)).mean(-1)  # [Hkv]
    assert np.allclose(r.gate_profile.sel(layer=0, path=path).values[:, :W], prof.mean(-1).T, atol=1e-5)
    conc = r.concentration.sel(layer=0, path=path).values  # [kv_head, (static, per_window)]
    assert np.allclose(conc[:, 0], static, atol=1e-4) and np.allclose(conc[:, 1], per_window, atol=1e-4)
    # gate weight on the target key's slot, averaged over the entries containing it and over the k/v paths
    t_k = batch.frame["t_K"].to_numpy()
    paths = [cache[n].double() for n in cache if n.startswith("blocks.0.")]
    per_item = np.full((len(t_k), paths[0].shape[3]), np.nan)
    for i, t in enumerate(t_k):
        picks = [a[i, e, o].reshape(a.shape[3], -1).mean(-1).numpy() for a in paths
                 for e, o in zip(geo.entries_containing(int(t)), geo.offsets(int(t))) if e < a.shape[1]]
        if picks:
            per_item[i] = np.mean(picks, 0)
    res = batch.frame["residue"].to_numpy()
    for m in range(batch.modulus):
        want = np.nanmean(per_item[res == m], 0)
        assert np.allclose(r.gate_key.sel(layer=0, residue=m).values, want, atol=1e-5, equal_nan=True)
