"""Issue 44 for training runs: a damaged rank file (its tail zeroed, its size kept) is refused on resume and on
load, naming the file and the intact earlier step (class 1); a metrics.jsonl cut mid-line resumes (class 5);
weights rewritten as integers are refused, not cast; ``load_checkpoint(run, step="2")`` works."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import phaselens
from phaselens.errors import CheckpointError, InputError
from phaselens.storage.reading import TornLineWarning
from phaselens.train import load_checkpoint
from phaselens.train.family.steps import StepFallbackWarning
from phaselens.train.loop import TrainSettings, train
from phaselens.train.metrics import METRICS, read_metrics
from tests.runtime.test_checksums import zero_tail
from tests.train.test_loop import CFG, batch_fn

S = TrainSettings(steps=8, batch_size=4, warmup=2, checkpoint_every=2, threads=1)


def step(run, n):
    return run / "checkpoints" / f"step-{n:09d}"


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 8-step run, and one stopped after step 4 (steps 2 and 4 are kept)."""
    base = tmp_path_factory.mktemp("runs")
    ref = train(CFG, batch_fn, S, base / "ref", progress=False)
    train(CFG, batch_fn, S, base / "stopped", progress=False, stop_after=4, log_every=1)
    return ref, base / "stopped"


@pytest.fixture
def stopped(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference[1], run)
    return run


def test_a_damaged_rank_file_is_named_on_resume_and_on_load_with_the_intact_step(stopped):
    assert sorted(p.name for p in (stopped / "checkpoints").glob("step-*")) == ["step-000000002", "step-000000004"]
    bad = step(stopped, 4) / "rank0-of-1.safetensors"
    zero_tail(bad)
    with pytest.raises(CheckpointError) as err:
        train(CFG, batch_fn, S, stopped, progress=False)  # before: resumed on the damaged weights
    msg = str(err.value)
    assert f"{bad} is damaged" in msg and "no longer match their sha256" in msg
    assert f"step 2 ({step(stopped, 2)}) is intact: delete {step(stopped, 4)} and run again" in msg
    for source in (step(stopped, 4), stopped):  # before: phaselens.load(step folder) loaded them
        with pytest.raises(CheckpointError, match=r"is damaged.*step 2 .* is intact: phaselens.train.load_checkpoint"):
            phaselens.load(source)
    assert load_checkpoint(stopped, step=2).training_step == 2  # the intact step, as the message says


def test_removing_the_damaged_step_resumes_from_the_intact_one_exactly(reference, stopped):
    ref, _ = reference
    zero_tail(step(stopped, 4) / "rank0-of-1.safetensors")
    shutil.rmtree(step(stopped, 4))  # what the message tells the user to do
    with pytest.warns(StepFallbackWarning, match="resuming from step 2"):
        res = train(CFG, batch_fn, S, stopped, progress=False, log_every=1)
    assert res.resumed_from == 2 and same(res.model, ref.model)  # bit-identical to the uninterrupted run
    assert [r["step"] for r in read_metrics(stopped)] == list(range(1, 9))


def test_without_an_earlier_intact_step_the_message_says_so(stopped):
    zero_tail(step(stopped, 2) / "rank0-of-1.safetensors")
    zero_tail(step(stopped, 4) / "rank0-of-1.safetensors")
    with pytest.raises(CheckpointError, match="no earlier intact step is kept: delete .* to restart from step 0"):
        train(CFG, batch_fn, S, stopped, progress=False)
    shutil.rmtree(step(stopped, 4))
    with pytest.raises(CheckpointError, match="is gone and no intact earlier step is kept"):
        train(CFG, batch_fn, S, stopped, progress=False)


def test_a_damaged_loss_log_of_the_step_is_named(stopped):
    log = step(stopped, 4) / "log.json"
    log.write_text(log.read_text().replace('"step": [1,', '"step": [7,'))  # still JSON, but not what was written
    with pytest.raises(CheckpointError, match=r"log.json is damaged: its bytes no longer match the sha256"):
        train(CFG, batch_fn, S, stopped, progress=False)


def test_a_step_written_by_two_ranks_checks_every_file_it_reads(tmp_path, reference):
    """Resharding reads row ranges of the saved ranks' files: each file it reads from is checked in full."""
    from phaselens.train.family import checkpoints
    from tests.train.family.test_train import _split_as_ranks

    root = reference[1] / "checkpoints"
    pointer = checkpoints.latest(root)
    model = load_checkpoint(reference[1])
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    full, log = checkpoints.load(root, pointer, 0, 1, shapes)
    parts = _split_as_ranks(full, shapes, 2)
    out = tmp_path / "two" / "checkpoints"
    for r in (1, 0):
        checkpoints.save(out, 4, r, 2, parts[r], {"fingerprint": pointer["fingerprint"], "config": CFG.to_dict()},
                         log if r == 0 else None, lambda: None)
    assert same(load_checkpoint(tmp_path / "two"), model)
    zero_tail(out / "step-000000004" / "rank1-of-2.safetensors")
    with pytest.raises(CheckpointError, match=r"rank1-of-2.safetensors is damaged.*no earlier intact step"):
        load_checkpoint(tmp_path / "two")


def test_weights_rewritten_as_integers_are_refused_not_cast(stopped):
    path = step(stopped, 4) / "rank0-of-1.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = {k: v for k, v in f.metadata().items() if k == "format" or k == "meta"}  # no checksums
    tensors = load_file(str(path))
    save_file({k: v.to(torch.int32) if k.startswith("model.") else v for k, v in tensors.items()}, str(path),
              metadata=header)
    with pytest.raises(CheckpointError, match=r"not floating point: model\..* \(int32\)"):
        load_checkpoint(step(stopped, 4))
    with pytest.raises(CheckpointError, match="not floating point"):
        train(CFG, batch_fn, S, stopped, progress=False)


@pytest.mark.parametrize("given", [4, "4", "step-4", "step-000000004", " 4 "])
def test_a_step_may_be_given_as_a_number_or_a_folder_name(reference, given):
    assert load_checkpoint(reference[1], step=given).training_step == 4


@pytest.mark.parametrize("given", ["two", "-2", -2, 2.5, True, "step-", "4.0"])
def test_a_step_that_is_not_one_is_an_input_error(reference, given):
    with pytest.raises(InputError, match=r"is not a training step: pass a non-negative int"):
        load_checkpoint(reference[1], step=given)


# ---- class 5: metrics.jsonl cut mid-line by a kill ------------------------------------------------------------
def test_a_metrics_file_cut_mid_line_resumes_with_a_warning(reference, stopped):
    path = stopped / METRICS
    text = path.read_text()
    path.write_text(text + '{"step": 5, "loss": 2.3, "grad_n')  # a kill while step 5's record was appended
    with pytest.warns(TornLineWarning, match="cut short"):
        res = train(CFG, batch_fn, S, stopped, progress=False, log_every=1)
    assert res.resumed_from == 4 and same(res.model, reference[0].model)
    assert [r["step"] for r in read_metrics(stopped)] == [1, 2, 3, 4, 5, 6, 7, 8]  # step 5 once, rewritten


def test_a_metrics_line_damaged_before_the_last_is_named(stopped):
    path = stopped / METRICS
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CheckpointError, match=r"metrics.jsonl is damaged: line 3 is not JSON.*move .* away"):
        train(CFG, batch_fn, S, stopped, progress=False)
