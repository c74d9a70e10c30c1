"""Checkpoints: safetensors + JSON only, round trip and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import phaselens
from phaselens.errors import CheckpointError
from tests.support.models import LAYOUTS, make_model


@pytest.mark.parametrize("name", ["w8s4-deepseek", "w8s4-peroffset"])
def test_save_load_round_trip_is_exact(tmp_path, name):
    model = make_model(LAYOUTS[name])
    model.save(tmp_path / "m")
    # the checkpoint and phaselens's manifest of what it wrote (the ownership record, docs/files.md)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [".phaselens-manifest.json", "config.json",
                                                                  "model.safetensors"]
    loaded = phaselens.load(tmp_path / "m")
    tokens = torch.randint(0, 61, (2, 19))
    assert torch.equal(loaded(tokens), model(tokens))
    assert loaded.config == model.config


def test_no_pickle_in_checkpoints(tmp_path):
    make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "m")
    for f in (tmp_path / "m").iterdir():
        assert not f.read_bytes().startswith(b"\x80")  # pickle protocol header


def _mutate_weights(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "phaselens.compressed_transformer/1"})


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path):
    # each case in a fresh directory: a weights file edited by hand is no longer phaselens's to replace
    make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "m1")
    target = "blocks.0.attn.W_Q"
    _mutate_weights(tmp_path / "m1", lambda t: t.pop(target))
    with pytest.raises(CheckpointError, match="missing tensor.*blocks.0.attn.W_Q"):
        phaselens.load(tmp_path / "m1")
    make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "m2")
    _mutate_weights(tmp_path / "m2", lambda t: t.update(stray=torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor.*stray"):
        phaselens.load(tmp_path / "m2")
    make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "m3")
    _mutate_weights(tmp_path / "m3", lambda t: t.update({target: torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.W_Q \(3, 3\) where the model needs"):
        phaselens.load(tmp_path / "m3")
    with pytest.raises(phaselens.errors.OutputError, match="model.safetensors"):  # edited by hand: the user's now
        make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "m3", overwrite=True)


def test_unknown_config_key_and_missing_files(tmp_path):
    make_model(LAYOUTS["w4s4-scalar"]).save(tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["config"]["mystery_knob"] = 1
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="mystery_knob"):
        phaselens.load(tmp_path / "m")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        phaselens.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a phaselens checkpoint"):
        phaselens.load(tmp_path / "empty")


def test_save_is_atomic_when_interrupted(tmp_path, monkeypatch):
    model = make_model(LAYOUTS["w4s4-scalar"])
    model.save(tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    import phaselens.models.compressed.io as io

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "save_file", broken)
    with pytest.raises(KeyboardInterrupt):
        make_model(LAYOUTS["w4s4-scalar"], seed=9).save(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary left behind
