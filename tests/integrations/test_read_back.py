"""Reading lm-eval's samples back (issue 47, item 4): from the files lm-eval writes as from memory, and every way a
set of samples can be wrong for the battery refused with the reason."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import phaselens
from phaselens.errors import InputError, StatsInputError, TaskError, TokenizerMismatchError
from phaselens.integrations.lm_eval import PhaseLensLM, export_task, read_all, read_samples, stratify
from tests.support.lm_eval import bpe_tokenizer, evaluate, sharp_causal_lm, task_dir

BATTERY = {"n_permutations": 200, "n_bootstrap": 100}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """zoo:w8s4 on its exported default task, through lm-eval, with the samples written by lm-eval's tracker."""
    from lm_eval.loggers import EvaluationTracker

    root = tmp_path_factory.mktemp("read-back")
    model = phaselens.load("zoo:w8s4")
    export_task(None, root / "tasks", model=model, n_per_residue=1, seed=2)
    result = evaluate(PhaseLensLM(model=model, batch_size=32), ["phaselens_kv_recall", "phaselens_kv_recall_gen"],
                      include=root / "tasks")
    tracker = EvaluationTracker(output_path=str(root / "out"))
    tracker.general_config_tracker.model_name_sanitized = "zoo__w8s4"
    saved = copy.deepcopy(result)
    samples = saved.pop("samples")
    tracker.save_results_aggregated(results=saved, samples=samples)
    for task in saved["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    return result, root / "out"


def test_the_files_lm_eval_writes_read_back_as_the_samples_in_memory(exported):
    """lm-eval writes responses as strings (["-3.71", "False"]); read from its folder or from one file, the
    PhaseEval equals the one read from simple_evaluate's result."""
    result, out = exported
    mem = read_samples(result, task="phaselens_kv_recall", **BATTERY)
    disk = read_samples(out, task="phaselens_kv_recall", **BATTERY)
    (path,) = out.rglob("samples_phaselens_kv_recall_2*.jsonl")
    one = read_samples(path, **BATTERY)
    for ev in (disk, one):
        np.testing.assert_array_equal(ev.items["correct"], mem.items["correct"])
        np.testing.assert_allclose(ev.items["nll"], mem.items["nll"], rtol=1e-12)
        assert ev.gap == mem.gap and ev.gap_ci == mem.gap_ci
    assert disk.metadata["lm_eval"]["config"]["model"] == "PhaseLensLM"
    both = read_all(out, **BATTERY)
    assert sorted(both) == ["phaselens_kv_recall", "phaselens_kv_recall_gen"]
    with pytest.raises(InputError, match="several tasks"):
        read_samples(out)


def test_samples_the_battery_cannot_use_are_refused(exported):
    result, _ = exported
    samples = result["samples"]["phaselens_kv_recall"]
    plain = [{**s, "doc": {k: v for k, v in s["doc"].items() if k != "phaselens"}} for s in samples]
    with pytest.raises(TaskError, match=r"no phaselens record \(doc\['phaselens'\]\)"):
        read_samples(plain)
    with pytest.raises(TaskError, match=r"item \d+ appears twice at residue \d+"):
        read_samples(samples + samples[:1])
    other = copy.deepcopy(samples[:3])
    other[0]["doc"]["phaselens"]["stride"] = 8
    with pytest.raises(TaskError, match="mix tasks or geometries"):
        read_samples(other + samples[3:])
    with pytest.raises(InputError, match="no samples to read"):
        read_samples([])


def test_a_stratified_read_back_needs_a_right_or_wrong_metric(tmp_path):
    tasks = task_dir(tmp_path / "tasks", ("tiny_mc",))
    tok = bpe_tokenizer()
    result = evaluate(PhaseLensLM(model=sharp_causal_lm(), tokenizer=tok, stride=4),
                      [stratify(str(tasks / "tiny_mc.yaml"), tokenizer=tok, stride=4)])
    samples = result["samples"]["tiny_mc_phase4"]
    with pytest.raises(StatsInputError, match="no metric 'f1'"):
        read_samples(samples, metric="f1")
    scored = [{**s, "acc": 0.5} for s in samples]
    with pytest.raises(StatsInputError, match="not 0 or 1"):
        read_samples(scored)
    # a prompt that does not begin with its record's padding was not written by this design
    moved = copy.deepcopy(samples)
    moved[1]["arguments"] = [(moved[1]["arguments"][0][0].lstrip(" ."), " x")]
    with pytest.raises(TaskError, match="does not begin with the 1 filler unit"):
        read_samples(moved)
    # lm-eval's local-completions sends token ids without the BOS unless add_bos_token=True: every context then sat
    # one slot earlier than its record says
    bare = {**result, "config": {**result["config"], "model": "local-completions",
                                 "model_args": "base_url=http://x/v1/completions,tokenizer=t"}}
    with pytest.raises(TokenizerMismatchError, match="add_bos_token=True"):
        read_samples(bare, task="tiny_mc_phase4")
    ok = {**bare, "config": {**bare["config"], "model_args": "base_url=http://x/v1/completions,add_bos_token=True"}}
    assert len(read_samples(ok, task="tiny_mc_phase4", **BATTERY).items) == 48


def test_the_report_includes_read_back_evaluations(exported, tmp_path):
    """``phaselens.report(lm_eval=OUT)``: every phaselens task in lm-eval's folder gets the evaluation's figures
    and CSVs; with no models, nothing else is run."""
    _, out = exported
    path = phaselens.report(out=tmp_path / "report", lm_eval=out, static=False, progress=False)
    files = {p.name for p in path.iterdir()}
    for task in ("phaselens_kv_recall", "phaselens_kv_recall_gen"):
        assert f"lm-eval_{task}_per_residue.csv" in files and f"lm-eval_{task}_battery.csv" in files
    page = (path / "index.html").read_text()
    assert "lm-eval_phaselens_kv_recall: accuracy by phase" in page and "w8s4_head_map" not in page
    results = json.loads((path / "results.json").read_text())
    assert results["meta"]["models"] == ["lm-eval_phaselens_kv_recall", "lm-eval_phaselens_kv_recall_gen"]
