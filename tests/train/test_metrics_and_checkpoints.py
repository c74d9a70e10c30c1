"""The one trainer's interval metrics (``metrics.jsonl`` and the progress bar) and intermediate checkpoints that
load as models (``phaselens.train.load_checkpoint``), for the zoo and the family alike."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import phaselens
from phaselens.errors import CheckpointError, OutputError
from phaselens.train import load_checkpoint
from phaselens.train.family.costs import flops_per_token
from phaselens.train.family.trainer import read_log, train_family
from phaselens.train.loop import TrainSettings, train
from phaselens.train.metrics import postfix, read_metrics
from tests.support.family_worker import CFG as FAMILY_CFG
from tests.support.family_worker import DATA, settings
from tests.train.test_loop import CFG, batch_fn


def test_metrics_are_written_every_interval_with_the_numbers_of_the_steps(tmp_path):
    s = TrainSettings(steps=7, batch_size=8, warmup=2, checkpoint_every=100, threads=1)
    res = train(CFG, batch_fn, s, tmp_path, progress=False, log_every=3)
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [3, 6, 7]  # every 3 steps, and the last
    log = read_log(tmp_path)
    for r, (a, b) in zip(recs, [(0, 3), (3, 6), (6, 7)]):
        assert r["loss"] == pytest.approx(sum(log["loss"][a:b]) / (b - a), rel=1e-12)
        assert r["lr"] == s.lr_at(b - 1) == log["lr"][b - 1]
        assert r["grad_norm"] == log["grad_norm"][b - 1] and 0 < r["grad_norm"] < 100
        assert r["tokens_per_second"] > 0 and r["memory"] == "host" and r["peak_memory_gib"] > 0.05
        assert r["mfu"] is None  # no peak given (a CPU)
    tokens, targets = batch_fn(8, 0)
    n = sum(p.numel() for p in res.model.parameters())
    per_token = flops_per_token(CFG, n, res.model.embed.weight.numel(), seq=tokens.shape[1],
                                trained=float((targets != -100).sum()) / 8).model
    # the batches differ in trained positions per row; the TFLOP/s follow the count within that spread
    assert recs[0]["tflops"] == pytest.approx(recs[0]["tokens_per_second"] * per_token / 1e12, rel=0.2)
    assert res.losses == [round(x, 6) for x in log["loss"]]


def test_the_family_reports_mfu_against_the_peak_it_is_given(tmp_path):
    train_family(FAMILY_CFG, DATA, settings(4), tmp_path, progress=False, log_every=2, peak_tflops=0.01)
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [2, 4]
    assert all(r["mfu"] == pytest.approx(r["tflops"] / 0.01) for r in recs)
    bar = postfix(recs[-1], read_log(tmp_path))
    assert set(bar) == {"loss", "gnorm", "lr", "tok/s", "mem", "mfu"} and bar["mfu"].endswith("%")
    assert bar["loss"] == f"{read_log(tmp_path)['loss'][-1]:.4f}"


def test_a_resumed_run_keeps_each_step_once_in_the_metrics(tmp_path):
    s = TrainSettings(steps=8, batch_size=4, warmup=2, checkpoint_every=4, threads=1)

    def interrupted(b, seed):
        if seed == 6:  # the 7th step: after the checkpoint of step 4 and the metrics of steps 5 and 6
            raise KeyboardInterrupt
        return batch_fn(b, seed)

    with pytest.raises(KeyboardInterrupt):
        train(CFG, interrupted, s, tmp_path, progress=False, log_every=1)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    res = train(CFG, batch_fn, s, tmp_path, progress=False, log_every=1)
    assert res.resumed_from == 4
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))  # steps 5 and 6 once, from the rerun


def test_a_metrics_file_of_the_users_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("my notes\n")
    with pytest.raises(OutputError, match="phaselens did not write it"):
        train(CFG, batch_fn, TrainSettings(steps=2, batch_size=4, threads=1), tmp_path, progress=False)
    assert (tmp_path / "metrics.jsonl").read_text() == "my notes\n"


def _same(a, b) -> bool:
    return list(a.state_dict()) == list(b.state_dict()) and all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_an_intermediate_family_step_loads_as_a_model(tmp_path):
    """A run stopped at step 4 of 6 (a time limit, a preemption) gives a model: the committed step's weights,
    which phaselens.load reads back once saved."""
    first = train_family(FAMILY_CFG, DATA, settings(6), tmp_path / "run", progress=False, stop_after=4)
    assert first.model is None  # the run is not finished: no final model
    model = load_checkpoint(tmp_path / "run")
    assert model.training_step == 4 and not model.training
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step-000000004" / "rank0-of-1.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[f"model.{name}"]), name
    # the same weights as an uninterrupted 6-step run has at step 4 (one stopped there by stop_after)
    ref = train_family(FAMILY_CFG, DATA, settings(6), tmp_path / "ref", progress=False, stop_after=4)
    assert ref.model is None and _same(model, load_checkpoint(tmp_path / "ref" / "checkpoints" / "step-000000004"))
    # phaselens.load takes the run directory, its checkpoints folder or the step folder itself
    step = tmp_path / "run" / "checkpoints" / "step-000000004"
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoints", step):
        assert _same(phaselens.load(where), model), where
    model.save(tmp_path / "model")
    back = phaselens.load(tmp_path / "model")
    tokens = DATA.tasks[0].build(phaselens.PhaseSpec(4), n_per_residue=1).tokens
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))
        assert not torch.equal(model(tokens), model.__class__(FAMILY_CFG)(tokens))  # trained, not initial


def test_a_step_written_by_two_ranks_loads_as_one_model(tmp_path):
    from phaselens.train.family import checkpoints
    from tests.train.family.test_train import _split_as_ranks

    res = train_family(FAMILY_CFG, DATA, settings(3), tmp_path / "run", progress=False)
    root = tmp_path / "run" / "checkpoints"
    pointer = checkpoints.latest(root)
    shapes = {n: tuple(p.shape) for n, p in res.model.named_parameters()}
    full, log = checkpoints.load(root, pointer, 0, 1, shapes)
    parts = _split_as_ranks(full, shapes, 2)
    out = tmp_path / "two" / "checkpoints"
    for r in (1, 0):
        checkpoints.save(out, 3, r, 2, parts[r], {"fingerprint": pointer["fingerprint"],
                                                  "config": FAMILY_CFG.to_dict()}, log if r == 0 else None,
                         lambda: None)
    assert _same(load_checkpoint(tmp_path / "two"), res.model)


def test_the_zoo_loop_checkpoints_load_too_and_a_missing_step_is_named(tmp_path):
    s = TrainSettings(steps=6, batch_size=4, warmup=2, checkpoint_every=2, threads=1)
    res = train(CFG, batch_fn, s, tmp_path, progress=False, stop_after=4)
    assert _same(load_checkpoint(tmp_path), res.model)
    assert load_checkpoint(tmp_path, step=4).training_step == 4
    assert load_checkpoint(tmp_path, step=2).training_step == 2  # the step before the committed one is kept
    with pytest.raises(CheckpointError, match="holds no training step"):
        load_checkpoint(tmp_path, step=3)  # never committed
    with pytest.raises(CheckpointError, match="no committed training step"):
        load_checkpoint(tmp_path / "elsewhere")
    assert math.isfinite(json.loads((tmp_path / "log.json").read_text())["grad_norm"][-1])
