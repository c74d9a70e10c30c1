"""Every result type through one contract: declared frames at every level, a plot, save/load, metadata, repr."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

import phaselens
from phaselens.results.base import VOCABULARY, Result

SMALL = dict(n_per_residue=2, seed=0, progress=False)
RUNS = {
    "PhaseEval": lambda m: phaselens.evaluate(m, **SMALL, n_permutations=20, n_bootstrap=20),
    "PhaseRecording": lambda m: phaselens.record(m, **SMALL),
    "PhaseAblation": lambda m: phaselens.ablate(m, "L0H1", **SMALL, n_bootstrap=20),
    "PhasePatch": lambda m: phaselens.patch(m, ["L0H1", "L1H0"], **SMALL, n_bootstrap=20),
    "PhaseMap": lambda m: phaselens.specialization_map(m, **SMALL, n_bootstrap=20),
    "PhaseAttribution": lambda m: phaselens.attribution_map(m, **SMALL),
    "PhaseGateCycling": lambda m: phaselens.gate_cycling_test(m, **SMALL, deltas=(1,), n_bootstrap=20),
    "PhaseRepairTable": lambda m: phaselens.repair_table(m, **SMALL, shift_sets=("opposite",), n_permutations=20,
                                                    n_bootstrap=20),
}


@pytest.fixture(scope="module")
def results():
    model = phaselens.load("zoo:w4s4")
    return {name: run(model) for name, run in RUNS.items()}


def test_every_result_type_is_covered(results):
    types = {c.__name__ for c in _subclasses(Result)}
    assert types == set(RUNS)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


@pytest.mark.parametrize("name", list(RUNS))
def test_result_contract(results, name, tmp_path):
    res = results[name]
    assert type(res).__name__ == name
    assert set(res.COLUMNS) == set(res.LEVELS), "every level declares its columns"
    for level in res.LEVELS:
        frame = res.to_frame(level)
        declared = res.COLUMNS[level]
        assert list(frame.columns[: len(declared)]) == list(declared), (level, list(frame.columns))
        assert set(declared) <= set(VOCABULARY), set(declared) - set(VOCABULARY)
        assert len(frame) > 0
    assert res.to_frame().equals(res.per_residue()[list(res.to_frame().columns)])
    with pytest.raises(phaselens.errors.InputError, match="level must be one of"):
        res.to_frame("nope")
    # metadata: model, arguments as called, world size
    md = res.metadata
    assert md["model"] == "w4s4" and md["arguments"]["seed"] == 0 and md["world_size"] == 1
    assert isinstance(repr(res), str) and name.split("Result")[0][:5] in repr(res) or len(repr(res)) > 10
    fig = res.plot()
    assert isinstance(fig, go.Figure) and len(fig.data) > 0
    # save and load: the same type, the same frames at every level, the same metadata
    path = res.save(tmp_path / "r.phaselens")
    back = type(res).load(path)
    assert type(back) is type(res)
    for level in res.LEVELS:
        a, b = res.to_frame(level), back.to_frame(level)
        assert list(a.columns) == list(b.columns)
        for col in a.columns:
            x, y = a[col].to_numpy(), b[col].to_numpy()
            if x.dtype.kind in "biuf":
                assert np.array_equal(x.astype(float), y.astype(float), equal_nan=True), (level, col)
            else:
                assert [str(v) for v in x] == [str(v) for v in y], (level, col)
    assert back.metadata == res.metadata
    assert phaselens.results.load(path).__class__ is type(res)
    with pytest.raises(phaselens.errors.OutputError, match="overwrite=True"):  # one error class for every refused write
        res.save(path)
    res.save(path, overwrite=True)


def test_save_never_replaces_a_file_phaselens_did_not_write(results, tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes")
    with pytest.raises(phaselens.errors.OutputError, match="never replaces"):
        results["PhaseEval"].save(mine, overwrite=True)
    assert mine.read_text() == "my notes"


def test_loading_another_type_says_which(results, tmp_path):
    path = results["PhaseEval"].save(tmp_path / "ev.phaselens")
    with pytest.raises(phaselens.errors.InputError, match="holds a PhaseEval"):
        phaselens.PhaseMap.load(path)


def test_one_name_per_concept_and_no_aliases(results):
    """phaselens has not been released: no renamed alias stays behind (issue 33)."""
    gone = {"PhaseMap": ("ko_correct", "clean_correct", "clean_logit_diff", "ko_logit_diff", "by_phase"),
            "PhasePatch": ("item_clean", "item_corrupt", "item_patched"), "PhaseRecording": ("items",)}
    for name, old in gone.items():
        for attr in old:
            assert not hasattr(results[name], attr), (name, attr)


def test_frames_are_pandas(results):
    for res in results.values():
        assert isinstance(res.per_phase(), pd.DataFrame)
