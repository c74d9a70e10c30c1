"""Phase-aware evaluation: ``phaselens.evaluate(model, task) -> PhaseEval``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import numpy as np
import pandas as pd

from phaselens.analyses.items import check_options
from phaselens.analyses.runner import (
    Analysis,
    Common,
    NoState,
    ResamplingOptions,
    Run,
    arguments_of,
    public,
    run,
)
from phaselens.analyses.scoring import (
    METRICS,
    block_answers,
    block_metrics,
    items_from_metrics,
    plain_forward,
    stack_metrics,
)
from phaselens.contract.protocol import PhaseModel, is_black_box
from phaselens.results.base import Result
from phaselens.stats import ItemBattery, phase_battery_items, wilson_ci
from phaselens.stats.by_residue import group_counts, group_mean


@dataclass(frozen=True, repr=False, eq=False)
class PhaseEval(Result):
    """Per-item and per-residue results of a phase-aware evaluation.

    Attributes:
        items: one row per item (``item_id``, ``residue``, ``phase``, ``t_K``, ``correct``, ``p_correct``,
            ``p_wrong``, ``logit_diff``, ``nll``, ``rank``, ``predicted`` (the greedy token id: what the model
            answered) and the task's placement columns). A served model without log-probabilities leaves
            ``p_correct`` .. ``nll`` NaN (``metadata["scored_by"]`` says so).
        tests: the statistics battery run on these items (:class:`~phaselens.stats.ItemBattery`); its
            ``counts`` holds the per-residue counts, Wilson CIs, omnibus, nested and harmonic tests.
        stride, modulus: S and M.
        metadata: what was run (model, its ``analysis_metadata``, task spec, the exact arguments).
    """

    LEVELS = ("residue", "phase", "item")
    COLUMNS = {
        "residue": ("residue", "phase", "n", "correct", "acc", "ci_low", "ci_high", "nll"),
        "phase": ("phase", "n", "correct", "acc", "ci_low", "ci_high", "boundary"),
        "item": ("item_id", "residue", "phase", "t_K", "correct", "p_correct", "p_wrong", "logit_diff", "nll", "rank",
                 "predicted"),
    }

    items: pd.DataFrame
    tests: ItemBattery
    stride: int
    modulus: int
    metadata: dict[str, Any] = field(default_factory=dict)

    # ---- headline numbers (fractions) -------------------------------------------------------------------
    @property
    def mean(self) -> float:
        return self.tests.counts.mean_accuracy

    @property
    def worst(self) -> float:
        """Accuracy of the worst phase (residues folded mod S); alias of ``worst_phase_accuracy``."""
        return self.tests.counts.worst_accuracy

    @property
    def worst_phase_accuracy(self) -> float:
        """Accuracy of the worst phase (residues folded mod S)."""
        return self.tests.counts.worst_accuracy

    @property
    def best_phase_accuracy(self) -> float:
        """Accuracy of the best phase (residues folded mod S)."""
        return self.tests.counts.best_accuracy

    @property
    def phase_gap(self) -> float:
        """Max - min accuracy over phases (residues folded mod S)."""
        return self.tests.counts.phase_gap

    @property
    def worst_residue(self) -> int:
        """The residue (0..M-1, not folded) with the lowest accuracy."""
        return self.tests.counts.worst_residue

    @property
    def worst_residue_accuracy(self) -> float:
        """Lowest accuracy over the M residues, not folded: the paper's "worst"."""
        return self.tests.counts.worst_residue_accuracy

    @property
    def best_residue(self) -> int:
        """The residue (0..M-1, not folded) with the highest accuracy."""
        return self.tests.counts.best_residue

    @property
    def best_residue_accuracy(self) -> float:
        """Highest accuracy over the M residues, not folded: the paper's "best"."""
        return self.tests.counts.best_residue_accuracy

    @property
    def residue_gap(self) -> float:
        """Max - min accuracy over the M residues, not folded: the paper's "gap across residues"."""
        return self.tests.counts.residue_gap

    @property
    def worst_phase(self) -> int:
        return self.tests.counts.worst_phase

    @property
    def best(self) -> float:
        """Accuracy of the best phase (residues folded mod S); alias of ``best_phase_accuracy``."""
        return self.tests.counts.best_accuracy

    @property
    def gap(self) -> float:
        """Folded max - min accuracy over phases; alias of ``phase_gap`` (see ``residue_gap`` for the paper's)."""
        return self.tests.counts.phase_gap

    @property
    def gap_ci(self) -> tuple[float, float]:
        """95% interval of the folded gap (``phase_gap``)."""
        ci = self.tests.gap_ci
        return (ci.ci_low, ci.ci_high) if ci is not None else (float("nan"), float("nan"))

    @property
    def gap_upper_bound(self) -> float:
        """One-sided 95% upper bound of the folded gap: the equivalence margin."""
        ci = self.tests.gap_ci
        return ci.upper_bound if ci is not None else float("nan")

    @property
    def boundary(self) -> float:
        """Accuracy of the boundary phase S - 1."""
        return self.tests.counts.boundary_accuracy

    @property
    def period(self) -> int | None:
        """Detected period (paired tests when items are paired); ``None`` for no effect, an ambiguous one, or a
        subset of residues (period detection needs the whole cycle: ``tests.skipped["period"]``)."""
        return None if self.tests.period is None else self.tests.period.period

    @property
    def residues(self) -> np.ndarray:
        """The residues evaluated (all of 0..M-1 unless ``residues=`` was passed)."""
        return self.tests.counts.residues

    def per_residue(self) -> pd.DataFrame:
        """One row per residue: ``n``, ``correct``, ``acc``, Wilson 95% ``ci_low`` / ``ci_high``, mean NLL."""
        res = self.items["residue"].to_numpy()
        n = group_counts(res, self.modulus)
        correct = np.rint(group_mean(self.items["correct"].to_numpy(float), res, self.modulus) * n)
        correct = np.nan_to_num(correct).astype(int)
        lo, hi = np.full(self.modulus, np.nan), np.full(self.modulus, np.nan)
        has = n > 0
        lo[has], hi[has] = wilson_ci(correct[has], n[has])
        out = pd.DataFrame({"residue": np.arange(self.modulus), "phase": np.arange(self.modulus) % self.stride,
                            "n": n, "correct": correct, "acc": np.where(n > 0, correct / np.maximum(n, 1), np.nan),
                            "ci_low": lo, "ci_high": hi,
                            "nll": group_mean(self.items["nll"].to_numpy(float), res, self.modulus)})
        return out[out["n"] > 0].reset_index(drop=True)

    def per_phase(self) -> pd.DataFrame:
        """Residues folded mod S: one row per phase with Wilson CIs, and a ``boundary`` flag."""
        return self.tests.counts.phase_frame().rename(columns={"accuracy": "acc"})

    def per_item(self) -> pd.DataFrame:
        """The per-item frame (tidy: one row per scored item)."""
        return self.items.copy()

    def summary(self) -> str:
        lo, hi = self.gap_ci
        c, t = self.tests.counts, self.tests
        md = self.metadata
        boundary = (f"boundary phase {self.stride - 1}: {100 * self.boundary:.1f}%" if c.phase_n[-1]
                    else f"boundary phase {self.stride - 1} not evaluated")
        tests = [f"folded gap {100 * self.gap:.1f} pp [95% CI {100 * lo:.1f}, {100 * hi:.1f}]"
                 if np.count_nonzero(c.phase_n) > 1 else "one phase evaluated: no folded gap"]
        if c.gap_test is not None:
            tests[0] += f", permutation p={c.gap_test.pvalue:.3g}"
        if t.omnibus is not None:
            tests.append(f"omnibus {t.omnibus.name} p={t.omnibus.pvalue:.3g}")
        if t.nested is not None:
            what = f"mod {self.modulus} vs {self.stride}" if c.complete else "residues vs phases"
            tests.append(f"nested {what} p={t.nested.pvalue:.3g}")
        tests.append(f"period {self.period}" if t.period is not None else "period not tested (needs every residue)")
        lines = [
            f"PhaseEval: {md.get('model', 'model')} on {md.get('task', 'task')}: {len(self.items)} items, "
            f"stride {self.stride}, residues mod {self.modulus}"
            + ("" if c.complete else f"; evaluated {c.subset.describe()}"),
            f"  mean {100 * self.mean:.1f}%  worst phase {self.worst_phase}: {100 * self.worst:.1f}%  "
            f"{boundary}  best {100 * self.best:.1f}%",
            f"  per residue: worst {self.worst_residue}: {100 * self.worst_residue_accuracy:.1f}%  "
            f"best {self.best_residue}: {100 * self.best_residue_accuracy:.1f}%  gap {100 * self.residue_gap:.1f} pp",
            "  " + "; ".join(tests),
            "  accuracy by phase %: " + " ".join(f"{p}: {100 * c.phase_accuracy[p]:.1f}"
                                                 for p in np.flatnonzero(c.phase_n)),
        ]
        if md.get("scored_by"):  # a served model: how its answers were scored (accuracy only, or log-probs too)
            lines.append(f"  scored by {md['scored_by']}")
        return "\n".join(lines)

    def plot(self, control: PhaseEval | None = None, **kwargs: Any):
        """Accuracy against residue with Wilson bars, folded per cycle (see :func:`phaselens.plots.accuracy_by_residue`)."""
        from phaselens import plots

        return plots.accuracy_by_residue(self, control=control, **kwargs)


@dataclass(frozen=True)
class Evaluation(Analysis[NoState]):
    """Answer metrics of every item (one forward per block of items), then the statistics battery."""

    name = "evaluate"
    stage = "evaluate"
    needs_phases = True
    black_box = True  # a served model is scored from its answers

    n_permutations: int = 2000

    def check(self, model: PhaseModel, options: Common) -> Evaluation:
        check_options(n_permutations=self.n_permutations)
        return self

    def fields(self, run: Run) -> tuple[str, ...]:
        return METRICS

    def compute(self, run: Run, state: NoState, idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        if is_black_box(run.model):
            return [block_answers(run.model, run.batch, run.blocks[b], progress=run.options.progress) for b in idx]
        forward = plain_forward(run.model)
        return [block_metrics(forward, run.batch, run.blocks[b]) for b in idx]

    def result(self, run: Run, state: NoState, parts: list[tuple[np.ndarray, ...]]) -> PhaseEval:
        metrics = stack_metrics(parts)
        tested, note = scored_metrics(run.model, metrics)
        items = items_from_metrics(run.batch, metrics)
        return eval_from_items(items, run.stride, run.modulus, metadata=run.metadata(**note),
                               n_permutations=self.n_permutations, n_bootstrap=run.options.n_bootstrap,
                               seed=run.options.seed, residues=run.covered(), metrics=tested)


def scored_metrics(model: PhaseModel, metrics: dict[str, np.ndarray]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The continuous metrics the battery tests: ``nll`` and ``logit_diff``, or those of them a black-box
    model reported for every item; and the metadata note (for a black box, ``scored_by`` says which)."""
    every = ("nll", "logit_diff")
    if not is_black_box(model):
        return every, {}
    known = np.isfinite(metrics["nll"]) & np.isfinite(metrics["logit_diff"])
    n = len(known)
    if n and known.all():
        return every, {"scored_by": "greedy answers (accuracy), with the server's log-probabilities of the answer "
                                    "and distractor"}
    return (), {"scored_by": (
        "greedy answers only: the server reports no log-probabilities, so p_correct, p_wrong, logit_diff and "
        "nll are NaN and the statistics use accuracy alone" if not known.any() else
        f"greedy answers; log-probabilities for {int(known.sum())} of {n} items (the others fell outside the "
        "server's top log-probabilities): the statistics use accuracy alone")}


@public
def evaluate(
    model: PhaseModel,
    task: Any = None,
    *,
    n_per_residue: int = 256,
    n_permutations: int = 2000,
    **options: Unpack[ResamplingOptions],
) -> PhaseEval:
    """Evaluate ``model`` with the needle placed at every residue, and run the statistics battery.

    Args:
        model: anything satisfying :class:`~phaselens.contract.protocol.PhaseModel`.
        task: a phase-controlled task or a prepared ``TaskBatch``; ``None`` uses ``model.default_task``.
        n_per_residue, residues, seed, batch_size, stride, progress, checkpoint, n_bootstrap: the common
            options (:class:`~phaselens.analyses.runner.Common`; docs/api.md). A checkpoint holds finished blocks
            of ``batch_size`` items; a rerun (with any number of processes) resumes, and a checkpoint of another
            run is refused.
        n_permutations: permutations of the gap test.

    Under torch.distributed the item blocks are split across the ranks (:mod:`phaselens.parallel.distributed`).

    Example:
        >>> ev = phaselens.evaluate(phaselens.load("zoo:w8s4"), n_per_residue=64)  # doctest: +SKIP
        >>> ev.worst, ev.boundary, ev.gap_ci  # doctest: +SKIP
    """
    return run(Evaluation(n_permutations), model, task, arguments_of(evaluate, locals()))


def eval_from_items(
    items: pd.DataFrame, stride: int, modulus: int, *, metadata: dict[str, Any] | None = None,
    n_permutations: int = 2000, n_bootstrap: int = 1000, seed: int = 0, residues: Any = None,
    metrics: Sequence[str] = ("nll", "logit_diff"),
) -> PhaseEval:
    """A :class:`PhaseEval` (battery included) from a per-item frame; ``residues``: the residues covered when
    only some of 0..M-1 were evaluated (see :func:`phaselens.stats.phase_battery_items`); ``metrics``: the
    continuous columns to test (none for a served model without log-probabilities)."""
    tests = phase_battery_items(items, stride, modulus, n_permutations=n_permutations,
                                n_bootstrap=n_bootstrap, seed=seed, residues=residues, metrics=tuple(metrics))
    return PhaseEval(items, tests, stride, modulus, dict(metadata or {}))


