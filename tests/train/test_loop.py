"""Training: deterministic, checkpointed atomically, and bit-identical after a SIGKILL and resume."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import phaselens
from phaselens.errors import CheckpointError
from phaselens.models import CompressedConfig, CompressorSpec
from phaselens.tasks import KVRecall
from phaselens.train.loop import TrainSettings, train
from tests.support.paths import ROOT

TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)
CFG = CompressedConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=TASK.vocab_size, n_ctx=128,
                       local_window=4, compression=CompressorSpec(4))
SETTINGS = TrainSettings(steps=40, batch_size=8, lr=3e-3, warmup=5, checkpoint_every=4, threads=1)


def batch_fn(b, seed):
    return TASK.sample_training_batch(b, seed)


SCRIPT = """
import sys
from tests.train.test_loop import CFG, SETTINGS, batch_fn
from phaselens.train.loop import train
train(CFG, batch_fn, SETTINGS, {run!r}, progress=False)
"""


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    ref = train(CFG, batch_fn, SETTINGS, tmp_path / "ref", progress=False)
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(run=str(run))], cwd=ROOT,  # finds tests/
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    state = run / "checkpoints" / "latest.json"  # the committed step
    deadline = time.time() + 120
    while time.time() < deadline:  # kill mid-run, once a checkpoint past the first few steps exists
        if state.exists() and json.loads(state.read_text())["step"] >= 12:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = json.loads(state.read_text())["step"]
    assert 12 <= killed_at < SETTINGS.steps  # really interrupted
    resumed = train(CFG, batch_fn, SETTINGS, run, progress=False)
    assert resumed.resumed_from == killed_at
    for (name, a), b in zip(ref.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.losses == ref.losses


def test_same_seed_same_model_and_other_settings_refused(tmp_path):
    a = train(CFG, batch_fn, TrainSettings(steps=6, batch_size=4, checkpoint_every=3, threads=1), tmp_path / "a",
              progress=False)
    b = train(CFG, batch_fn, TrainSettings(steps=6, batch_size=4, checkpoint_every=3, threads=1), tmp_path / "b",
              progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))
    with pytest.raises(CheckpointError, match="other settings: the TrainSettings differ"):
        train(CFG, batch_fn, TrainSettings(steps=7, batch_size=4, checkpoint_every=3, threads=1), tmp_path / "a",
              progress=False)


def test_checkpoints_are_safetensors_and_json(tmp_path):
    train(CFG, batch_fn, TrainSettings(steps=3, batch_size=4, checkpoint_every=3, threads=1), tmp_path, progress=False)
    # the family's format (one trainer): a committed step of per-rank safetensors, the loss log, the metrics
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()
                   and p.name != ".phaselens-manifest.json")
    assert files == ["checkpoints/latest.json", "checkpoints/step-000000003/log.json",
                     "checkpoints/step-000000003/rank0-of-1.safetensors", "log.json", "metrics.jsonl"]
    meta = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1
    assert len(json.loads((tmp_path / "log.json").read_text())["loss"]) == 3


def test_step_aware_batches_for_curricula(tmp_path):
    seen = []

    class Staged:
        uses_step = True

        def __call__(self, b, seed, step):
            seen.append(step)
            return batch_fn(b, seed)

    train(CFG, Staged(), TrainSettings(steps=4, batch_size=2, checkpoint_every=4, threads=1, curriculum="staged"),
          tmp_path, progress=False)
    # the run's data fingerprint samples steps 0, 1, 2, 3 (first, quartiles, last) first; then training asks in order
    assert seen == [0, 1, 2, 3, 0, 1, 2, 3]


def test_training_time_accumulates_over_resumes(tmp_path):
    first = train(CFG, batch_fn, SETTINGS, tmp_path / "run", progress=False, stop_after=4)
    second = train(CFG, batch_fn, SETTINGS, tmp_path / "run", progress=False, stop_after=8)
    assert second.resumed_from == 4
    assert first.seconds is not None and second.seconds is not None and second.seconds > first.seconds


SMALL = TrainSettings(steps=4, batch_size=4, checkpoint_every=2, threads=1)


def other_task_batches(b, seed):
    return KVRecall(n_records=6, block_filler=5, n_demos=2, min_distance=8, modulus=8).sample_training_batch(b, seed)


def test_resume_with_other_data_or_initial_weights_is_refused(tmp_path):
    # the same config and settings, but another batch_fn (task) or init_fn: resuming would mix two runs
    train(CFG, batch_fn, SMALL, tmp_path, progress=False, stop_after=2)
    with pytest.raises(CheckpointError, match="batch_fn gives other batches"):
        train(CFG, other_task_batches, SMALL, tmp_path, progress=False)

    def plant(model):
        with torch.no_grad():
            model.blocks[0].attn.W_Q.zero_()

    with pytest.raises(CheckpointError, match="initial weights differ"):
        train(CFG, batch_fn, SMALL, tmp_path, progress=False, init_fn=plant)
    assert train(CFG, batch_fn, SMALL, tmp_path, progress=False).resumed_from == 2  # the right run resumes


def test_a_state_whose_fingerprint_lacks_fields_is_refused(tmp_path):
    from phaselens.storage.writing import write_owned_file

    train(CFG, batch_fn, SMALL, tmp_path, progress=False, stop_after=2)
    path = tmp_path / "checkpoints" / "latest.json"
    meta = json.loads(path.read_text())
    del meta["fingerprint"]["data"], meta["fingerprint"]["init"]
    write_owned_file(path, lambda tmp: tmp.write_text(json.dumps(meta)), by="training run")
    with pytest.raises(CheckpointError, match="other settings: batch_fn gives other batches"):
        train(CFG, batch_fn, SMALL, tmp_path, progress=False)


@pytest.mark.parametrize("damage", ["truncate", "random", "header_meta"])
def test_a_damaged_state_names_the_fix(tmp_path, damage):
    train(CFG, batch_fn, SMALL, tmp_path, progress=False, stop_after=2)
    path = tmp_path / "checkpoints" / "step-000000002" / "rank0-of-1.safetensors"
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 3])
    elif damage == "random":
        path.write_bytes(os.urandom(len(raw)))
    else:
        from safetensors.torch import load_file, save_file

        from phaselens.train.family.checkpoints import FORMAT

        save_file(load_file(str(path)), str(path), metadata={"format": FORMAT, "meta": '{"step": 2, "loss'})
    with pytest.raises(CheckpointError, match="restart from step 0"):
        train(CFG, batch_fn, SMALL, tmp_path, progress=False)


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("notes")
    with pytest.raises(phaselens.errors.OutputError, match="is a file"):
        train(CFG, batch_fn, SMALL, tmp_path / "run", progress=False)
    assert (tmp_path / "run").read_text() == "notes"


def test_a_batch_with_no_trained_position_warns_and_is_skipped(tmp_path):
    from phaselens.train.loop import EmptyTargetsWarning

    def sometimes_empty(b, seed):
        tokens, targets = batch_fn(b, seed)
        return tokens, (torch.full_like(targets, -100) if seed % 2 else targets)

    with pytest.warns(EmptyTargetsWarning, match="every target of the batch is -100") as rec:
        res = train(CFG, sometimes_empty, SMALL, tmp_path, progress=False)
    # pytest.warns records every warning raised meanwhile (a ResourceWarning from an earlier test's garbage, say)
    empty = [str(w.message).split(":")[0] for w in rec if issubclass(w.category, EmptyTargetsWarning)]
    assert empty == ["step 1", "step 3"]
    assert [math.isnan(x) for x in res.losses] == [False, True, False, True]
    assert all(bool(torch.isfinite(p).all()) for p in res.model.parameters())  # no NaN gradient was applied


@pytest.mark.parametrize(("field", "value"), [
    ("eval_every", 0), ("threads", 0), ("threads", -1), ("lr", float("nan")), ("lr", float("inf")), ("lr", 0),
    ("steps", 1.5), ("batch_size", 0), ("warmup", -1), ("seed", -1), ("grad_clip", 0), ("weight_decay", -0.1),
    ("checkpoint_every", 0), ("threads", 1.5), ("curriculum", None), ("steps", True),
])
def test_bad_train_settings_name_the_field(field, value):
    with pytest.raises(phaselens.errors.ConfigError, match=rf"TrainSettings\.{field} must be"):
        TrainSettings(**{field: value})


def test_numpy_ints_are_ints():
    import numpy as np

    s = TrainSettings(steps=np.int64(3), batch_size=np.int32(2), threads=np.int64(1))
    assert type(s.steps) is int and s.steps == 3 and type(s.threads) is int
