"""Fault tests for every file phaselens writes: a real process is SIGKILLed while writing (at a random moment,
or at a named point such as between two renames); afterwards the previous or the new complete version is
there and loads, and no user file was touched.

The writer runs in a forked child (no interpreter start-up, so each kill takes well under a second); the
child uses one thread, so its torch work never meets the parent's thread pool. The long randomized run is
``slow``.
"""

from __future__ import annotations

import errno
import io
import json
import os
import random
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import phaselens
import phaselens.storage.writing as files
from phaselens.presentation.reporting.write import write_report
from phaselens.storage.resumable import ResultCache, safetensors_metadata
from phaselens.storage.writing import recover_dir
from phaselens.train.loop import TrainSettings, train
from tests.support.models import LAYOUTS, make_model, task_model

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


# ---- map journals --------------------------------------------------------------------------------------
MAP_KW = dict(n_per_residue=2, progress=False, engine="suffix", n_bootstrap=0, rows_per_pass=16, method="zero",
              kinds=("head", "layer"))  # 10 cells, one per flush


@pytest.fixture(scope="module")
def map_model():
    return task_model()


@pytest.fixture(scope="module")
def fresh_map(map_model):
    return phaselens.specialization_map(map_model, **MAP_KW)


def map_writer(model, journal):
    def work(tick):
        files.FAULT_HOOK = _chain(files.FAULT_HOOK, lambda p: tick() if p == "file:replaced" else None)
        phaselens.specialization_map(model, journal=journal, **MAP_KW)
    return work


def _chain(first, second):
    def hook(point):
        if first is not None:
            first(point)
        second(point)
    return hook


@pytest.mark.parametrize("mode", ["random", "file:written", "file:replaced"])
def test_map_journal_killed(tmp_path, map_model, fresh_map, mode):
    journal = tmp_path / "map.journal"
    saved = user_files(tmp_path)
    if mode == "random":
        pid, rfd = run_child(map_writer(map_model, journal))
        wait_ticks(rfd, 1)
        ended = finish(pid, rfd, kill_after=random.Random(5).uniform(0, 0.1))
    else:
        pid, rfd = run_child(map_writer(map_model, journal), die_at=mode, nth=4)
        ended = finish(pid, rfd, kill_after=None)
        assert ended == "killed"
    manifest = json.loads(safetensors_metadata(journal, fix="")["manifest"])  # a complete file: its header reads
    assert len(manifest["cells"]) >= {"file:written": 3, "file:replaced": 4, "random": 1}[mode]
    assert mode == "random" or len(manifest["cells"]) < 10  # really interrupted (10 cells in all)
    resumed = phaselens.specialization_map(map_model, journal=journal, **MAP_KW)
    assert np.array_equal(resumed.correct_ko, fresh_map.correct_ko)
    assert np.array_equal(resumed.logit_diff_ko, fresh_map.logit_diff_ko)
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
    from tests.support.models import tiny_task

    return tiny_task().sample_training_batch(b, seed)


def train_writer(run):
    from tests.train.test_loop import CFG

    def work(tick):
        files.FAULT_HOOK = _chain(files.FAULT_HOOK, lambda p: tick() if p == "file:replaced" else None)
        train(CFG, batch_fn, TRAIN, run, progress=False)
    return work


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    from tests.train.test_loop import CFG

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(CFG, batch_fn, TRAIN, tmp_path_factory.mktemp("ref"), progress=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["random", "between"])
def test_train_state_killed(tmp_path, reference_run, one_thread, mode):
    from tests.train.test_loop import CFG

    run = tmp_path / "run"
    saved = user_files(run)
    if mode == "random":
        pid, rfd = run_child(train_writer(run))
        wait_ticks(rfd, 2)
        finish(pid, rfd, kill_after=random.Random(11).uniform(0, 0.2))
    else:  # between step 3's rank file and its commit: replaces 1 metrics.jsonl, then per step the rank file,
        # the step's log.json, latest.json and the run's log.json (the 10th: step 3's rank file)
        pid, rfd = run_child(train_writer(run), die_at="file:replaced", nth=10)
        assert finish(pid, rfd, kill_after=None) == "killed"
        assert (run / "checkpoints" / "step-000000003" / "rank0-of-1.safetensors").is_file()
        assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 2  # not committed
    resumed = train(CFG, batch_fn, TRAIN, run, progress=False)
    if mode == "between":
        assert resumed.resumed_from == 2  # the pointer is the truth: a step it does not name is ignored
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


# ---- ownership: no writer touches a file phaselens did not write (issue 24) --------------------------------
def _pngs(secs, folder):
    folder.mkdir(exist_ok=True)
    (folder / "top.png").write_bytes(b"\x89PNG top")
    (folder / "map.png").write_bytes(b"\x89PNG map")
    return "two PNGs"


def _frame():
    return pd.DataFrame({"residue": [0, 1], "value": [0.5, 0.25]})


def _write_model(d, overwrite):
    MODELS[0].save(d, metadata=CARDS[1], overwrite=overwrite)


def _write_report(d, overwrite):
    write_report(d, "<html>r</html>", [], [], {"v": 1}, static=True, static_note_fn=_pngs, overwrite=overwrite)


def _write_csv(d, overwrite):
    from phaselens.presentation.cli import write_csv

    write_csv(_frame(), d / "out.csv", force=overwrite)


def _write_journal(d, overwrite):
    from phaselens.storage.journal import CellJournal

    journal = CellJournal(d / "map.journal", "fp", ("a",))
    journal.add("L0H0", np.arange(3))
    journal.flush()


def _write_cache(d, overwrite):
    ResultCache(d).put("w4s4", "fp", {"x": 1})


def _write_zoo_dir(d, overwrite):
    from phaselens.train.zoo_training import save_zoo_model
    from tests.support.models import tiny_task

    batch = tiny_task().build(phaselens.PhaseSpec(4), n_per_residue=1, seed=0)
    save_zoo_model(d, MODELS[0], batch, {"name": "w4s4"}, overwrite=overwrite)


def _write_result(d, overwrite):
    from phaselens.results.gate_cycling import PhaseGateCycling

    frame = pd.DataFrame({"delta": [1], "phase": [0], "observed": [0.5], "predicted": [0.5], "boundary": [False]})
    PhaseGateCycling(frame, 0.5, 0.5, {1: 0.5}, np.ones(4), 4).save(d / "result.phaselens", overwrite=overwrite)


def _write_training_run(d, overwrite):
    """The family trainer's writes into its run directory, in its order: the pre-flight check, two
    committed steps (the second cleans up the first) and the run's loss log. ``--force`` does not reach here:
    a run directory is never overwritten."""
    from phaselens.train.family import checkpoints as ckpt

    ckpt.check_run_dir(d)
    for step in (1, 2):
        log = {"format": "phaselens.train_log/1", "step": list(range(1, step + 1))}
        ckpt.save(d / "checkpoints", step, 0, 1, {"model.w": torch.full((2,), float(step))}, {"fingerprint": "fp"},
                  log, lambda: None)
        ckpt.write_log(d / "log.json", log)


WRITERS = {"result": _write_result, "training_run": _write_training_run, "model": _write_model, "report": _write_report, "csv": _write_csv, "journal": _write_journal,
           "cache": _write_cache, "zoo": _write_zoo_dir}
NAMES = ["notes.txt", "figures/mine.png", "figures/top.png", "figures", "index.html", "results.json",
         "config.json", "model.safetensors", "card.json", "sub/data.csv", "out.csv", "map.journal", "w4s4.json",
         "train_state.json", "train_state.safetensors", "headline.csv", "eval_batch.safetensors",
         "result.phaselens", "log.json", "checkpoints/latest.json", "checkpoints/step-keep/notes.txt",
         "checkpoints/step-000000001/notes.txt", "checkpoints/step-000000001/rank0-of-1.safetensors",
         "checkpoints/step-000000002/log.json", "checkpoints/step-12/rank0-of-1.safetensors"]
# the names each writer writes itself: half the user's files are drawn from these, so every writer meets a
# user's file (or a FIFO, or a symbolic link) at each of its own paths within the default examples
OWN = {"result": ["result.phaselens"], "csv": ["out.csv"], "journal": ["map.journal"], "cache": ["w4s4.json"],
       "model": ["config.json", "model.safetensors", "card.json"],
       "zoo": ["config.json", "model.safetensors", "card.json", "eval_batch.safetensors"],
       "report": ["index.html", "results.json", "figures/top.png", "figures/map.png", "headline.csv"],
       "training_run": ["log.json", "checkpoints/latest.json", "checkpoints/step-keep/notes.txt",
                        "checkpoints/step-000000001/notes.txt", "checkpoints/step-000000001/rank0-of-1.safetensors",
                        "checkpoints/step-000000002/log.json", "checkpoints/step-000000002/rank0-of-1.safetensors",
                        "checkpoints/step-000000001/log.json"]}
SPECIAL = ("fifo", "symlink to a file", "dangling symlink")


def _make_special(path, kind, outside):
    """A file that is not a regular one at ``path``; returns what must still be there afterwards."""
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(outside if kind == "symlink to a file" else outside.with_name("nowhere"), path)
    return kind


def _special_unchanged(path, kind, outside, blob) -> bool:
    if kind == "fifo":
        import stat

        return stat.S_ISFIFO(os.lstat(path).st_mode)
    want = outside if kind == "symlink to a file" else outside.with_name("nowhere")
    return os.path.islink(path) and os.readlink(path) == str(want) and outside.read_bytes() == blob


def _user_files_vs_a_writer(data, root) -> None:
    """Draw a writer, whether phaselens wrote there before, the user's files (any name, phaselens's own names
    and folders included, or a phaselens file edited by hand) and overwrite; run the writer; every file the user
    wrote must be there with its bytes (only ``--force`` on an ``--out`` file may replace that one file)."""
    name = data.draw(st.sampled_from(sorted(WRITERS)), label="writer")
    write, d = WRITERS[name], root / "out"
    if name not in ("model", "report", "zoo"):
        d.mkdir()
    if data.draw(st.booleans(), label="phaselens wrote there before"):
        write(d, False)
    mine = {}
    names = st.sampled_from(OWN[name]) | st.sampled_from(NAMES)
    for rel, blob in data.draw(st.lists(st.tuples(names, st.binary(max_size=24)), max_size=5,
                                        unique_by=lambda t: t[0]), label="user files"):
        path = d / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)  # may replace a file phaselens wrote: that file is now the user's
        except OSError:
            continue  # a folder or a file already in the way
        mine[rel] = blob
    outside = root / "elsewhere.txt"  # what a symbolic link of the user's points at
    outside.write_bytes(b"the user's file outside")
    special = {}
    for rel, kind in data.draw(st.lists(st.tuples(names, st.sampled_from(SPECIAL)), max_size=2,
                                        unique_by=lambda t: t[0]), label="special files"):
        path = d / rel
        if rel in mine or os.path.lexists(path):
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            special[rel] = _make_special(path, kind, outside)
        except OSError:
            continue
    overwrite = data.draw(st.booleans(), label="overwrite")
    try:
        write(d, overwrite)
    except phaselens.PhaseLensError:
        pass
    recover_dir(d) if d.is_dir() else None
    for rel, blob in mine.items():
        if name == "csv" and overwrite and rel == "out.csv":
            continue  # --force names that one file
        assert (d / rel).is_file() and (d / rel).read_bytes() == blob, (name, rel, overwrite)
    for rel, kind in special.items():  # never replaced, even with --force, and never written through
        assert _special_unchanged(d / rel, kind, outside, b"the user's file outside"), (name, rel, kind, overwrite)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_no_writer_touches_a_file_phaselens_did_not_write(data):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        _user_files_vs_a_writer(data, Path(tmp))


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_no_writer_touches_a_file_phaselens_did_not_write_at_length(data):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        _user_files_vs_a_writer(data, Path(tmp))


# ---- what the operating system refuses, said in words (issue 24) -------------------------------------------
def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_a_save_keeps_the_old_version_and_says_so(tmp_path, monkeypatch):
    import phaselens.models.compressed.io as model_io

    target = tmp_path / "ckpt"
    MODELS[0].save(target)
    saved = user_files(target)

    def half_then_full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # part of the file, then the disk is full
        _disk_full()

    monkeypatch.setattr(model_io, "save_file", half_then_full)
    with pytest.raises(phaselens.errors.OutputError, match="the disk is full.*free some space"):
        MODELS[1].save(target, overwrite=True)
    monkeypatch.undo()
    assert same_weights(phaselens.load(target), MODELS[0]) and untouched(saved) and no_temporaries(target)


def test_a_full_disk_during_a_report_or_a_csv_is_one_clear_error(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from phaselens.presentation.cli import app

    monkeypatch.setattr(pd.DataFrame, "to_csv", _disk_full)
    with pytest.raises(phaselens.errors.OutputError, match="the disk is full"):
        write_report(tmp_path / "r", "<html>", [], [], {}, static=False, static_note_fn=None)
    assert not (tmp_path / "r").exists() and no_temporaries(tmp_path)
    res = CliRunner().invoke(app, ["eval", "w4s4", "--n-per-residue", "1", "--no-progress", "--out",
                                   str(tmp_path / "e.csv")])
    lines = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 3 and len(lines) == 1 and "the disk is full" in lines[0]
    assert "Traceback" not in res.output and not (tmp_path / "e.csv").exists()


def test_an_unwritable_place_is_one_error_for_save_and_report(tmp_path, monkeypatch):
    # the same refusal from the OS gave a raw PermissionError from save and an OutputError from report
    real_mkdir = os.mkdir

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "mkdir", refuse)
    errors = []
    for call in (lambda: MODELS[0].save(tmp_path / "ro" / "m"),
                 lambda: write_report(tmp_path / "ro" / "r", "<html>", [], [], {}, static=False, static_note_fn=None)):
        with pytest.raises(phaselens.PhaseLensError) as info:
            call()
        errors.append(info.value)
    assert [type(e) for e in errors] == [phaselens.errors.OutputError] * 2
    assert all("permission denied" in str(e) for e in errors)


def _as_another_user_in_a_read_only_folder(write, name):
    """Run ``write(d, False)`` in a forked child that cannot write ``d``'s folder (a real 0555 folder; as root
    the child first drops to ``nobody``, since root writes anywhere). Returns ``(error class, message)``."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="phaselens-ro-"))
    os.chmod(base, 0o755)
    ro = base / "ro"
    ro.mkdir()
    d = ro / "out"
    if name not in ("model", "report", "zoo"):
        d.mkdir()
        os.chmod(d, 0o555)
    os.chmod(ro, 0o555)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        said = "nothing raised"
        try:
            os.close(rfd)
            torch.set_num_threads(1)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            write(d, False)
        except BaseException as err:  # noqa: BLE001 (the parent classifies it)
            said = f"{type(err).__name__}\n{err}"
        finally:
            os.write(wfd, said.encode()[:4000])
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    os.chmod(ro, 0o755)
    import shutil

    shutil.rmtree(base, ignore_errors=True)
    kind, _, message = out.partition("\n")
    return kind, message


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_folder_you_may_not_write_is_one_output_error_for_every_writer(name):
    """Round 4: read-only output folders gave raw PermissionErrors from some writers."""
    kind, message = _as_another_user_in_a_read_only_folder(WRITERS[name], name)
    assert kind == "OutputError", (kind, message)
    assert "permission denied" in message.lower() or "read-only" in message.lower(), message


def test_an_unreadable_file_is_not_called_corrupt(tmp_path, monkeypatch):
    """Permission problems say permission; only proven damage suggests deleting (root reads any file, so the
    refusal is simulated where phaselens reads)."""
    import builtins
    from pathlib import Path

    import phaselens.storage.resumable as ck
    from phaselens.storage.journal import CellJournal

    MODELS[0].save(tmp_path / "m")
    real_read_bytes, real_open = Path.read_bytes, builtins.open

    def no_read(self):
        if self.name == "config.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", no_read)
    with pytest.raises(phaselens.errors.CheckpointError) as info:
        phaselens.load(tmp_path / "m")
    text = str(info.value)
    assert "permission denied" in text and "chmod" in text and "corrupt" not in text and "delete" not in text
    monkeypatch.undo()

    journal = tmp_path / "map.journal"
    WRITERS["journal"](tmp_path, False)

    def no_open(file, *args, **kwargs):
        if str(file) == str(journal):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(ck, "open", no_open, raising=False)
    with pytest.raises(phaselens.errors.JournalError) as info:
        CellJournal(journal, "fp", ("a",))
    text = str(info.value)
    assert "permission denied" in text and "corrupt" not in text and "delete" not in text
    monkeypatch.undo()
    (journal).write_bytes(journal.read_bytes()[:-3])  # proven damage (truncated): now deleting is the advice
    with pytest.raises(phaselens.errors.JournalError, match="delete it"):
        CellJournal(journal, "fp", ("a",))


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
