"""Every figure function, tested through its data (fig.to_dict())."""

from __future__ import annotations

import numpy as np
import pytest

import phaselens
from phaselens import plots
from tests.conftest import LAYOUTS, task_model


def arr(x):
    """An array from ``fig.to_dict()``: plotly 6+ encodes numeric arrays as base64 typed arrays."""
    if isinstance(x, dict) and "bdata" in x:
        import base64

        out = np.frombuffer(base64.b64decode(x["bdata"]), dtype=np.dtype(x["dtype"]))
        shape = x.get("shape")
        if isinstance(shape, str):  # "4, 8"
            shape = [int(v) for v in shape.split(",")]
        return out.reshape(shape) if shape else out
    return np.asarray(x, dtype=float)


@pytest.fixture(scope="module")
def model():
    return task_model(LAYOUTS["w4s4-scalar"], init_std=0.5)


@pytest.fixture(scope="module")
def ev(model):
    return phaselens.evaluate(model, n_per_residue=6, progress=False, n_permutations=99, n_bootstrap=50)


@pytest.fixture(scope="module")
def pm(model):
    return phaselens.specialization_map(model, n_per_residue=3, progress=False, n_bootstrap=20)


@pytest.fixture(scope="module")
def rec(model):
    return phaselens.record(model, n_per_residue=3, progress=False)


def test_accuracy_by_residue_folds_cycles_and_overlays_control(model, ev):
    control = phaselens.evaluate(task_model(None), n_per_residue=4, progress=False, stride=4, n_permutations=99,
                                 n_bootstrap=0)
    d = plots.accuracy_by_residue(ev, control).to_dict()
    assert len(d["data"]) == 8 // 4 + 1  # one line per cycle + the control
    pr = ev.per_residue()
    first = d["data"][0]
    assert np.allclose(arr(first["y"]), pr["acc"][:4])
    assert np.allclose(arr(first["error_y"]["array"]), (pr["ci_high"] - pr["acc"])[:4])
    assert list(first["x"])[-1] == "phase 3 (boundary)"
    assert d["layout"]["xaxis"]["title"]["text"].startswith("phase") and d["layout"]["yaxis"]["title"]["text"] == "accuracy"
    assert d["data"][-1]["name"] == "full-attention control"


def test_head_phase_heatmap_is_diverging_per_layer_with_ci_hover(pm):
    d = plots.head_phase_heatmap(pm).to_dict()
    heat = [t for t in d["data"] if t["type"] == "heatmap"]
    assert len(heat) == 2 and heat[0]["zmid"] == 0 and heat[0]["y"][0] == "L0H0"
    lab = pm.values("head")
    assert np.allclose(arr(heat[1]["z"]), lab.values[1], equal_nan=True)
    assert "customdata" in heat[0] and "p=" in heat[0]["hovertemplate"]
    shapes = d["layout"]["shapes"]
    assert len(shapes) == 2 * 2  # boundary residues 3 and 7, outlined in both facets


def test_layer_map_and_patch_heatmap(pm, model):
    d = plots.layer_knockout_map(pm).to_dict()
    assert np.allclose(arr(d["data"][0]["z"]), pm.values("layer").values, equal_nan=True)
    pr = phaselens.patch(model, heads="L1", n_per_residue=2)
    d = plots.patch_heatmap(pr).to_dict()
    assert arr(d["data"][0]["z"]).shape == (8, 8)


def test_read_side_and_gate_figures(rec):
    d = plots.read_side_attention(rec).to_dict()
    assert np.allclose(arr(d["data"][0]["z"]), rec.read["key_entries"].values[0], equal_nan=True)
    d = plots.gate_profiles(rec).to_dict()
    assert len(d["data"]) == 2 * 2  # 2 layers x (k, v) paths
    assert np.allclose(arr(d["data"][0]["z"]), rec.gate_profile.values[0, 0])
    d = plots.gate_concentration(rec).to_dict()
    assert d["layout"]["xaxis"]["title"]["text"].startswith("static")
    assert len(arr(d["data"][0]["x"])) == 2 * 2  # layers x KV heads for the first path


def test_rose_periodicity_cycling_and_repair(model, ev):
    d = plots.phase_rose(ev).to_dict()
    assert d["data"][0]["type"] == "barpolar" and np.allclose(arr(d["data"][0]["r"]), ev.per_phase()["acc"])
    d = plots.periodicity_panel(ev).to_dict()
    assert len(d["data"]) == 2 and len(arr(d["data"][0]["y"])) == 8 // 2
    cyc = phaselens.gate_cycling_test(model, deltas=(1, 2), n_per_residue=2, progress=False)
    d = plots.gate_cycling_scatter(cyc).to_dict()
    assert len(d["data"]) == 3 and "R^2" in d["layout"]["title"]["text"]
    assert len(arr(d["data"][0]["x"])) + len(arr(d["data"][1]["x"])) == 2 * 4
    table = phaselens.repair_table(model, n_per_residue=2, progress=False, shift_sets=("all",),
                                   combines=("max_conf",), n_permutations=9, n_bootstrap=0)
    d = plots.repair_panel(table).to_dict()
    assert [t["name"] for t in d["data"]] == ["unrepaired", "repaired"]
    assert np.allclose(arr(d["data"][0]["y"]), table.base.per_phase()["acc"])
