"""Output directories: user files are never deleted, new directories follow the umask, an interrupted update
is completed by the next load. (Kills of real processes are in test_faults.py.)"""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import phaselens
import phaselens.storage.writing as files
from phaselens.errors import OutputError
from phaselens.presentation.reporting.write import REPORT, write_report
from phaselens.storage.writing import DirKind, atomic_write_dir, check_output_dir, recover_dir
from tests.support.models import LAYOUTS, make_model


class Killed(BaseException):
    """Stands for a kill at a fault point: nothing after it runs and no cleanup handler catches it."""


def snapshot(path):
    """What must not change about a user's file: its bytes, inode and modification time."""
    st = path.stat()
    return path.read_bytes(), st.st_ino, st.st_mtime_ns


def listing(folder):
    """The names in ``folder`` (phaselens's manifest left out: it is phaselens's own record)."""
    return sorted(p.name for p in folder.iterdir() if p.name != files.MANIFEST)


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
    assert listing(out) == ["notes.txt", "sub"]
    model.save(out, overwrite=True)  # replaces only the checkpoint's own files
    assert snapshot(out / "notes.txt") == before and (out / "sub" / "data.csv").read_text() == "1,2"
    assert listing(out) == ["config.json", "model.safetensors", "notes.txt", "sub"]
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
    assert listing(tmp_path / "m") == ["config.json", "model.safetensors"]


def test_a_user_file_with_a_checkpoint_name_is_never_replaced(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))  # e.g. a transformers checkpoint
    before = snapshot(out / "config.json")
    with pytest.raises(OutputError, match="config.json exists and was not written by phaselens"):
        make_model(LAYOUTS["w4s4-scalar"]).save(out, overwrite=True)
    assert snapshot(out / "config.json") == before and listing(out) == ["config.json"]


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
    assert listing(target) == ["card.json", "config.json", "model.safetensors", "notes.txt"]
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


def test_a_manifest_temporary_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    # a kill inside the manifest's own atomic replace leaves its temporary (CI caught it at a random kill)
    dead = tmp_path / f".{files.MANIFEST}.tmp-999999999-0123abcd"
    live = tmp_path / f".{files.MANIFEST}.tmp-{os.getpid()}-4567abcd"
    dead.write_text("{", encoding="utf-8")
    live.write_text("{", encoding="utf-8")
    files.write_owned_file(tmp_path / "out.txt", lambda tmp: tmp.write_text("x", encoding="utf-8"), by="test")
    assert not dead.exists() and live.exists()
    assert "out.txt" in files.mf.owned_by(tmp_path, "test")


def test_empty_directory_and_a_kind_that_owns_only_what_its_manifest_lists(tmp_path):
    (tmp_path / "empty").mkdir()
    thing = DirKind("thing")  # no legacy rule: ownership comes from the manifest alone
    atomic_write_dir(tmp_path / "empty", lambda d: (d / "a.txt").write_text("a"), kind=thing)
    assert (tmp_path / "empty" / "a.txt").read_text() == "a"
    atomic_write_dir(tmp_path / "empty", lambda d: (d / "a.txt").write_text("b"), kind=thing)  # its own: replaced
    assert (tmp_path / "empty" / "a.txt").read_text() == "b"
    (tmp_path / "empty" / "a.txt").write_text("edited by hand")  # no longer what phaselens wrote: the user's now
    with pytest.raises(OutputError, match="a.txt"):
        atomic_write_dir(tmp_path / "empty", lambda d: (d / "a.txt").write_text("c"), kind=thing, overwrite=True)
    assert (tmp_path / "empty" / "a.txt").read_text() == "edited by hand"
    other = DirKind("other")  # another writer never takes thing's files for its own
    with pytest.raises(OutputError, match="a.txt"):
        atomic_write_dir(tmp_path / "empty", lambda d: (d / "b.txt").write_text("b"), kind=other)


# ---- ownership comes from the manifest, never from a name or an extension (issue 24) ------------------------
def _two_pngs(secs, folder):
    folder.mkdir(exist_ok=True)
    (folder / "top.png").write_bytes(b"\x89PNG phaselens top")
    (folder / "map.png").write_bytes(b"\x89PNG phaselens map")
    return "two PNGs"


def test_a_user_png_in_the_reports_figures_survives_every_rerun(tmp_path):
    # the reproducer: figures/ held only .png files, so the whole folder was taken for the report's
    out = tmp_path / "report"
    write_report(out, "<html>1</html>", [], [], {"run": 1}, static=True, static_note_fn=_two_pngs)
    (out / "figures" / "mine.png").write_bytes(b"\x89PNG my own figure")
    before = snapshot(out / "figures" / "mine.png")
    with pytest.raises(OutputError, match=r"figures/mine\.png"):  # without overwrite: refused, nothing touched
        write_report(out, "<html>2</html>", [], [], {"run": 2}, static=True, static_note_fn=_two_pngs)
    assert snapshot(out / "figures" / "mine.png") == before and (out / "index.html").read_text() == "<html>1</html>"
    write_report(out, "<html>3</html>", [], [], {"run": 3}, static=True, static_note_fn=_two_pngs, overwrite=True)
    assert snapshot(out / "figures" / "mine.png") == before and (out / "index.html").read_text() == "<html>3</html>"
    assert listing(out / "figures") == ["map.png", "mine.png", "top.png"]
    # a report without figures removes only its own PNGs; the folder stays for the user's
    write_report(out, "<html>4</html>", [], [], {"run": 4}, static=False, static_note_fn=None, overwrite=True)
    assert listing(out / "figures") == ["mine.png"] and snapshot(out / "figures" / "mine.png") == before


def test_a_report_file_edited_by_hand_is_the_users(tmp_path):
    out = tmp_path / "report"
    write_report(out, "<html>1</html>", [], [], {"run": 1}, static=True, static_note_fn=_two_pngs)
    (out / "figures" / "top.png").write_bytes(b"my retouched figure")  # same name, the user's bytes
    with pytest.raises(OutputError, match=r"figures/top\.png"):
        write_report(out, "<html>2</html>", [], [], {"run": 2}, static=True, static_note_fn=_two_pngs,
                     overwrite=True)
    assert (out / "figures" / "top.png").read_bytes() == b"my retouched figure"
    # its own untouched files are still its own: without figures it rewrites them and keeps the user's
    write_report(out, "<html>3</html>", [], [], {"run": 3}, static=False, static_note_fn=None, overwrite=True)
    assert (out / "figures" / "top.png").read_bytes() == b"my retouched figure"
    assert not (out / "figures" / "map.png").exists() and (out / "index.html").read_text() == "<html>3</html>"


def test_a_folder_without_figures_of_its_own_is_never_emptied_by_name(tmp_path):
    # a directory that looks like a report (its results.json lists it) but holds a figures/ folder of PNGs
    # the user made: without a manifest, the folder is never taken for the report's
    out = tmp_path / "old"
    write_report(out, "<html>1</html>", [], [], {"run": 1}, static=False, static_note_fn=None)
    (out / files.MANIFEST).unlink()  # as written before manifests existed
    (out / "figures").mkdir()
    (out / "figures" / "a.png").write_bytes(b"\x89PNG mine")
    with pytest.raises(OutputError, match=r"figures/a\.png"):
        write_report(out, "<html>2</html>", [], [], {"run": 2}, static=False, static_note_fn=None)
    write_report(out, "<html>2</html>", [], [], {"run": 2}, static=False, static_note_fn=None, overwrite=True)
    assert (out / "figures" / "a.png").read_bytes() == b"\x89PNG mine" and (out / "index.html").read_text() == "<html>2</html>"


def test_a_file_a_user_puts_during_an_interrupted_update_is_kept(tmp_path, kill_at):
    """Between the commit and the roll-forward (a kill, then a later recovery) the user puts a file where the
    commit record would place one, and edits a stale file it would remove: recovery keeps both, and the manifest
    does not claim them."""
    out = tmp_path / "report"
    write_report(out, "<html>1</html>", [], [], {"run": 1}, static=True, static_note_fn=_two_pngs)
    kill_at("dir:committed")
    with pytest.raises(Killed):
        write_report(out, "<html>2</html>", [], [], {"run": 2}, static=False, static_note_fn=None, overwrite=True)
    (out / "index.html").write_text("the user's page")  # a path the commit record will put
    (out / "figures" / "map.png").write_bytes(b"edited")  # a stale file the commit record will remove
    assert recover_dir(out)
    assert (out / "index.html").read_text() == "the user's page" and (out / "figures" / "map.png").read_bytes() == b"edited"
    assert not (out / "figures" / "top.png").exists()  # its own stale file: removed
    import phaselens.storage.manifest as mf

    owned = mf.owned_by(out, "report")
    assert "index.html" not in owned and "figures/map.png" not in owned and "results.json" in owned


def test_a_bf16_model_comes_back_as_bf16(tmp_path):
    model = make_model(LAYOUTS["w8s4-deepseek"]).to(torch.bfloat16)
    model.save(tmp_path / "m")
    loaded = phaselens.load(tmp_path / "m")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}  # was float32 without a word
    tokens = torch.randint(0, 61, (2, 13))
    assert torch.equal(loaded(tokens), model(tokens))
