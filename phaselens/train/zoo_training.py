"""Train one zoo model from its recipe and write its directory: weights, config, card and eval batch."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from phaselens.analyses.evaluation import evaluate
from phaselens.analyses.scoring import answer_metrics
from phaselens.core.geometry import PhaseSpec
from phaselens.core.version import __version__
from phaselens.models.compressed.io import checkpoint_kind, save_model
from phaselens.models.zoo import file_digests
from phaselens.storage.checksums import stamped
from phaselens.storage.writing import atomic_write_dir, check_output_dir
from phaselens.train.loop import train
from phaselens.train.zoo_recipes import COMPARE_STRIDE, EVAL_PER_RESIDUE, ZOO_EVAL_TASK, ZOO_TASK, get_recipe

EVAL_BATCH_PER_RESIDUE = 4
EVAL_BATCH_SEED = 424242


def battery_summary(ev: Any) -> dict[str, Any]:
    c = ev.tests.counts
    lo, hi = ev.gap_ci
    return {
        "stride": ev.stride, "modulus": ev.modulus, "n_items": len(ev.items),
        "mean": c.mean_accuracy, "worst_phase": c.worst_phase, "worst": c.worst_accuracy,
        "best": c.best_accuracy, "boundary": c.boundary_accuracy, "gap": c.phase_gap, "gap_ci": [lo, hi],
        "residue_gap": c.residue_gap, "period": c.period.period,
        "p_chi2": c.chi2.pvalue, "p_g": c.g.pvalue, "p_nested": c.nested.pvalue,
        "harmonic_fraction": c.harmonic.fraction, "p_harmonic": c.harmonic.pvalue, "p_gap": c.gap_test.pvalue,
        "nll_kruskal_p": next((r.kruskal.pvalue for r in ev.tests.continuous if r.metric == "nll"), None),
        "nll_by_phase": next((list(map(float, r.phase_means)) for r in ev.tests.continuous if r.metric == "nll"), None),
        "phase_accuracy": list(map(float, c.phase_accuracy)),
    }


def code_provenance() -> dict[str, Any]:
    """The git commit of the phaselens source that trains (``dirty``: uncommitted changes), or why it is unknown."""
    import subprocess

    src = Path(__file__).resolve().parents[1]  # the phaselens package
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "--", "."],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "note": "not run from a git checkout (an installed package)"}
    return {"commit": commit, "dirty": bool(status.strip())}


def build_zoo_model(name: str, out: str | Path, *, run_dir: str | Path, progress: bool = True,
                    steps: int | None = None, threads: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train (or resume) ``name`` and write ``out/name``; returns the card.

    ``steps`` replaces the recipe's number of steps (the cosine schedule follows it, so it is another run);
    ``threads`` the recipe's torch thread count (results are bit-identical only at the same count).
    The card records the code's git commit (``card["code"]``), the torch build and the thread count.
    ``out/name`` is checked before training: files there that phaselens did not write are refused
    (:class:`~phaselens.errors.OutputError`) unless ``overwrite=True``, which replaces only its own files.
    """
    kind = checkpoint_kind(extra=("eval_batch.safetensors",))
    check_output_dir(Path(out) / name, kind, overwrite=overwrite)
    recipe = get_recipe(name)
    task = ZOO_EVAL_TASK
    settings = recipe.settings
    if steps is not None:
        settings = dataclasses.replace(settings, steps=steps)
    if threads is not None:
        settings = dataclasses.replace(settings, threads=threads)
    res = train(recipe.config, recipe.batch_fn(), settings, Path(run_dir) / name, progress=progress)
    model = res.model
    model.default_task = task
    stride = model.analysis_spec.stride if recipe.config.compression is not None else COMPARE_STRIDE
    t1 = time.time()
    ev = evaluate(model, task, n_per_residue=EVAL_PER_RESIDUE, seed=1, progress=progress, stride=stride,
                  n_permutations=2000, n_bootstrap=1000, batch_size=256)
    eval_s = time.time() - t1
    per_res = ev.per_residue()
    eval_batch = task.build(PhaseSpec(stride), n_per_residue=EVAL_BATCH_PER_RESIDUE, seed=EVAL_BATCH_SEED)
    with torch.no_grad():
        logits = model(eval_batch.tokens)[torch.arange(len(eval_batch)), eval_batch.query_pos]
    fixed_correct = answer_metrics(logits, eval_batch.answer, eval_batch.wrong)["correct"]
    card = {
        "name": name,
        "description": recipe.description,
        "phaselens_version": __version__,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "code": code_provenance(),
        # resumed_from: the step this process started at (== steps: the weights were trained by an earlier
        # run, perhaps at another commit; "code" is the commit that wrote this card)
        "training": {**dataclasses.asdict(settings), "resumed_from": res.resumed_from, "seconds": None if res.seconds is None else round(res.seconds, 1),
                     "loss_curve_every_10": [float(np.mean(res.losses[i : i + 10])) for i in range(0, len(res.losses), 10)],
                     "final_loss": float(np.mean(res.losses[-50:]))},
        "task": task.to_dict(),
        "training_task": ZOO_TASK.to_dict(),
        "evaluation": {"n_per_residue": EVAL_PER_RESIDUE, "seed": 1, "seconds": round(eval_s, 1),
                       "correct": per_res["correct"].astype(int).tolist(), "n": per_res["n"].astype(int).tolist(),
                       "nll": per_res["nll"].round(6).tolist()},
        "battery": battery_summary(ev),
        "eval_batch": {"file": "eval_batch.safetensors", "per_residue": EVAL_BATCH_PER_RESIDUE, "seed": EVAL_BATCH_SEED,
                       "accuracy": float(fixed_correct.mean()), "correct": fixed_correct.astype(int).tolist()},
    }

    save_zoo_model(Path(out) / name, model, eval_batch, card, overwrite=overwrite)
    return card


def save_zoo_model(target: Path, model: Any, eval_batch: Any, card: dict[str, Any], *, overwrite: bool = False) -> None:
    """Write a zoo model's directory: the checkpoint, its fixed evaluation batch and its card (which gets the
    files' digests), atomically and under the ownership rule of :func:`~phaselens.storage.writing.atomic_write_dir`."""

    def write(tmp: Path) -> None:
        save_model(model, tmp / "model", metadata=None)
        for f in (tmp / "model").iterdir():
            f.rename(tmp / f.name)
        (tmp / "model").rmdir()
        fixed = {"tokens": eval_batch.tokens.contiguous(), "answer": eval_batch.answer.contiguous(),
                 "wrong": eval_batch.wrong.contiguous(), "query_pos": eval_batch.query_pos.contiguous(),
                 "residue": torch.as_tensor(eval_batch.frame["residue"].to_numpy().copy()).contiguous()}
        save_file(fixed, str(tmp / "eval_batch.safetensors"), metadata=stamped({}, fixed))
        card.update(file_digests(tmp))  # weights and config (with the default task)
        (tmp / "card.json").write_text(json.dumps(card, indent=1, sort_keys=True))

    atomic_write_dir(target, write, kind=checkpoint_kind(extra=("eval_batch.safetensors",)), overwrite=overwrite)
