"""Resumable results on disk: one-file result journals under any name, caches keyed by fingerprint, and
damaged files that raise a JournalError (a journal) or CheckpointError (the shared readers) naming the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

import phaselens
from phaselens.errors import CheckpointError, JournalError, OutputError
from phaselens.storage.journal import CellJournal
from phaselens.storage.resumable import ResultCache, read_json, safetensors_metadata
from tests.support.models import task_model

FIELDS = ("correct", "logit_diff")


def written(path):
    """A complete journal of :func:`cells` at ``path``; its bytes."""
    journal = CellJournal(path, "fp", FIELDS)
    for label, arrays in cells().items():
        journal.add(label, *arrays)
    journal.flush()
    return path.read_bytes()


def cells(n_cells=3, n=5, seed=0):
    rng = np.random.default_rng(seed)
    return {f"L{i}H0": (rng.random(n) < 0.5, rng.normal(size=n).astype(np.float32)) for i in range(n_cells)}


@pytest.mark.parametrize("name", ["x.json", "x.npz", "x", "x.safetensors", "x.tmp", "x.journal.json"])
def test_any_suffix_gives_one_file_that_resumes_exactly(tmp_path, name):
    path = tmp_path / name
    ck = CellJournal(path, "fp", FIELDS)
    data = cells()
    for label, arrays in data.items():
        ck.add(label, *arrays)
    ck.flush()
    assert [p.name for p in tmp_path.iterdir()] == [name]  # nothing derived from the name: nothing collides
    again = CellJournal(path, "fp", FIELDS)
    assert list(again.done) == list(data)
    for label, (c, ld) in data.items():
        assert again.done[label][0].dtype == np.bool_ and np.array_equal(again.done[label][0], c)
        assert np.array_equal(again.done[label][1], ld)


def test_map_journal_named_json_resumes(tmp_path):
    # the reproducer: journal="x.json" overwrote its data with its manifest, and the rerun failed
    model = task_model()
    kw = dict(n_per_residue=2, kinds=("layer",), method="zero", progress=False, n_bootstrap=0,
              journal=tmp_path / "x.json")
    first = phaselens.specialization_map(model, **kw)
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    again = phaselens.specialization_map(model, **kw)
    assert np.array_equal(first.correct_ko, again.correct_ko)
    assert np.array_equal(first.logit_diff_ko, again.logit_diff_ko)


def test_another_fingerprint_or_layout_is_refused(tmp_path):
    ck = CellJournal(tmp_path / "c", "fp-a", FIELDS)
    ck.add("L0", np.ones(2, bool), np.zeros(2))
    ck.flush()
    with pytest.raises(JournalError, match="holds a different computation"):
        CellJournal(tmp_path / "c", "fp-b", FIELDS)
    with pytest.raises(JournalError, match="holds a different computation"):
        CellJournal(tmp_path / "c", "fp-a", ("correct",))


def test_a_users_file_is_never_overwritten(tmp_path):
    path = tmp_path / "results.npz"
    np.savez(path, a=np.arange(3))  # e.g. the user's own data, or a journal of an older phaselens
    before = path.read_bytes()
    with pytest.raises(JournalError, match="never overwrites a file it did not write"):
        CellJournal(path, "fp", FIELDS)
    from safetensors.numpy import save_file

    other = tmp_path / "weights.safetensors"
    save_file({"w": np.zeros(2)}, str(other), metadata={"format": "someone-else"})
    with pytest.raises(JournalError, match="is not a phaselens journal"):
        CellJournal(other, "fp", FIELDS)
    assert path.read_bytes() == before


@pytest.mark.parametrize("damage", ["truncate", "random", "empty"])
def test_damaged_journals_name_the_fix(tmp_path, damage):
    path = tmp_path / "map.journal"
    raw = written(path)
    path.write_bytes({"truncate": raw[: len(raw) // 2], "random": np.random.default_rng(0).bytes(len(raw)),
                      "empty": b""}[damage])
    with pytest.raises(JournalError, match="delete it to start over"):
        CellJournal(path, "fp", FIELDS)


def test_a_directory_path_is_refused(tmp_path):
    with pytest.raises(JournalError, match="is a directory"):
        CellJournal(tmp_path, "fp", FIELDS)


def test_result_cache_returns_only_matching_complete_entries(tmp_path):
    cache = ResultCache(tmp_path / "cache")
    assert cache.get("w4s4", "fp1") is None
    cache.put("w4s4", "fp1", {"section": "table", "seconds": 1.5})
    assert cache.get("w4s4", "fp1") == {"section": "table", "seconds": 1.5}
    assert cache.get("w4s4", "fp2") is None  # another model or setting: recompute
    cache.put("w4s4", "fp2", {"section": "other"})  # its own entry: replaced
    assert cache.get("w4s4", "fp2") == {"section": "other"}
    cache.path("w4s4").write_text('{"fingerprint": "fp1", "resu')  # damaged after writing: a miss ...
    assert cache.get("w4s4", "fp1") is None
    with pytest.raises(OutputError, match="w4s4.json"):  # ... and no longer provably phaselens's: kept
        cache.put("w4s4", "fp1", {"section": "again"})
    cache.path("w4s4").unlink()
    cache.put("w4s4", "fp1", {"section": "again"})
    assert cache.get("w4s4", "fp1") == {"section": "again"}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".phaselens-manifest.json", "w4s4.json"]
    with pytest.raises(ValueError, match="plain file stem"):
        cache.path("../escape")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        ResultCache(tmp_path / "afile")


def test_readers_turn_damage_into_checkpoint_errors(tmp_path):
    bad = tmp_path / "c.json"
    for text, pattern in [("{bad", "not valid JSON"), ("[1, 2]", "JSON array, but a JSON object"),
                          ("null", "JSON null"), ("\xff\xfe", "not valid JSON")]:
        bad.write_text(text, encoding="latin-1")
        with pytest.raises(CheckpointError, match=pattern):
            read_json(bad, fix="fix it.")
    with pytest.raises(CheckpointError, match="is missing; fix it"):
        read_json(tmp_path / "none.json", fix="fix it.")
    (tmp_path / "t.safetensors").write_bytes(json.dumps({"a": 1}).encode())
    with pytest.raises(CheckpointError, match="not a complete safetensors file"):
        safetensors_metadata(tmp_path / "t.safetensors", fix="fix it.")


def test_every_refusal_of_a_journal_is_a_journal_error_in_journal_words(tmp_path):
    """A journal is not a checkpoint (docs/architecture.md, Words): whatever is wrong with it, including damage
    the shared safetensors readers find (a torn file, a tensor whose bytes no longer match its checksum), the
    error is a JournalError, never a CheckpointError, and its message never calls the file a checkpoint."""
    from phaselens.storage.journal import check_journal_path

    assert not issubclass(JournalError, CheckpointError) and not issubclass(CheckpointError, JournalError)
    good = tmp_path / "good.journal"
    raw = written(good)
    torn, zeroed, foreign = tmp_path / "torn.journal", tmp_path / "zeroed.journal", tmp_path / "foreign.npz"
    torn.write_bytes(raw[: len(raw) // 2])
    zeroed.write_bytes(raw[:-16] + bytes(16))  # size kept, the last tensor's bytes zeroed: only the checksum sees it
    np.savez(foreign, a=np.arange(3))
    dangling, linked = tmp_path / "dangling.journal", tmp_path / "linked.journal"
    dangling.symlink_to(tmp_path / "nowhere")
    linked.symlink_to(good)
    planted = {
        "not a path": lambda: check_journal_path(5),
        "a directory": lambda: CellJournal(tmp_path, "fp", FIELDS),
        "a file of someone else": lambda: CellJournal(foreign, "fp", FIELDS),
        "torn": lambda: CellJournal(torn, "fp", FIELDS),
        "bytes changed on disk": lambda: CellJournal(zeroed, "fp", FIELDS),
        "another run": lambda: CellJournal(good, "fp-other", FIELDS),
        "a dangling link": lambda: CellJournal(dangling, "fp", FIELDS),  # replacing it would drop the user's link
        "a link to a journal": lambda: CellJournal(linked, "fp", FIELDS),
    }
    for what, open_it in planted.items():
        with pytest.raises(JournalError) as info:
            open_it()
        assert not isinstance(info.value, CheckpointError), what
        assert "checkpoint" not in str(info.value).lower(), (what, str(info.value))
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists() and linked.is_symlink()
