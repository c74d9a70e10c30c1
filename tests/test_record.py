"""record(): invariants of the read and write sides on a random model."""

from __future__ import annotations

import numpy as np
import pytest

import phaselens
from tests.conftest import LAYOUTS, task_model


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
    assert set(r.to_frame()["quantity"]) >= {"mass_key_entries", "gate_key", "gate_profile", "gate_concentration"}
    assert "Recording(" in repr(r)
