"""Phase-aware evaluation: ``phaselens.evaluate(model, task) -> PhaseEval``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import numpy as np
import pandas as pd

from phaselens.analyses.items import check_options
from phaselens.analyses.runner import Analysis, Common, ResamplingOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import (
    METRICS,
    Forward,
    block_answers,
    block_metrics,
    items_from_metrics,
    plain_forward,
    stack_metrics,
)
from phaselens.contract.protocol import PhaseModel, is_black_box
from phaselens.results.phase_eval import PhaseEval
from phaselens.stats import phase_battery_items


@dataclass(frozen=True)
class Evaluation(Analysis[Any]):
    """Answer metrics of every item (one forward per block of items), then the statistics battery.

    A subclass evaluates another model made of this one (``knockout``: with heads knocked out) by declaring its
    :meth:`forward` and the metadata it adds (:meth:`note`); everything else is the evaluation's."""

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

    def forward(self, run: Run, state: Any) -> Forward:
        """What answers a block of items: the model as it is."""
        return plain_forward(run.model)

    def note(self, run: Run, state: Any) -> dict[str, Any]:
        """What the result's metadata says besides the call (nothing, for the model as it is)."""
        return {}

    def compute(self, run: Run, state: Any, idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        if is_black_box(run.model):
            return [block_answers(run.model, run.batch, run.blocks[b], progress=run.options.progress) for b in idx]
        forward = self.forward(run, state)
        return [block_metrics(forward, run.batch, run.blocks[b]) for b in idx]

    def result(self, run: Run, state: Any, parts: list[tuple[np.ndarray, ...]]) -> PhaseEval:
        metrics = stack_metrics(parts)
        tested, note = scored_metrics(run.model, metrics)
        items = items_from_metrics(run.batch, metrics)
        return eval_from_items(items, run.stride, run.modulus, metadata=run.metadata(**note, **self.note(run, state)),
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
    n_permutations: int = 2000,
    **options: Unpack[ResamplingOptions],
) -> PhaseEval:
    """Evaluate ``model`` with the needle placed at every residue, and run the statistics battery.

    Args:
        model: anything satisfying :class:`~phaselens.contract.protocol.PhaseModel`.
        task: a phase-controlled task or a prepared ``TaskBatch``; ``None`` uses ``model.default_task``.
        phase, n_per_residue, residues, seed, batch_size, stride, progress, journal, n_bootstrap: the common
            options (:class:`~phaselens.analyses.runner.Common`; docs/api.md). A journal holds finished blocks
            of ``batch_size`` items; a rerun (with any number of processes) resumes, and a journal of another
            run is refused.
        n_permutations: permutations of the gap test.

    Under torch.distributed the item blocks are split across the ranks (:mod:`phaselens.parallel.distributed`).

    Example:
        >>> ev = phaselens.evaluate(phaselens.load("zoo:w8s4"), n_per_residue=64)  # doctest: +SKIP
        >>> ev.worst, ev.boundary, ev.gap_ci  # doctest: +SKIP
    """
    arguments = arguments_of(evaluate, locals())
    return run(Evaluation.from_arguments(arguments), model, task, arguments)


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


