"""Training: deterministic, checkpointed atomically, and bit-identical after a SIGKILL and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phaselens.errors import CheckpointError
from phaselens.models import CompressedConfig, CompressorSpec
from phaselens.tasks import KVRecall
from phaselens.train import TrainSettings, train

TASK = KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8)
CFG = CompressedConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=TASK.vocab_size, n_ctx=128,
                       local_window=4, compression=CompressorSpec(4))
SETTINGS = TrainSettings(steps=40, batch_size=8, lr=3e-3, warmup=5, checkpoint_every=4, threads=1)


def batch_fn(b, seed):
    return TASK.sample_training_batch(b, seed)


SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.test_train import CFG, SETTINGS, batch_fn
from phaselens.train import train
train(CFG, batch_fn, SETTINGS, {run!r}, progress=False)
"""


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    ref = train(CFG, batch_fn, SETTINGS, tmp_path / "ref", progress=False)
    run = tmp_path / "killed"
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=root, run=str(run))],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    state = run / "train_state.json"
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
    with pytest.raises(CheckpointError, match="different settings"):
        train(CFG, batch_fn, TrainSettings(steps=7, batch_size=4, checkpoint_every=3, threads=1), tmp_path / "a",
              progress=False)


def test_checkpoints_are_safetensors_and_json(tmp_path):
    train(CFG, batch_fn, TrainSettings(steps=3, batch_size=4, checkpoint_every=3, threads=1), tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_state.json", "train_state.safetensors"]
    meta = json.loads((tmp_path / "train_state.json").read_text())
    assert meta["step"] == 3 and len(meta["losses"]) == 3


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
