"""The shipped zoo: integrity, exact reproduction of the cards on their fixed batches, and the phenomenon."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import phaselens
from phaselens.analyses.scoring import answer_metrics
from phaselens.models.zoo import ZOO_DIR, entry, list_models, sha256_file
from phaselens.train.zoo_recipes import RECIPES
from tests.support.margins import TIE, assert_flags_agree, decision_margins

SHIPPED = list_models()


def test_every_recipe_is_shipped():
    assert sorted(SHIPPED) == sorted(RECIPES)


@pytest.mark.parametrize("name", SHIPPED)
def test_checkpoint_loads_matches_sha256_and_reproduces_its_card(name):
    e = entry(name)
    card = e.card
    assert sha256_file(e.path / "model.safetensors") == card["weights_sha256"]
    assert sha256_file(e.path / "config.json") == card["config_sha256"]  # the config and the default task
    model = phaselens.load(f"zoo:{name}")
    assert model.config == RECIPES[name].config
    assert model.default_task is not None and model.default_task.to_dict() == card["task"]
    from phaselens.train.zoo_recipes import ZOO_EVAL_TASK, ZOO_TASK

    assert card["task"] == ZOO_EVAL_TASK.to_dict() and card["training_task"] == ZOO_TASK.to_dict()
    batch = load_file(str(e.path / "eval_batch.safetensors"))
    with torch.no_grad():
        logits = model(batch["tokens"])[torch.arange(len(batch["answer"])), batch["query_pos"]]
    correct = answer_metrics(logits, batch["answer"], batch["wrong"])["correct"].astype(int)
    pinned = np.array(card["eval_batch"]["correct"])
    # item by item, wherever the answer's logit is not within rounding of another logit (the card was written on
    # one CPU; a near-tie may flip on another, and is then not asserted: tests/support/margins.py)
    margins = decision_margins(logits, batch["answer"], outcomes="correct")
    assert_flags_agree(correct, pinned, margins, what=f"{name} eval-batch correct flags")
    firm = margins > TIE
    assert abs(float(correct.mean()) - card["eval_batch"]["accuracy"]) <= (~firm).mean() + 1e-12


def test_tampered_weights_are_refused(tmp_path, monkeypatch):
    import shutil

    import phaselens.models.zoo as zoo

    shutil.copytree(ZOO_DIR / "w4s4", tmp_path / "w4s4")
    card = json.loads((tmp_path / "w4s4" / "card.json").read_text())
    card["weights_sha256"] = "0" * 64
    (tmp_path / "w4s4" / "card.json").write_text(json.dumps(card))
    monkeypatch.setattr(zoo, "ZOO_DIR", tmp_path)
    with pytest.raises(phaselens.errors.ZooError, match="sha256"):
        phaselens.load("zoo:w4s4")
    with pytest.raises(phaselens.errors.ZooError, match="no zoo model 'w9s9'"):
        phaselens.load("zoo:w9s9")


def test_cards_state_the_phenomenon():
    """The cards' own numbers (1,000 items per residue): compressed models periodic at their stride and
    non-saturated; the control flat, with a tight upper bound on its folded gap.

    The control solves the task (it learns the induction circuit after a warm-up) and sits near ceiling, so
    the 40-95% range is asserted for the compressed models only; for the control the continuous metric,
    which has no ceiling, must be flat too (NLL by phase, Kruskal-Wallis), where every compressed model's is not.
    """
    from phaselens.stats import holm

    names = list(SHIPPED)
    cards = {n: entry(n).card["battery"] for n in names}
    adjusted = dict(zip(names, holm(np.array([cards[n]["p_g"] for n in names]))))
    for name in names:
        b = cards[name]
        comp = RECIPES[name].config.compression
        if comp is None:
            assert adjusted[name] > 0.01 and b["gap_ci"][1] < 0.03 and b["period"] is None
            assert b["mean"] > 0.9 and b["nll_kruskal_p"] > 0.01  # it solves the task, at every phase alike
        else:
            assert 0.40 <= b["mean"] <= 0.95, name
            assert adjusted[name] < 0.01 and b["period"] == comp.stride, name
            assert b["nll_kruskal_p"] < 1e-6, name


@pytest.mark.parametrize("name, stride", [("w8s4", 4), ("full", 4)])
def test_remeasured_subset_agrees_with_the_card(name, stride):
    """A fast re-measurement in CI (fresh items, 48 per residue) lands where the card says."""
    model = phaselens.load(f"zoo:{name}")
    ev = phaselens.evaluate(model, n_per_residue=48, seed=7, progress=False, stride=stride, batch_size=256,
                            n_permutations=499, n_bootstrap=0)
    card = entry(name).card["battery"]
    assert abs(ev.mean - card["mean"]) < 0.03
    assert np.abs(ev.per_phase()["acc"].to_numpy() - np.array(card["phase_accuracy"])).max() < 0.08
    if name == "full":
        assert ev.tests.counts.g.pvalue > 1e-3
    else:
        assert ev.tests.counts.g.pvalue < 1e-6 and ev.period == 4


def test_seed_recipes_resolve_and_bad_names_are_refused():
    """``BASE-seedK`` is the base recipe with seed K for both the weights and the data, for any K >= 1."""
    from dataclasses import replace

    from phaselens.train.zoo_recipes import SEED_CONFIGS, SHIPPED_SEEDS, get_recipe, seeded

    for base in SEED_CONFIGS:
        for k in SHIPPED_SEEDS[base]:
            r = RECIPES[f"{base}-seed{k}"]
            assert r == seeded(base, k) == get_recipe(f"{base}-seed{k}")
            assert r.config == replace(RECIPES[base].config, seed=k) and r.settings == replace(RECIPES[base].settings, seed=k)
            assert r.warmup_steps == RECIPES[base].warmup_steps
    assert get_recipe("w8s4-seed7").config.seed == 7 and seeded("w8s4", 0) is RECIPES["w8s4"]
    for bad in ["w4s4-seed0", "w9s9-seed1", "w4s4-seed1-seed2", "w4s4-seedx"]:
        with pytest.raises(phaselens.errors.ZooError, match=f"no recipe '{bad}'"):
            get_recipe(bad)
    with pytest.raises(phaselens.errors.ZooError, match="seeded\\(\\) takes a base recipe"):
        seeded("w4s4-seed1", 2)


def test_train_cli_refuses_an_unknown_recipe_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from phaselens.presentation.cli import app

    res = CliRunner().invoke(app, ["train", "--recipe", "w4s4-seedx", "--out", str(tmp_path / "o"),
                                   "--runs", str(tmp_path / "r")])
    assert res.exit_code == 3 and "no recipe 'w4s4-seedx'" in res.output
    assert not (tmp_path / "r").exists()


def _copy_zoo(tmp_path, monkeypatch, name="w4s4"):
    import shutil

    import phaselens.models.zoo as zoo

    shutil.copytree(ZOO_DIR / name, tmp_path / name)
    monkeypatch.setattr(zoo, "ZOO_DIR", tmp_path)
    return tmp_path / name


@pytest.mark.parametrize("edit", ["local_window", "filler", "whitespace"])
def test_an_edited_config_or_default_task_is_refused(tmp_path, monkeypatch, edit):
    # the reproducer: local_window 8 -> 2 (or the default task's filler) loaded silently, other logits
    path = _copy_zoo(tmp_path, monkeypatch)
    cfg = json.loads((path / "config.json").read_text())
    if edit == "local_window":
        cfg["config"]["local_window"] = 2
    elif edit == "filler":
        cfg["default_task"]["block_filler"] += 1
    text = json.dumps(cfg, indent=2, sort_keys=True) + (" " if edit == "whitespace" else "")
    (path / "config.json").write_text(text)
    with pytest.raises(phaselens.errors.ZooError, match=r"config.json has sha256 .* but its card says"):
        phaselens.load("zoo:w4s4")


@pytest.mark.parametrize("damage", ["missing", "invalid", "array", "no_hash"])
def test_a_missing_or_corrupt_card_is_a_zoo_error(tmp_path, monkeypatch, damage):
    path = _copy_zoo(tmp_path, monkeypatch)
    card = path / "card.json"
    if damage == "missing":
        card.unlink()
    elif damage == "invalid":
        card.write_text(card.read_text()[:100])
    elif damage == "array":
        card.write_text("[]")
    else:
        data = json.loads(card.read_text())
        del data["config_sha256"]
        card.write_text(json.dumps(data))
    with pytest.raises(phaselens.errors.ZooError, match="(?i)reinstall phaselens"):
        phaselens.load("zoo:w4s4")


def test_cards_record_the_code_commit(tmp_path, monkeypatch):
    """Cards written by training name the git commit of the code (or say why they cannot)."""
    import subprocess

    from phaselens.train import zoo_training as build

    prov = build.code_provenance()
    head = subprocess.run(["git", "-C", str(build.Path(build.__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert prov["commit"] == head and len(head) == 40 and isinstance(prov["dirty"], bool)

    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert build.code_provenance() == {"commit": None, "dirty": None,
                                       "note": "not run from a git checkout (an installed package)"}
