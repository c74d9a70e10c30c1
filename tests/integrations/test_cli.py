"""``phaselens lm-eval``: export, lm-eval's own command line with the phaselens model, stratify and read back, as
a user types them; errors are one line and exit code 3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from phaselens.presentation.cli import app
from tests.support.lm_eval import bpe_tokenizer, task_dir

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def phaselens_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "phaselens", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow  # lm-eval's command line indexes its ~15,000 task files (about 30 s on a loaded 2-core machine)
def test_export_run_and_read_from_the_command_line(tmp_path):
    done = phaselens_cli("lm-eval", "export", "w8s4", "--out", "tasks", "--n-per-residue", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tasks" / "phaselens_kv_recall.yaml").is_file()
    done = phaselens_cli("lm-eval", "run", "--model", "phaselens", "--model_args", "model=zoo:w8s4", "--tasks",
                         "phaselens_kv_recall", "--include_path", "tasks", "--log_samples", "--output_path", "out",
                         "--batch_size", "32", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "phaselens_kv_recall" in done.stdout and "exact_match" in done.stdout
    done = phaselens_cli("lm-eval", "read", "out", "--out", "items.csv", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "PhaseEval: lm-eval phaselens on phaselens_kv_recall: 24 items, stride 4, residues mod 24" in done.stdout
    assert (tmp_path / "items.csv").read_text().count("\n") == 25


def test_stratify_writes_a_task_and_refuses_a_bad_filler_in_one_line(tmp_path):
    tasks = task_dir(tmp_path / "tasks", ("tiny_mc",))
    bpe_tokenizer().save_pretrained(tmp_path / "tok")
    ok = runner.invoke(app, ["lm-eval", "stratify", str(tasks / "tiny_mc.yaml"), "--tokenizer", str(tmp_path / "tok"),
                             "--stride", "4", "--out", str(tmp_path / "strat")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "strat" / "tiny_mc_phase4.yaml").is_file() and "--include_path" in ok.output
    bad = runner.invoke(app, ["lm-eval", "stratify", str(tasks / "tiny_mc.yaml"), "--tokenizer", str(tmp_path / "tok"),
                              "--stride", "4", "--filler", "=", "--out", str(tmp_path / "strat")])
    assert bad.exit_code == 3
    assert bad.output.startswith("error: the filler '=' cannot pad contexts token-exactly with the tokenizer")
    assert bad.output.count("\n") == 1
    missing = runner.invoke(app, ["lm-eval", "read", str(tmp_path / "nothing")])
    assert missing.exit_code == 3 and "error: no samples at" in missing.output
