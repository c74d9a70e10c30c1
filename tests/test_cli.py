"""The CLI: version, help with examples, and exit codes."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import phaselens
from phaselens.cli import app

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
    assert res.exit_code != 0 and isinstance(res.exception, phaselens.ZooError)


def test_bad_usage_is_exit_code_2():
    assert runner.invoke(app, ["eval"]).exit_code == 2
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2
