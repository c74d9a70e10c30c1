"""Fault tests for every file phaselens writes: a real process is SIGKILLed while writing (at a random moment,
or at a named point such as between two renames); afterwards the previous or the new complete version is
there and loads, and no user file was touched.

The writer runs in a forked child (no interpreter start-up, so each kill takes well under a second); the
child uses one thread, so its torch work never meets the parent's thread pool. The long randomized run is
``slow``.
"""

from __future__ import annotations

import io
import json
import os
import random
import select
import signal
import time
from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest
import torch

import phaselens
import phaselens.runtime.files as files
from phaselens.presentation.reporting.write import write_report
from phaselens.runtime.checkpoints import ResultCache, safetensors_metadata
from phaselens.runtime.files import recover_dir
from phaselens.train.loop import TrainSettings, train
from tests.conftest import LAYOUTS, make_model, task_model

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fault tests fork a writer")


# ---- the harness ------------------------------------------------------------------------------------------
def run_child(work: Callable[[Callable[[], None]], None], *, die_at: str | None = None, nth: int = 1) -> tuple[int, int]:
    """Fork a child that runs ``work(tick)``; ``tick()`` tells the parent a complete write exists. With
    ``die_at`` the child SIGKILLs itself the ``nth`` time a writer passes that fault point."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(rfd)
            torch.set_num_threads(1)
            if die_at is not None:
                seen = [0]

                def hook(point: str) -> None:
                    if point == die_at:
                        seen[0] += 1
                        if seen[0] == nth:
                            os.kill(os.getpid(), signal.SIGKILL)

                files.FAULT_HOOK = hook
            work(lambda: os.write(wfd, b"."))
        except BaseException:  # noqa: BLE001 - report and exit: the child must not run pytest's teardown
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(wfd)
    LIVE.add(pid)
    return pid, rfd


LIVE: set[int] = set()  # children not yet reaped


@pytest.fixture(autouse=True)
def reap_children():
    """A failing assertion must not leave a writer running: kill and reap whatever a test left."""
    yield
    for pid in list(LIVE):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        LIVE.discard(pid)


def wait_ticks(rfd: int, n: int, timeout: float = 120.0) -> int:
    """Block until at least ``n`` ticks arrived (or the child ended); returns how many arrived (one read can
    bring several)."""
    got, deadline = 0, time.time() + timeout
    while got < n and time.time() < deadline:
        ready, _, _ = select.select([rfd], [], [], 0.5)
        if ready:
            data = os.read(rfd, 64)
            if not data:
                break  # the child closed the pipe: it ended
            got += len(data)
    return got


def finish(pid: int, rfd: int, *, kill_after: float | None) -> str:
    """Kill the child ``kill_after`` seconds from now (None: wait for it to kill itself); returns how it ended:
    ``"killed"`` (SIGKILL) or ``"done"`` (it finished its work first)."""
    if kill_after is not None:
        time.sleep(kill_after)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    LIVE.discard(pid)
    os.close(rfd)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return "killed"
    assert os.WEXITSTATUS(status) == 0, "the writer failed before it was killed"
    return "done"


def snapshot(path):
    st = path.stat()
    return path.read_bytes(), st.st_ino, st.st_mtime_ns


def user_files(folder):
    """Files of a user's next to phaselens's output, and their snapshots (bytes, inode, mtime)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "results.csv").write_text("a,b\n1,2\n")
    return {p: snapshot(p) for p in (folder / "notes.txt", folder / "results.csv")}


def untouched(saved):
    return all(snapshot(p) == s for p, s in saved.items())


def no_temporaries(folder):
    names = [p.name for p in folder.rglob("*")]
    return not [n for n in names if n.startswith((files.STAGE, files.COMMITTED, files.DONE)) or ".tmp-" in n]


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the forked writer's thread count: bit-identical resumes need the same
    yield
    torch.set_num_threads(threads)


# ---- model checkpoints ------------------------------------------------------------------------------------
MODELS = [make_model(LAYOUTS["w4s4-scalar"]), make_model(LAYOUTS["w4s4-scalar"], seed=7)]
CARDS = [None, {"which": "b"}]  # the second version has a card: a mix of versions would show


def model_writer(target):
    def work(tick):
        for i in range(10_000):
            MODELS[i % 2].save(target, metadata=CARDS[i % 2], overwrite=True)
            tick()
    return work


def check_model_dir(target, saved):
    loaded = phaselens.load(target)  # completes an interrupted update by itself
    version = 0 if same_weights(loaded, MODELS[0]) else 1
    assert same_weights(loaded, MODELS[version]), "the checkpoint is neither version"
    assert loaded.metadata == (CARDS[version] or {})
    assert untouched(saved)
    MODELS[1].save(target, metadata=CARDS[1], overwrite=True)  # the next write cleans up after the dead one
    assert no_temporaries(target.parent)


@pytest.mark.parametrize("seed", [0, 1])
def test_model_save_killed_at_a_random_moment(tmp_path, seed):
    target = tmp_path / "ckpt"
    saved = user_files(target)
    pid, rfd = run_child(model_writer(target))
    assert wait_ticks(rfd, 1 + seed) >= 1
    assert finish(pid, rfd, kill_after=random.Random(seed).uniform(0, 0.05)) == "killed"
    check_model_dir(target, saved)


@pytest.mark.parametrize(("point", "nth"), [("dir:written", 2), ("dir:committed", 2), ("dir:moved", 4),
                                            ("dir:moved", 5)])
def test_model_save_killed_at_a_fault_point(tmp_path, point, nth):
    # dir:moved 4 and 5: after the commit, between the renames that move the files into place
    target = tmp_path / "ckpt"
    saved = user_files(target)
    pid, rfd = run_child(model_writer(target), die_at=point, nth=nth)
    assert finish(pid, rfd, kill_after=None) == "killed"
    check_model_dir(target, saved)


def test_a_new_checkpoint_killed_before_its_rename_does_not_appear(tmp_path):
    target = tmp_path / "new"
    pid, rfd = run_child(model_writer(target), die_at="dir:written", nth=1)
    assert finish(pid, rfd, kill_after=None) == "killed"
    assert not target.exists() and not no_temporaries(tmp_path)  # only a hidden stage of the dead writer
    MODELS[0].save(target)
    assert same_weights(phaselens.load(target), MODELS[0]) and no_temporaries(tmp_path)


# ---- the report -------------------------------------------------------------------------------------------
def report_writer(out):
    def work(tick):
        for i in range(10_000):
            v = "AB"[i % 2]
            write_report(out, f"<html>{v * 20000}</html>", [], [], {"version": v}, static=False,
                         static_note_fn=None, overwrite=True)
            tick()
    return work


def check_report(out, saved):
    recover_dir(out)  # what the next write does first
    version = json.loads((out / "results.json").read_text())["meta"]["version"]
    assert (out / "index.html").read_text() == f"<html>{version * 20000}</html>"  # one version, not a mix
    assert untouched(saved) and no_temporaries(out)


@pytest.mark.parametrize("mode", ["random", "dir:moved", "dir:written"])
def test_report_killed(tmp_path, mode):
    out = tmp_path / "report"
    saved = user_files(out)
    if mode == "random":
        pid, rfd = run_child(report_writer(out))
        assert wait_ticks(rfd, 1) >= 1
        assert finish(pid, rfd, kill_after=random.Random(3).uniform(0, 0.05)) == "killed"
    else:
        pid, rfd = run_child(report_writer(out), die_at=mode, nth=3)
        assert finish(pid, rfd, kill_after=None) == "killed"
    check_report(out, saved)


# ---- map checkpoints --------------------------------------------------------------------------------------
MAP_KW = dict(n_per_residue=2, progress=False, engine="suffix", n_bootstrap=0, rows_per_pass=16, method="zero",
              kinds=("head", "layer"))  # 10 cells, one per flush


@pytest.fixture(scope="module")
def map_model():
    return task_model()


@pytest.fixture(scope="module")
def fresh_map(map_model):
    return phaselens.specialization_map(map_model, **MAP_KW)


def map_writer(model, ckpt):
    def work(tick):
        files.FAULT_HOOK = _chain(files.FAULT_HOOK, lambda p: tick() if p == "file:replaced" else None)
        phaselens.specialization_map(model, checkpoint=ckpt, **MAP_KW)
    return work


def _chain(first, second):
    def hook(point):
        if first is not None:
            first(point)
        second(point)
    return hook


@pytest.mark.parametrize("mode", ["random", "file:written", "file:replaced"])
def test_map_checkpoint_killed(tmp_path, map_model, fresh_map, mode):
    ckpt = tmp_path / "map.ckpt"
    saved = user_files(tmp_path)
    if mode == "random":
        pid, rfd = run_child(map_writer(map_model, ckpt))
        wait_ticks(rfd, 1)
        ended = finish(pid, rfd, kill_after=random.Random(5).uniform(0, 0.1))
    else:
        pid, rfd = run_child(map_writer(map_model, ckpt), die_at=mode, nth=4)
        ended = finish(pid, rfd, kill_after=None)
        assert ended == "killed"
    manifest = json.loads(safetensors_metadata(ckpt, fix="")["manifest"])  # a complete file: its header reads
    assert len(manifest["cells"]) >= {"file:written": 3, "file:replaced": 4, "random": 1}[mode]
    assert mode == "random" or len(manifest["cells"]) < 10  # really interrupted (10 cells in all)
    resumed = phaselens.specialization_map(map_model, checkpoint=ckpt, **MAP_KW)
    assert np.array_equal(resumed.ko_correct, fresh_map.ko_correct)
    assert np.array_equal(resumed.ko_logit_diff, fresh_map.ko_logit_diff)
    assert untouched(saved) and no_temporaries(tmp_path)


# ---- the repair cache -------------------------------------------------------------------------------------
RESULTS = [{"section": "A" * 300_000, "seconds": 1.0}, {"section": "B" * 300_000, "seconds": 2.0}]


def cache_writer(folder):
    def work(tick):
        cache = ResultCache(folder)
        for i in range(10_000):
            cache.put("w4s4", "fp", RESULTS[i % 2])
            tick()
    return work


@pytest.mark.parametrize("mode", ["random", "file:written"])
def test_repair_cache_killed(tmp_path, mode):
    folder = tmp_path / "repair_docs"
    saved = user_files(folder)
    if mode == "random":
        pid, rfd = run_child(cache_writer(folder))
        assert wait_ticks(rfd, 1) >= 1
        assert finish(pid, rfd, kill_after=random.Random(7).uniform(0, 0.05)) == "killed"
    else:
        pid, rfd = run_child(cache_writer(folder), die_at=mode, nth=2)
        assert finish(pid, rfd, kill_after=None) == "killed"
    assert ResultCache(folder).get("w4s4", "fp") in RESULTS  # never a miss or a mix after a complete write
    assert untouched(saved)
    ResultCache(folder).put("w4s4", "fp", RESULTS[0])
    assert no_temporaries(folder)


# ---- training state ---------------------------------------------------------------------------------------
TRAIN = TrainSettings(steps=10, batch_size=4, lr=3e-3, warmup=2, checkpoint_every=1, threads=1)


def batch_fn(b, seed):
    from tests.conftest import tiny_task

    return tiny_task().sample_training_batch(b, seed)


def train_writer(run):
    from tests.test_train import CFG

    def work(tick):
        files.FAULT_HOOK = _chain(files.FAULT_HOOK, lambda p: tick() if p == "file:replaced" else None)
        train(CFG, batch_fn, TRAIN, run, progress=False)
    return work


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    from tests.test_train import CFG

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(CFG, batch_fn, TRAIN, tmp_path_factory.mktemp("ref"), progress=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["random", "between"])
def test_train_state_killed(tmp_path, reference_run, one_thread, mode):
    from tests.test_train import CFG

    run = tmp_path / "run"
    saved = user_files(run)
    if mode == "random":
        pid, rfd = run_child(train_writer(run))
        wait_ticks(rfd, 2)
        finish(pid, rfd, kill_after=random.Random(11).uniform(0, 0.2))
    else:  # between the weights' replace and the JSON copy's replace, at step 3
        pid, rfd = run_child(train_writer(run), die_at="file:replaced", nth=5)
        assert finish(pid, rfd, kill_after=None) == "killed"
        assert json.loads((run / "train_state.json").read_text())["step"] == 2  # the copy lags one checkpoint
    resumed = train(CFG, batch_fn, TRAIN, run, progress=False)
    if mode == "between":
        assert resumed.resumed_from == 3  # the weights file is the truth
    assert same_weights(resumed.model, reference_run.model) and resumed.losses == reference_run.losses
    assert untouched(saved) and no_temporaries(run)


# ---- CSV files of the command line (eval/record/map --out) ------------------------------------------------
CSVS = ["residue,value\n" + "1,A\n" * 40_000, "residue,value\n" + "2,B\n" * 60_000]


def csv_writer(path):
    from phaselens.presentation.cli import write_csv

    frames = [pd.read_csv(io.StringIO(text)) for text in CSVS]

    def work(tick):
        for i in range(10_000):
            write_csv(frames[i % 2], path)
            tick()
    return work


@pytest.mark.parametrize("mode", ["random", "file:written"])
def test_cli_csv_killed(tmp_path, mode):
    path = tmp_path / "eval.csv"
    saved = user_files(tmp_path)
    if mode == "random":
        pid, rfd = run_child(csv_writer(path))
        assert wait_ticks(rfd, 1) >= 1
        assert finish(pid, rfd, kill_after=random.Random(13).uniform(0, 0.05)) == "killed"
    else:
        pid, rfd = run_child(csv_writer(path), die_at=mode, nth=2)
        assert finish(pid, rfd, kill_after=None) == "killed"
    assert path.read_text() in CSVS  # one complete version, never a truncated one
    assert untouched(saved)
    from phaselens.presentation.cli import write_csv

    write_csv(pd.read_csv(io.StringIO(CSVS[0])), path)  # the next write cleans up after the dead one
    assert path.read_text() == CSVS[0] and no_temporaries(tmp_path)


# ---- the long randomized run ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("writer", ["model", "report", "cache", "csv"])
def test_many_random_kills(tmp_path, writer):
    rng = random.Random(2024)
    target = tmp_path / "out"
    saved = user_files(target)
    for _ in range(25):
        work = {"model": model_writer, "report": report_writer, "cache": cache_writer,
                "csv": lambda t: csv_writer(t / "out.csv")}[writer](target)
        pid, rfd = run_child(work)
        assert wait_ticks(rfd, 1) >= 1
        assert finish(pid, rfd, kill_after=rng.uniform(0, 0.05)) == "killed"
        if writer == "model":
            check_model_dir(target, saved)
        elif writer == "report":
            check_report(target, saved)
        elif writer == "csv":
            assert (target / "out.csv").read_text() in CSVS and untouched(saved)
        else:
            assert ResultCache(target).get("w4s4", "fp") in RESULTS and untouched(saved)
