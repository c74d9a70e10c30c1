"""``journal=`` of ``patch`` (cells), ``ablate`` and ``repair_table`` (item blocks): a run stopped after some
units resumes from the file and equals an uninterrupted run exactly; a journal of other settings is refused."""

from __future__ import annotations

import importlib

import numpy as np
import pandas as pd
import pytest

import phaselens
from phaselens.errors import JournalError
from tests.support.models import task_model

KW = dict(n_per_residue=3, batch_size=5)  # 24 items: 5 blocks of <= 5 items


@pytest.fixture(scope="module")
def model():
    return task_model()


def stop_after(monkeypatch, module, name: str, calls: int) -> None:
    """Make ``module.name`` raise on call ``calls + 1``: the run stops there, as if killed."""
    real, seen = getattr(module, name), [0]

    def wrapped(*args, **kwargs):
        seen[0] += 1
        if seen[0] > calls:
            raise KeyboardInterrupt("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def interrupted_then_resumed(monkeypatch, run, module, name: str, calls: int):
    with monkeypatch.context() as m:
        stop_after(m, module, name, calls)
        with pytest.raises(KeyboardInterrupt):
            run()
    return run()


def test_patch_resumes_cells_and_refuses_another_run(model, tmp_path, monkeypatch):
    mod = importlib.import_module("phaselens.analyses.patching")  # the attribute is the function

    journal = tmp_path / "patch.journal"
    kw = dict(**KW, heads=["L0", "L1H2"], n_bootstrap=20, engine="full")
    plain = phaselens.patch(model, **kw)
    resumed = interrupted_then_resumed(monkeypatch, lambda: phaselens.patch(model, **kw, journal=journal), mod,
                                       "answer_metrics", 3)  # 3 of the 5 heads finished
    (shard,) = [s for s in resumed.metadata["shards"] if s["stage"] == "patch" and s["unit"] == "cell"]
    assert shard["resumed"] == ["L0H0", "L0H1", "L0H2"] and shard["by_rank"] == [["L0H3", "L1H2"]]
    assert resumed.metadata["arguments"]["journal"] == str(journal)
    assert np.array_equal(resumed.logit_diff_patched, plain.logit_diff_patched)
    assert np.array_equal(resumed.recovery.values, plain.recovery.values, equal_nan=True)
    assert np.array_equal(resumed.recovery.ci_low, plain.recovery.ci_low, equal_nan=True)
    for other in (dict(direction="noise"), dict(heads=["L0"]), dict(batch_size=4), dict(engine="suffix")):
        with pytest.raises(JournalError, match="different computation"):
            phaselens.patch(model, **{**kw, **other}, journal=journal)


@pytest.mark.parametrize("engine", ["full", "suffix"])
def test_ablate_resumes_item_blocks_and_refuses_another_run(model, tmp_path, monkeypatch, engine):
    mod = importlib.import_module("phaselens.analyses.knockout_runs")

    journal = tmp_path / "ablate.journal"
    kw = dict(**KW, method="resample", n_bootstrap=20, progress=False, engine=engine)
    plain = phaselens.ablate(model, "L1H1", **kw)
    resumed = interrupted_then_resumed(monkeypatch, lambda: phaselens.ablate(model, "L1H1", **kw, journal=journal),
                                       mod, "answer_metrics", 2 * 2)  # clean + knocked out per block: 2 blocks
    (shard,) = resumed.metadata["shards"]
    assert shard["resumed"] == ["items 0-4", "items 5-9"]
    assert shard["by_rank"] == [["items 10-14", "items 15-19", "items 20-23"]]
    assert resumed.metadata["arguments"]["journal"] == str(journal)
    cols = ["correct", "correct_ko", "logit_diff", "logit_diff_ko", "nll", "rank", "p_correct"]
    assert resumed.items[cols].equals(plain.items[cols])
    assert np.array_equal(resumed.effects.rel_change, plain.effects.rel_change, equal_nan=True)
    assert np.array_equal(resumed.effects.ci_low, plain.effects.ci_low, equal_nan=True)
    for other in (dict(method="mean"), dict(seed=1), dict(batch_size=6)):
        with pytest.raises(JournalError, match="different computation"):
            phaselens.ablate(model, "L1H1", **{**kw, **other}, journal=journal)
    with pytest.raises(JournalError, match="different computation"):
        phaselens.ablate(model, "L1H2", **kw, journal=journal)


def test_repair_table_resumes_item_blocks_and_refuses_another_run(model, tmp_path, monkeypatch):
    mod = importlib.import_module("phaselens.repair.table")

    journal = tmp_path / "repair.journal"
    kw = dict(**KW, shift_sets=("all", (0, 2)), n_permutations=20, n_bootstrap=20, progress=False)
    plain = phaselens.repair_table(model, **kw)
    resumed = interrupted_then_resumed(monkeypatch, lambda: phaselens.repair_table(model, **kw, journal=journal),
                                       mod, "block_copy_logits", 3)
    (shard,) = resumed.metadata["shards"]
    assert shard["resumed"] == ["items 0-4", "items 5-9", "items 10-14"]
    assert resumed.metadata["arguments"]["journal"] == str(journal)
    assert resumed.rows.equals(plain.rows)
    assert list(resumed.evals) == list(plain.evals)
    for key, ev in plain.evals.items():
        assert resumed.evals[key].items.equals(ev.items), key
    for other in (dict(combines=("vote",)), dict(shift_sets=("all",)), dict(batch_size=6), dict(pad_id=1)):
        with pytest.raises(JournalError, match="different computation"):
            phaselens.repair_table(model, **{**kw, **other}, journal=journal)


# ---- every analysis with journal= resumes through the one pipeline --------------------------------------
RESUMABLE = {
    # analysis, its Analysis class (whose compute is interrupted), the result's per-item arrays to compare
    "evaluate": (lambda m, **k: phaselens.evaluate(m, **k, n_permutations=20, n_bootstrap=20),
                 "phaselens.analyses.evaluation:Evaluation", lambda r: r.items[["correct", "logit_diff", "nll"]]),
    "record": (lambda m, **k: phaselens.record(m, **k), "phaselens.analyses.recording:Record",
               lambda r: pd.concat([r.to_frame("residue"), r.to_frame("model")], ignore_index=True)),
    "attribution_map": (lambda m, **k: phaselens.attribution_map(m, **k, method="zero"),
                        "phaselens.analyses.attribution:Attribution", lambda r: r.to_frame("residue")),
    "gate_cycling_test": (lambda m, **k: phaselens.gate_cycling_test(m, **k, deltas=(1, -1), n_bootstrap=20),
                          "phaselens.analyses.cycling:GateCycling", lambda r: r.to_frame("phase")),
}


@pytest.mark.parametrize("name", list(RESUMABLE))
def test_every_journaled_analysis_resumes_to_the_uninterrupted_result(model, tmp_path, monkeypatch, name):
    run, where, frame = RESUMABLE[name]
    module, cls = where.split(":")
    analysis = getattr(importlib.import_module(module), cls)
    kw = dict(**KW, progress=False)
    plain = run(model, **kw)
    journal = tmp_path / f"{name}.journal"
    resumed = interrupted_then_resumed(monkeypatch, lambda: run(model, **kw, journal=journal), analysis, "compute", 2)
    (shard,) = [s for s in resumed.metadata["shards"] if s["resumed"]]
    assert len(shard["resumed"]) == 2 and shard["by_rank"][0]  # two units read back, the rest computed
    a, b = frame(plain), frame(resumed)
    assert list(a.columns) == list(b.columns)
    for col in a.columns:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if x.dtype.kind in "biuf":
            assert np.array_equal(x, y, equal_nan=True), col
        else:
            assert list(map(str, x)) == list(map(str, y)), col
    with pytest.raises(JournalError, match="different computation"):
        run(model, **{**kw, "seed": 1}, journal=journal)


@pytest.mark.parametrize("layout", ["w8s4-deepseek", "w8s4-peroffset"])
def test_record_resumes_bit_identically_on_every_gate_layout(tmp_path, monkeypatch, layout):
    """Vector and per-offset gates: a unit kept in memory held a strided gate profile, one read back from the
    journal a contiguous one, and numpy's float32 sums over them grouped their terms differently (1.9e-7)."""
    from tests.support.models import LAYOUTS

    model = task_model(LAYOUTS[layout])
    run, where, frame = RESUMABLE["record"]
    module, cls = where.split(":")
    kw = dict(**KW, progress=False)
    plain = run(model, **kw)
    resumed = interrupted_then_resumed(monkeypatch, lambda: run(model, **kw, journal=tmp_path / "r.journal"),
                                       getattr(importlib.import_module(module), cls), "compute", 2)
    a, b = frame(plain), frame(resumed)
    for col in a.columns:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if x.dtype.kind == "f":
            assert np.array_equal(x, y, equal_nan=True), col
    for name, values in plain.values.items():
        assert np.array_equal(values, resumed.values[name], equal_nan=True), name
