"""Issue 44, class 1 (damaged checkpoints) and class 5 (torn append-only lines), for the writers of runtime/:
every safetensors file phaselens writes records each tensor's sha256 in its header, and a file damaged on disk
(its tail zeroed, its size kept: safetensors alone does not notice) is a CheckpointError naming it."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import phaselens
import phaselens.results
from phaselens.errors import CheckpointError, JournalError, OutputError, ResultFileError
from phaselens.storage.checksums import KEY, stamped, tensor_sha256
from phaselens.storage.journal import CellJournal
from phaselens.storage.reading import TornLineWarning, read_jsonl
from phaselens.storage.resumable import load_safetensors, safetensors_metadata
from tests.support.models import task_model


def zero_tail(path, n=64):
    """What a disk or a copy fault leaves: the last ``n`` bytes zeroed, the size kept."""
    data = bytearray(path.read_bytes())
    size = len(data)
    assert data[-n:] != bytes(n)  # something is damaged
    data[-n:] = bytes(n)
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


def test_a_digest_is_of_the_tensor_the_same_from_torch_and_numpy():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_sha256(a) == tensor_sha256(a.numpy()) == tensor_sha256(a.t().contiguous().t())
    assert tensor_sha256(torch.tensor(2)) == tensor_sha256(np.array(2))  # a 0-d array keeps its shape
    assert tensor_sha256(a) != tensor_sha256(a.reshape(4, 3))  # the shape counts
    assert tensor_sha256(a) != tensor_sha256(a.double())  # and the dtype
    b = a.clone()
    b[2, 3] = 11.000001
    assert tensor_sha256(a) != tensor_sha256(b)


def test_a_zeroed_tail_of_any_file_is_named_with_its_tensor(tmp_path):
    tensors = {"a": torch.ones(64), "z": torch.arange(64, dtype=torch.float32)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata=stamped({"format": "x"}, tensors))
    assert set(json.loads(safetensors_metadata(path, fix="")[KEY])) == {"a", "z"}
    assert torch.equal(load_safetensors(path, fix="")["z"], tensors["z"])
    zero_tail(path)
    safetensors_metadata(path, fix="")  # the header and the size are intact: safetensors alone loads it
    assert not torch.equal(load_file(str(path))["z"], tensors["z"])
    with pytest.raises(CheckpointError, match=r"t.safetensors is damaged: 1 tensor\(s\) no longer match.*\(z\).*FIX"):
        load_safetensors(path, fix="FIX")


def test_a_file_written_before_checksums_loads_and_a_damaged_entry_is_named(tmp_path):
    path = tmp_path / "old.safetensors"
    save_file({"w": torch.ones(3)}, str(path), metadata={"format": "x"})
    assert torch.equal(load_safetensors(path, fix="")["w"], torch.ones(3))  # no entry: read as before
    save_file({"w": torch.ones(3)}, str(path), metadata={"format": "x", KEY: "[1, 2"})
    with pytest.raises(CheckpointError, match="checksum entry"):
        load_safetensors(path, fix="")
    save_file({"w": torch.ones(3), "v": torch.ones(1)}, str(path), metadata=stamped({}, {"w": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"were added \(v\)"):  # a tensor added since
        load_safetensors(path, fix="")


def test_a_damaged_saved_model_is_refused_on_load(tmp_path):
    model = task_model()
    model.save(tmp_path / "m")
    assert KEY in safetensors_metadata(tmp_path / "m" / "model.safetensors", fix="")
    zero_tail(tmp_path / "m" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors is damaged.*sha256.*save the model again"):
        phaselens.load(tmp_path / "m")


def test_a_damaged_journal_is_refused_on_resume(tmp_path):
    j = CellJournal(tmp_path / "map.journal", "fp", ("v",))
    for i in range(3):
        j.add(f"L{i}", np.full(50, float(i)))
    j.flush()
    zero_tail(tmp_path / "map.journal", n=100)
    with pytest.raises(JournalError, match=r"map.journal is damaged.*L2/v.*delete it to start over"):
        CellJournal(tmp_path / "map.journal", "fp", ("v",))


def test_a_damaged_saved_result_is_refused_on_load(tmp_path):
    ev = phaselens.evaluate(task_model(), n_per_residue=4, progress=False, n_bootstrap=0)
    ev.save(tmp_path / "ev.phaselens")
    zero_tail(tmp_path / "ev.phaselens", n=1024)
    with pytest.raises(ResultFileError, match="ev.phaselens is damaged"):
        phaselens.results.load(tmp_path / "ev.phaselens")


def test_an_interrupted_directory_write_never_puts_a_damaged_file_in_place(tmp_path, monkeypatch):
    """A save committed and then killed before its files moved (the commit record's roll-forward): a staged file
    damaged meanwhile is refused by the next load, and the old version stays in place."""
    from phaselens.storage import writing as files

    model = task_model()
    model.save(tmp_path / "m")
    old = (tmp_path / "m" / "model.safetensors").read_bytes()

    def kill(point):
        if point == "dir:committed":
            raise KeyboardInterrupt

    monkeypatch.setattr(files, "FAULT_HOOK", kill)
    with pytest.raises(KeyboardInterrupt):
        model.save(tmp_path / "m", metadata={"note": 1}, overwrite=True)
    monkeypatch.setattr(files, "FAULT_HOOK", None)
    staged = next((tmp_path / "m").glob(".phaselens-new-*"))
    zero_tail(staged / "model.safetensors")
    with pytest.raises(CheckpointError, match="staged file.*model.safetensors.*no longer match the sha256"):
        phaselens.load(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == old
    with pytest.raises(OutputError, match="delete that folder"):
        files.recover_dir(tmp_path / "m")


# ---- class 5: an append-only file cut mid-line --------------------------------------------------------------
def test_a_torn_last_line_is_dropped_with_a_warning_and_damage_before_it_is_named(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b": [1, 2')  # a kill mid-append
    with pytest.warns(TornLineWarning, match="cut short"):
        assert read_jsonl(path, fix="") == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n{"a": 2}')  # complete, only its newline missing: kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_jsonl(path, fix="") == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')  # a damaged line that is not the last: not a kill
    with pytest.raises(CheckpointError, match="line 2 is not JSON.*FIX"):
        read_jsonl(path, fix="FIX")
