"""Cases of round 4 that still failed in round 5 (issue 44), and its small command-line case: each planted here.

* ``cycle_gates`` and a recipe seed given integers beyond int64 gave raw overflow errors;
* ``CompressedConfig`` took ``True`` as a layer or head count;
* ``phaselens.results.load`` after a plain ``import phaselens`` was an AttributeError;
* ``gate_cycling_test(residues=[0])`` and then its frames and plot raised IndexError;
* a reversed ``TaskBatch`` slice raised a raw ValueError;
* ``phaselens eval`` of a model without a default task told a command-line user to pass a task in Python syntax.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from typer.testing import CliRunner

import phaselens
from phaselens.analyses.cycling import cycle_gates
from phaselens.errors import BatchIndexError, ConfigError, InputError, NoDefaultTaskError, ZooError
from phaselens.models.compressed.config import CompressedConfig
from phaselens.presentation.cli import app
from tests.support.models import task_model

BASE = dict(n_layers=2, d_model=16, n_heads=2, d_head=8, d_mlp=32, d_vocab=32, n_ctx=64)
HUGE = (2**64, 2**63, -(2**70), 10**30)


@pytest.fixture(scope="module")
def model():
    return task_model()


# ---- integers beyond int64 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("delta", HUGE)
def test_cycle_gates_takes_any_integer_shift_exactly(model, delta):
    """Rolling by delta is rolling by delta mod S: the copy equals the one cycled by the residue."""
    S = model.analysis_spec.stride
    got, want = cycle_gates(model, delta), cycle_gates(model, delta % S)
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("seed", [2**63, 2**64, 10**30])
def test_a_seed_beyond_int64_is_refused_by_name(seed):
    from phaselens.train.family.recipes import family_recipe
    from phaselens.train.settings import TrainSettings
    from phaselens.train.zoo_recipes import get_recipe, seeded

    for call, error in ((lambda: seeded("w4s4", seed), ZooError), (lambda: get_recipe(f"w4s4-seed{seed}"), ZooError),
                        (lambda: TrainSettings(seed=seed), ConfigError),
                        (lambda: CompressedConfig(**BASE, seed=seed), ConfigError),
                        (lambda: family_recipe("paper-w4s4", seed=seed), ConfigError)):
        with pytest.raises(error, match="2\\^63 - 1"):
            call()
    assert CompressedConfig(**BASE, seed=2**63 - 1).seed == 2**63 - 1  # the largest is taken


# ---- bool is not a count -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx",
                                  "local_window", "n_kv_heads"])
def test_compressed_config_refuses_true_as_a_count(name):
    with pytest.raises(ConfigError, match=f"{name} must be a positive int"):
        CompressedConfig(**{**BASE, name: True})


# ---- phaselens.results after a plain import ------------------------------------------------------------------
def test_results_is_reachable_after_a_plain_import():
    code = "import phaselens, sys; f = phaselens.results.load; print(f.__module__, 'phaselens.results' in dir(phaselens) or 'results' in dir(phaselens))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.split() == ["phaselens.results", "True"], res.stderr[-2000:]


# ---- gate cycling on some residues -------------------------------------------------------------------------
def test_gate_cycling_on_too_few_residues_is_refused_before_any_forward(model):
    with pytest.raises(InputError) as info:
        phaselens.gate_cycling_test(model, residues=[0], n_per_residue=2, deltas=(1,), progress=False, n_bootstrap=0)
    msg = str(info.value)
    assert "all 4 phases" in msg and "residues=[0] covers phases [0]" in msg and "residues=[0, 1, 2, 3]" in msg
    with pytest.raises(InputError, match="residues=\\[1, 5, 3\\] covers phases \\[1, 3\\]"):
        phaselens.gate_cycling_test(model, residues=[1, 5, 3], n_per_residue=2, deltas=(1,), progress=False,
                                    n_bootstrap=0)


def test_gate_cycling_on_residues_covering_every_phase_gives_frames_and_a_plot(model):
    res = phaselens.gate_cycling_test(model, residues=[0, 1, 2, 3], n_per_residue=2, deltas=(1,), progress=False,
                                      n_bootstrap=0)
    assert sorted(res.per_phase()["phase"].unique()) == [0, 1, 2, 3] and len(res.frame) == 4
    assert sorted(res.per_residue()["residue"].unique()) == [0, 1, 2, 3]
    assert res.plot() is not None


# ---- TaskBatch slices -------------------------------------------------------------------------------------
def test_a_reversed_slice_of_a_batch_is_the_items_in_reverse(model):
    b = model.default_task.build(model.analysis_spec, n_per_residue=1, seed=0)
    n = len(b)
    for sl, rows in ((slice(None, None, -1), list(range(n))[::-1]), (slice(-1, 0, -3), list(range(n))[-1:0:-3]),
                     (slice(5, 2), [])):
        got, want = b[sl], b[rows]
        assert torch.equal(got.tokens, want.tokens) and got.frame.equals(want.frame), sl
    with pytest.raises(BatchIndexError, match="slice") as info:
        b[::0]
    assert isinstance(info.value, IndexError)


# ---- the command line speaks command line ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.support.causal_lm import tiny_causal_lm

    d = tmp_path_factory.mktemp("qwen3") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_causal_lm("qwen3").save_pretrained(d)
    return d


@pytest.mark.parametrize("command", ["eval", "map"])
def test_a_model_without_a_default_task_gets_the_fix_in_cli_words(hf_dir, command):
    """A transformers checkpoint (read at --stride 4, which the command line now passes on) has no default task,
    as a training run folder has none."""
    res = CliRunner().invoke(app, [command, f"hf:{hf_dir}", "--stride", "4", "--no-progress"])
    assert res.exit_code == 3, res.output
    (line,) = [x for x in res.output.splitlines() if x.startswith("error")]  # transformers' bars aside
    assert line.startswith("error: ") and f"hf:{hf_dir} has no default task" in line
    assert "--task niah-128k" in line and "phaselens.evaluate(" not in line and "KVRecall(" not in line, line
    if command == "eval":
        assert "--task fp8-probe" in line and "--tokenizer PATH" in line
    with pytest.raises(NoDefaultTaskError):  # the Python API's own message is unchanged
        phaselens.evaluate(phaselens.load(f"hf:{hf_dir}", stride=4), progress=False)


def test_a_saved_compressed_model_without_a_task_gets_the_fix_in_cli_words(tmp_path):
    """What ``phaselens eval RUN_DIR`` met: a compressed model (a run folder's, or saved) with no default task."""
    from tests.support.models import LAYOUTS, make_model

    make_model(LAYOUTS["w4s4-scalar"], d_vocab=128, n_ctx=128).save(tmp_path / "m")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "m"), "--no-progress"])
    assert res.exit_code == 3 and "pass --task niah-128k or --task fp8-probe" in res.output, res.output
    assert "phaselens.evaluate(" not in res.output


def test_the_cli_passes_stride_to_a_transformers_checkpoint_and_asks_for_it_in_cli_words(hf_dir):
    """``--stride`` was not passed to the loader, so ``phaselens eval hf:DIR --stride 4`` could not load a causal LM;
    without it the loader's Python-syntax message (``phaselens.load(model, stride=4)``) reached the terminal."""
    res = CliRunner().invoke(app, ["eval", f"hf:{hf_dir}", "--no-progress"])
    (line,) = [x for x in res.output.splitlines() if x.startswith("error")]
    assert res.exit_code == 3 and "pass --stride S" in line and "phaselens.load(" not in line, res.output
