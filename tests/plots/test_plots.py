"""Every figure function, tested through its data (fig.to_dict())."""

from __future__ import annotations

import numpy as np
import pytest

import phaselens
from phaselens import plots
from tests.support.models import LAYOUTS, task_model


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


def _yaxes(d):
    return {k: v for k, v in d["layout"].items() if k.startswith("yaxis")}


def _boundary_x0(d):
    return sorted({round(s["x0"] + 0.5) for s in d["layout"].get("shapes", [])})


def test_head_phase_heatmap_is_diverging_per_layer_with_ci_hover(pm):
    d = plots.head_phase_heatmap(pm).to_dict()
    heat = [t for t in d["data"] if t["type"] == "heatmap"]
    assert len(heat) == 2 and d["layout"]["coloraxis"]["cmid"] == 0 and heat[0]["y"][0] == "L0H0"
    lab = pm.values("head")
    assert np.allclose(arr(heat[1]["z"]), lab.values[1], equal_nan=True)
    assert "customdata" in heat[0] and "p=" in heat[0]["hovertemplate"]
    shapes = d["layout"]["shapes"]
    assert len(shapes) == 2 * 2  # boundary residues 3 and 7, outlined in both facets
    assert _boundary_x0(d) == [3, 7]


@pytest.fixture(scope="module")
def zoo_maps():
    """Maps of a trained zoo model and the control (tiny random models score 0 everywhere: all cells undefined)."""
    kw = dict(n_per_residue=2, progress=False, n_bootstrap=20, kinds=("head", "layer"))
    return (phaselens.specialization_map(phaselens.load("zoo:w4s4"), **kw),
            phaselens.specialization_map(phaselens.load("zoo:full"), stride=4, **kw))


def test_control_map_stands_beside_on_one_colour_scale(zoo_maps):
    pm, pm_control = zoo_maps
    for fn, kind in ((plots.head_phase_heatmap, "head"), (plots.layer_knockout_map, "layer")):
        d = fn(pm, control=pm_control, names=("tiny", "ctrl")).to_dict()
        heat = [t for t in d["data"] if t["type"] == "heatmap"]
        assert len(heat) == (2 * pm.n_layers if kind == "head" else 2)
        assert all(t["coloraxis"] == "coloraxis" and "zmin" not in t for t in heat)  # one scale for all panels
        ca = d["layout"]["coloraxis"]
        both = np.concatenate([pm.values(kind).values.ravel(), pm_control.values(kind).values.ravel()])
        assert ca["cmid"] == 0 and ca["cmin"] == -ca["cmax"]
        assert ca["cmax"] == pytest.approx(np.nanmax(np.abs(both))) and ca["cmax"] > 10
        # compressed model left (odd x axes), control right (even): each panel holds its own map's values
        left = [t for t in heat if t.get("xaxis", "x") in ("x", "x3")]
        right = [t for t in heat if t.get("xaxis") in ("x2", "x4")]
        assert len(left) == len(right) == len(heat) // 2
        for side, m in ((left, pm), (right, pm_control)):
            vals = m.values(kind).values
            assert np.allclose(arr(side[0]["z"]), vals[0] if kind == "head" else vals, equal_nan=True)
        titles = " ".join(a["text"] for a in d["layout"]["annotations"])
        assert "tiny" in titles and "ctrl" in titles


def test_one_orientation_everywhere_layer_0_and_head_0_on_top(pm, rec, model):
    figs = {
        "head": plots.head_phase_heatmap(pm), "layer": plots.layer_knockout_map(pm),
        "read": plots.read_side_attention(rec), "gates": plots.gate_profiles(rec),
        "patch": plots.patch_heatmap(phaselens.patch(model, heads="L1", n_per_residue=2)),
    }
    for name, fig in figs.items():
        d = fig.to_dict()
        assert all(ax.get("autorange") == "reversed" for ax in _yaxes(d).values()), name
        first = next(t for t in d["data"] if t["type"] == "heatmap")
        assert first["y"][0] in ("L0H0", "L0", "KV0"), name
    for name in ("head", "layer", "read", "patch"):  # the boundary is outlined on every residue map
        assert _boundary_x0(figs[name].to_dict()) == [3, 7], name


def test_undefined_cells_are_marked_with_a_legend(zoo_maps):
    import dataclasses

    pm = zoo_maps[0]
    from phaselens.plots.knockouts import undefined_reason

    rel = pm.effects.rel_change.copy()
    rel[:, 0] = np.nan  # as when the clean model is below the threshold at residue 0
    bad = dataclasses.replace(pm, effects=dataclasses.replace(pm.effects, rel_change=rel))
    for fig, kind in ((plots.head_phase_heatmap(bad), "head"), (plots.layer_knockout_map(bad), "layer")):
        d = fig.to_dict()
        marks = [t for t in d["data"] if t.get("legendgroup") == "undefined"]
        assert marks and sum(bool(t.get("showlegend")) for t in marks) == 1  # one legend entry, every panel marked
        assert d["layout"]["showlegend"] is True
        assert marks[0]["name"] == undefined_reason() and "2%" in marks[0]["name"]
        marked = {(y, int(x)) for t in marks for x, y in zip(arr(t["x"]), t["y"])}
        vals = bad.values(kind).values
        if kind == "head":
            want = {(f"L{layer}H{h}", r) for layer, h, r in zip(*np.nonzero(np.isnan(vals)))}
        else:
            want = {(f"L{layer}", r) for layer, r in zip(*np.nonzero(np.isnan(vals)))}
        assert marked == want and all((y, 0) in marked for y, _ in want)  # exactly the NaN cells, residue 0 included
    clean = [t for t in plots.head_phase_heatmap(pm).to_dict()["data"] if t.get("legendgroup") == "undefined"]
    assert sum(len(t["y"]) for t in clean) == int(np.isnan(pm.values("head").values).sum())


def test_layer_map_and_patch_heatmap(pm, model):
    d = plots.layer_knockout_map(pm).to_dict()
    assert np.allclose(arr(d["data"][0]["z"]), pm.values("layer").values, equal_nan=True)
    pr = phaselens.patch(model, heads="L1", n_per_residue=2)
    d = plots.patch_heatmap(pr).to_dict()
    assert arr(d["data"][0]["z"]).shape == (8, 8)


def test_read_side_and_gate_figures(rec):
    d = plots.read_side_attention(rec).to_dict()
    assert np.allclose(arr(d["data"][0]["z"]), rec.read["key_entries"].values[0], equal_nan=True)
    d = plots.gate_concentration(rec).to_dict()
    assert d["layout"]["xaxis"]["title"]["text"].startswith("static")
    assert len(arr(d["data"][0]["x"])) == 2 * 2  # layers x KV heads for the first path


@pytest.mark.parametrize("name", ["w4s4-scalar", "w8s4-deepseek"])
def test_gate_profiles_relative_to_uniform_with_integer_offsets(name):
    rec = phaselens.record(task_model(LAYOUTS[name], init_std=0.5), n_per_residue=2, progress=False)
    lab = rec.gate_profile
    W = LAYOUTS[name].window
    d = plots.gate_profiles(rec).to_dict()
    heat = [t for t in d["data"] if t["type"] == "heatmap"]
    assert len(heat) == lab.values.shape[0] * lab.values.shape[1]  # layers x paths
    # colour = log2(E[alpha] / (1/W)): 0 (white, the scale's middle) is uniform pooling
    assert np.allclose(arr(heat[0]["z"]), np.log2(np.clip(W * lab.values[0, 0], 2.0**-6, None)))
    assert np.allclose(arr(heat[0]["customdata"])[..., 0], lab.values[0, 0])
    ca = d["layout"]["coloraxis"]
    assert ca["cmid"] == 0 and ca["cmin"] == -ca["cmax"] and ca["cmax"] >= 1
    ticktext = dict(zip(ca["colorbar"]["tickvals"], ca["colorbar"]["ticktext"]))
    assert ticktext[0] == "1/W (uniform)" and ticktext[1] == "2/W" and ticktext[-1] == "0.5/W"
    for key, ax in d["layout"].items():  # offset ticks are the integers 0..W-1 on every panel
        if key.startswith("xaxis"):
            assert ax["tickvals"] == list(range(W)) and ax["ticktext"] == [str(o) for o in range(W)]
    # the panel titles sit clear of the tick labels of the panel above: >= 80 px between panels
    ys = sorted((ax["domain"] for k, ax in d["layout"].items() if k.startswith("yaxis")), key=lambda dom: -dom[1])
    plot_px = d["layout"]["height"] - 70 - 60  # the theme's top and bottom margins
    for upper, lower in zip(ys, ys[1:]):
        if upper != lower:
            assert (upper[0] - lower[1]) * plot_px >= 80


def test_negative_r2_is_explained():
    from phaselens.plots import r2_note

    assert "worse than a flat line at the mean" in r2_note(-3.16) and "-3.16" in r2_note(-3.16)
    assert "explains 80%" in r2_note(0.8)


def test_rose_periodicity_cycling_and_repair(model, ev):
    d = plots.phase_rose(ev).to_dict()
    assert d["data"][0]["type"] == "barpolar" and np.allclose(arr(d["data"][0]["r"]), ev.per_phase()["acc"])
    d = plots.periodicity_panel(ev).to_dict()
    assert len(d["data"]) == 2 and len(arr(d["data"][0]["y"])) == 8 // 2
    cyc = phaselens.gate_cycling_test(model, deltas=(1, 2), n_per_residue=2, progress=False)
    d = plots.gate_cycling_scatter(cyc).to_dict()
    assert len(d["data"]) == 3 and "R^2" in d["layout"]["title"]["text"]
    assert ("fits worse than a flat line" in d["layout"]["title"]["text"]) == (cyc.r2 < 0)
    assert len(arr(d["data"][0]["x"])) + len(arr(d["data"][1]["x"])) == 2 * 4
    table = phaselens.repair_table(model, n_per_residue=2, progress=False, shift_sets=("all",),
                                   combines=("max_conf",), n_permutations=9, n_bootstrap=0)
    d = plots.repair_panel(table).to_dict()
    assert [t["name"] for t in d["data"]] == ["unrepaired", "repaired"]
    assert np.allclose(arr(d["data"][0]["y"]), table.base.per_phase()["acc"])
