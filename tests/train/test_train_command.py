"""``phaselens train``: ``--out`` is created with its missing parents, as ``--runs`` is; a file on the way is
refused before any training."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import phaselens
from phaselens.presentation.cli import app

runner = CliRunner()


@pytest.fixture
def seen(monkeypatch):
    import phaselens.train.zoo_training as build

    got = {}

    def fake_build(name, out, *, run_dir, progress, steps, threads, overwrite):
        got.update(name=name, out=out, run_dir=run_dir)
        raise phaselens.errors.ZooError("stop here")

    monkeypatch.setattr(build, "build_zoo_model", fake_build)
    return got


def test_out_with_missing_parents_is_accepted_like_runs(tmp_path, seen):
    out, runs = tmp_path / "a" / "b" / "zoo", tmp_path / "c" / "d" / "runs"
    res = runner.invoke(app, ["train", "--recipe", "w4s4", "--out", str(out), "--runs", str(runs), "--no-progress"])
    assert "does not exist" not in res.output, res.output
    assert res.exit_code == 3 and "stop here" in res.output  # reached the training, nothing refused before
    assert seen == {"name": "w4s4", "out": str(out), "run_dir": str(runs)}


@pytest.mark.parametrize("option", ["--out", "--runs"])
def test_out_or_runs_under_a_file_is_refused_before_training(tmp_path, seen, option):
    (tmp_path / "afile").write_text("notes")
    other = "--runs" if option == "--out" else "--out"
    res = runner.invoke(app, ["train", "--recipe", "w4s4", option, str(tmp_path / "afile" / "sub"),
                              other, str(tmp_path / "ok"), "--no-progress"])
    assert res.exit_code == 3 and f"{option} {tmp_path / 'afile' / 'sub'}" in res.output and "is a file" in res.output
    assert seen == {} and (tmp_path / "afile").read_text() == "notes"
