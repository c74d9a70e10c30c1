"""Output directories: user files are never deleted, new directories follow the umask, an interrupted update
is completed by the next load. (Kills of real processes are in test_faults.py.)"""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import phaselens
import phaselens.runtime.files as files
from phaselens import OutputError
from phaselens.presentation.reporting.write import REPORT, write_report
from phaselens.runtime.files import DirKind, atomic_write_dir, check_output_dir, recover_dir
from tests.conftest import LAYOUTS, make_model


class Killed(BaseException):
    """Stands for a kill at a fault point: nothing after it runs and no cleanup handler catches it."""


def snapshot(path):
    """What must not change about a user's file: its bytes, inode and modification time."""
    st = path.stat()
    return path.read_bytes(), st.st_ino, st.st_mtime_ns


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def kill_at(monkeypatch):
    """``kill_at(point, nth)``: raise Killed at the nth time a writer passes ``point``."""
    def arm(point: str, nth: int = 1) -> None:
        seen = {"n": 0}

        def hook(p: str) -> None:
            if p == point:
                seen["n"] += 1
                if seen["n"] == nth:
                    raise Killed(p)

        monkeypatch.setattr(files, "FAULT_HOOK", hook)

    yield arm
    monkeypatch.setattr(files, "FAULT_HOOK", None)


def test_save_into_a_directory_with_user_files_is_refused_and_deletes_nothing(tmp_path):
    # the reproducer: notes.txt in a directory, save a zoo model there, notes.txt is gone
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "sub").mkdir()
    (out / "sub" / "data.csv").write_text("1,2")
    before = snapshot(out / "notes.txt")
    model = phaselens.load("zoo:w4s4")
    with pytest.raises(OutputError, match=r"notes\.txt.*overwrite=True"):
        model.save(out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]
    model.save(out, overwrite=True)  # replaces only the checkpoint's own files
    assert snapshot(out / "notes.txt") == before and (out / "sub" / "data.csv").read_text() == "1,2"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt", "sub"]
    assert same_weights(phaselens.load(out), model)
    other = make_model(LAYOUTS["w4s4-scalar"], seed=5)
    other.save(out, overwrite=True)  # a second save replaces the first, still keeping the user's files
    assert same_weights(phaselens.load(out), other) and snapshot(out / "notes.txt") == before


def test_resaving_a_checkpoint_needs_no_overwrite_and_drops_a_stale_card(tmp_path):
    a, b = make_model(LAYOUTS["w4s4-scalar"]), make_model(LAYOUTS["w4s4-scalar"], seed=7)
    a.save(tmp_path / "m", metadata={"which": "a"})
    b.save(tmp_path / "m")  # only a previous checkpoint there: replaced without overwrite=True
    loaded = phaselens.load(tmp_path / "m")
    assert same_weights(loaded, b) and loaded.metadata == {}  # a's card did not survive beside b's weights
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]


def test_a_user_file_with_a_checkpoint_name_is_never_replaced(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))  # e.g. a transformers checkpoint
    before = snapshot(out / "config.json")
    with pytest.raises(OutputError, match="config.json exists and was not written by phaselens"):
        make_model(LAYOUTS["w4s4-scalar"]).save(out, overwrite=True)
    assert snapshot(out / "config.json") == before and sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_a_file_at_the_target_is_refused(tmp_path):
    (tmp_path / "out").write_text("keep me")
    with pytest.raises(OutputError, match="is a file"):
        make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "out", overwrite=True)
    with pytest.raises(OutputError, match="is a file"):
        check_output_dir(tmp_path / "out", REPORT, overwrite=True)
    with pytest.raises(OutputError, match="is a file"):
        write_report(tmp_path / "out", "<html>", [], [], {}, static=False, static_note_fn=None, overwrite=True)
    with pytest.raises(OutputError, match="is a file"):  # a file among the parents
        check_output_dir(tmp_path / "out" / "report", REPORT)
    assert (tmp_path / "out").read_text() == "keep me"


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_new_directories_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "deep" / "m")
        write_report(tmp_path / "r", "<html>", [], [], {}, static=False, static_note_fn=None)
    finally:
        os.umask(old)
    for d in (tmp_path / "deep", tmp_path / "deep" / "m", tmp_path / "r"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask, d
    for f in (tmp_path / "deep" / "m" / "model.safetensors", tmp_path / "r" / "index.html"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


def test_report_directory_keeps_user_files_and_replaces_its_own(tmp_path):
    out = tmp_path / "report"
    write_report(out, "<html>one</html>", [], [], {"run": 1}, static=False, static_note_fn=None)
    assert json.loads((out / "results.json").read_text())["meta"] == {"run": 1}
    write_report(out, "<html>two</html>", [], [], {"run": 2}, static=False, static_note_fn=None)  # own files only
    assert (out / "index.html").read_text() == "<html>two</html>"
    (out / "my_analysis.ipynb").write_text("{}")
    before = snapshot(out / "my_analysis.ipynb")
    with pytest.raises(OutputError, match="my_analysis.ipynb.*--force"):
        write_report(out, "<html>three</html>", [], [], {"run": 3}, static=False, static_note_fn=None)
    with pytest.raises(OutputError, match="my_analysis.ipynb"):
        check_output_dir(out, REPORT)  # what report() checks before computing anything
    write_report(out, "<html>three</html>", [], [], {"run": 3}, static=False, static_note_fn=None, overwrite=True)
    assert (out / "index.html").read_text() == "<html>three</html>" and snapshot(out / "my_analysis.ipynb") == before
    # a directory holding an unrelated index.html is not taken for a report
    other = tmp_path / "site"
    other.mkdir()
    (other / "index.html").write_text("my site")
    with pytest.raises(OutputError, match="index.html"):
        write_report(other, "<html>", [], [], {}, static=False, static_note_fn=None, overwrite=True)
    assert (other / "index.html").read_text() == "my site"


def _two_versions(tmp_path):
    a, b = make_model(LAYOUTS["w4s4-scalar"]), make_model(LAYOUTS["w4s4-scalar"], seed=7)
    target = tmp_path / "m"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    a.save(target, metadata={"which": "a"}, overwrite=True)
    return a, b, target


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_kill_between_renames_is_completed_by_load(tmp_path, kill_at, nth):
    a, b, target = _two_versions(tmp_path)
    before = snapshot(target / "notes.txt")
    kill_at("dir:moved", nth)  # after the commit: nth of the three files moved into place
    with pytest.raises(Killed):
        b.save(target, metadata={"which": "b"}, overwrite=True)
    assert any(p.name.startswith(files.COMMITTED) for p in target.iterdir())  # really interrupted mid-move
    loaded = phaselens.load(target)  # rolls the committed write forward
    assert same_weights(loaded, b) and loaded.metadata == {"which": "b"}
    assert sorted(p.name for p in target.iterdir()) == ["card.json", "config.json", "model.safetensors", "notes.txt"]
    assert snapshot(target / "notes.txt") == before


@pytest.mark.parametrize("point", ["dir:written", "dir:committed"])
def test_a_kill_before_or_at_the_commit_leaves_one_complete_version(tmp_path, kill_at, point):
    a, b, target = _two_versions(tmp_path)
    kill_at(point)
    with pytest.raises(Killed):
        b.save(target, metadata={"which": "b"}, overwrite=True)
    loaded = phaselens.load(target)
    want, card = (a, "a") if point == "dir:written" else (b, "b")
    assert same_weights(loaded, want) and loaded.metadata == {"which": card}
    assert (target / "notes.txt").read_text() == "mine"


def test_a_new_directory_appears_whole_or_not_at_all(tmp_path, kill_at):
    kill_at("dir:written")
    with pytest.raises(Killed):
        make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_recovery_is_idempotent_and_reports_what_it_did(tmp_path, kill_at):
    a, b, target = _two_versions(tmp_path)
    kill_at("dir:moved", 2)
    with pytest.raises(Killed):
        b.save(target, metadata={"which": "b"}, overwrite=True)
    assert recover_dir(target) is True
    assert recover_dir(target) is False  # nothing left to do
    assert same_weights(phaselens.load(target), b)


def test_stages_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    dead = target / f"{files.STAGE}999999999-0123abcd"  # no such pid
    live = target / f"{files.STAGE}{os.getpid()}-0123abcd"
    dead.mkdir()
    live.mkdir()
    recover_dir(target)
    assert not dead.exists() and live.exists()


def test_empty_directory_and_unknown_kind(tmp_path):
    (tmp_path / "empty").mkdir()
    nothing = DirKind("thing", lambda p: frozenset())
    atomic_write_dir(tmp_path / "empty", lambda d: (d / "a.txt").write_text("a"), kind=nothing)
    assert (tmp_path / "empty" / "a.txt").read_text() == "a"
    with pytest.raises(OutputError, match="a.txt"):  # a kind that owns nothing cannot replace anything
        atomic_write_dir(tmp_path / "empty", lambda d: (d / "a.txt").write_text("b"), kind=nothing)
