"""The CLI: version, help with examples, and exit codes."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import phaselens
from phaselens.presentation.cli import app

runner = CliRunner()


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"phaselens {phaselens.__version__}"


@pytest.mark.parametrize("cmd", ["report", "eval", "record", "map", "train", "zoo"])
def test_help_shows_an_example(cmd):
    args = [cmd, "list", "--help"] if cmd == "zoo" else [cmd, "--help"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "Example: phaselens" in res.stdout


def test_phaselens_error_is_one_line_with_exit_code_3():
    res = runner.invoke(app, ["eval", "no-such-model"])
    assert res.exit_code == 3
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: no zoo model 'no-such-model'")
    assert "Traceback" not in res.output


def test_debug_shows_the_traceback():
    res = runner.invoke(app, ["--debug", "eval", "no-such-model"])
    assert res.exit_code != 0 and isinstance(res.exception, phaselens.errors.ZooError)


def test_bad_usage_is_exit_code_2():
    assert runner.invoke(app, ["eval"]).exit_code == 2
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2


# --- help: every option explained, no type tags on flags, the options the commands need ------------------------

def _commands():
    import typer

    root = typer.main.get_command(app)
    out = {"phaselens": root}
    for name, cmd in root.commands.items():
        out[name] = cmd
        for sub, subcmd in getattr(cmd, "commands", {}).items():
            out[f"{name} {sub}"] = subcmd
    return out


@pytest.mark.parametrize("path", ["", "eval", "record", "map", "train", "report", "zoo", "zoo list"])
def test_help_has_no_bool_tags(path):
    res = runner.invoke(app, [*path.split(), "--help"], env={"COLUMNS": "100"})
    assert res.exit_code == 0
    assert "<bool>" not in res.output


def test_every_option_has_help():
    for name, cmd in _commands().items():
        for p in cmd.params:
            if p.param_type_name == "option":
                assert (p.help or "").strip(), f"{name} {p.opts} has no help"


def test_commands_have_the_options_a_user_needs():
    cmds = _commands()

    def opts(name):
        return {o for p in cmds[name].params for o in p.opts}

    assert {"--kinds", "--seed", "--stride", "--n-per-residue"} <= opts("map")
    assert {"--stride", "--seed", "--n-per-residue"} <= opts("eval")
    assert {"--steps", "--threads", "--runs"} <= opts("train")
    assert {"--seed", "--n-per-residue"} <= opts("record")


def test_zoo_list_fits_80_columns_without_cutting_names():
    from phaselens.models.zoo import list_models

    res = runner.invoke(app, ["zoo", "list"], env={"COLUMNS": "80"})
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    firsts = {line.split()[0] for line in lines if line and not line.startswith(" ")}
    assert set(list_models()) <= firsts  # every name in full, at the start of its row
    assert "…" not in res.output
    assert "w4s4-norope" in res.output and "w4s4-seed1" in res.output


# --- errors: one line, exit 3, before any computation ------------------------------------------------------

def _forbid_compute(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("computed before validating --out")

    import importlib

    for module, name in (("analyses.evaluation", "evaluate"), ("analyses.recording", "record"),
                         ("analyses.maps", "specialization_map"), ("models.sources", "load")):
        monkeypatch.setattr(importlib.import_module(f"phaselens.{module}"), name, boom)  # where the CLI reads it

    monkeypatch.setattr(importlib.import_module("phaselens.presentation.reporting"), "report", boom)


@pytest.mark.parametrize("cmd", ["eval", "record", "map", "report"])
def test_out_is_validated_before_computing(cmd, tmp_path, monkeypatch):
    _forbid_compute(monkeypatch)
    a_file = tmp_path / "f.txt"
    a_file.write_text("mine")
    missing = tmp_path / "nope" / "x.csv"
    cases = [str(missing), str(tmp_path)] if cmd != "report" else [str(missing), str(a_file)]
    for out in cases:
        args = [cmd, "--out", out] if cmd == "report" else [cmd, "w4s4", "--out", out]
        res = runner.invoke(app, args)
        assert res.exit_code == 3, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: --out") and "Traceback" not in res.output
    assert a_file.read_text() == "mine"


def test_a_multi_line_error_message_is_printed_on_one_line(monkeypatch):
    def raise_two_lines(*a, **k):
        raise phaselens.errors.InputError("first line\n    second line")

    monkeypatch.setattr("phaselens.models.sources.load", raise_two_lines)
    res = runner.invoke(app, ["record", "w4s4", "--no-progress"])
    assert res.exit_code == 3 and res.output.strip() == "error: first line second line"


def test_control_without_stride_names_the_option():
    res = runner.invoke(app, ["eval", "full", "--no-progress"])
    assert res.exit_code == 3 and "--stride" in res.output
    res = runner.invoke(app, ["map", "full", "--kinds", "nonsense"])
    assert res.exit_code == 2 and "head,kv_head,layer" in res.output


def test_eval_of_the_control_with_stride(tmp_path):
    out = tmp_path / "full.csv"
    res = runner.invoke(app, ["eval", "full", "--stride", "4", "--n-per-residue", "1", "--no-progress",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "stride 4" in res.output
    import pandas as pd

    frame = pd.read_csv(out)
    assert len(frame) == 24 and set(frame["residue"]) == set(range(24))


# --- train: says it resumes, and where it stopped on Ctrl-C ------------------------------------------------

def test_train_reports_resume_and_interrupt(tmp_path, monkeypatch):
    import phaselens.train.zoo_training as build
    from phaselens.train.loop import TrainSettings, train
    from tests.train.test_loop import CFG, batch_fn

    settings = TrainSettings(steps=8, batch_size=4, warmup=2, checkpoint_every=2, threads=1)

    def interrupted_batches(b, seed):
        if seed == 5:  # step 5: after the checkpoint of step 4
            raise KeyboardInterrupt
        return batch_fn(b, seed)

    def fake_build(name, out, *, run_dir, progress, steps, threads, overwrite):
        train(CFG, interrupted_batches, settings, tmp_path / "runs" / name, progress=False)
        raise AssertionError("not reached")

    monkeypatch.setattr(build, "build_zoo_model", fake_build)
    args = ["train", "--recipe", "w4s4", "--out", str(tmp_path / "zoo"), "--runs", str(tmp_path / "runs"),
            "--no-progress"]
    res = runner.invoke(app, args)
    assert res.exit_code == 130
    assert f"the last checkpoint is step 4 of 1500 in {tmp_path / 'runs' / 'w4s4'}" in res.output
    assert "resume with: phaselens train --recipe w4s4" in res.output
    res = runner.invoke(app, args)
    assert "resuming w4s4 from step 4 of 1500" in res.output


def test_train_steps_reach_the_settings(tmp_path, monkeypatch):
    import phaselens.train.zoo_training as build

    seen = {}

    def fake_build(name, out, *, run_dir, progress, steps, threads, overwrite):
        seen.update(steps=steps, threads=threads, overwrite=overwrite)
        raise phaselens.errors.ZooError("stop here")

    monkeypatch.setattr(build, "build_zoo_model", fake_build)
    res = runner.invoke(app, ["train", "--recipe", "w4s4", "--steps", "7", "--threads", "1", "--out",
                              str(tmp_path), "--runs", str(tmp_path / "runs"), "--force"])
    assert res.exit_code == 3 and seen == {"steps": 7, "threads": 1, "overwrite": True}


def test_map_plan_prints_the_dry_run_without_running():
    res = runner.invoke(app, ["map", "w4s4", "--plan", "--n-per-residue", "4", "--kinds", "head"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("Plan(specialization_map on w4s4, engine 'suffix'") and "8 head" in res.stdout
    for word in ("forwards", "token passes", "GiB"):
        assert word in res.stdout
    plan = phaselens.plan(phaselens.load("zoo:w4s4"), "specialization_map", n_per_residue=4, kinds=("head",))
    assert res.stdout.strip() == repr(plan)


def test_every_analysis_command_defaults_to_the_one_n_per_residue():
    """eval, record and map without --n-per-residue run the analyses' one default (and say it in --help); a served
    preset keeps the paper's own count."""
    import inspect
    import typing

    from phaselens.analyses.runner import N_PER_RESIDUE
    from phaselens.presentation.cli import analysis_commands as cmds
    from phaselens.presentation.cli.common import NPerResidueOpt
    from phaselens.presentation.cli.served_options import Served
    from phaselens.tasks.presets import PRESET_ITEMS

    for fn in (cmds.eval_cmd, cmds.record_cmd, cmds.map_cmd):
        assert typing.get_type_hints(fn, include_extras=True)["n_per_residue"] == NPerResidueOpt, fn.__name__
        assert inspect.signature(fn).parameters["n_per_residue"].default is None, fn.__name__
    assert f"default {N_PER_RESIDUE}," in typing.get_args(NPerResidueOpt)[1].help
    assert cmds.n_items(None) == N_PER_RESIDUE and cmds.n_items(7) == 7
    assert Served().items(None, "w8s4") == N_PER_RESIDUE
    assert Served(task="fp8-probe").items(None, "w8s4") == PRESET_ITEMS["fp8-probe"] != N_PER_RESIDUE
