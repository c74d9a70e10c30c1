"""``phaselens.knockout(model, heads, task) -> PhaseEval``: the phase-aware evaluation of the model with heads
knocked out.

The evaluation (:class:`~phaselens.analyses.evaluation.Evaluation`: per-phase accuracy with CIs, the worst and
boundary phase, the phase-sensitivity battery) of the items answered with ``heads`` knocked out at each item's
last position (``positions``), by the hooks of :func:`~phaselens.analyses.knockouts.knocked_out` with the same
calibration and draws as ``ablate``'s knocked-out run, so its accuracy per phase is ``ablate``'s ``acc_ko``.
To knock heads out over arbitrary inputs, use ``phaselens.analyses.knocked_out`` as a ``with`` block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Unpack

import torch

from phaselens.analyses.evaluation import Evaluation
from phaselens.analyses.knockouts import (
    Knockout,
    Method,
    calibration_items,
    check_method,
    check_positions,
    knocked_out,
)
from phaselens.analyses.runner import Common, ResamplingOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import Forward, model_logits
from phaselens.analyses.units import Units
from phaselens.contract.protocol import PhaseModel
from phaselens.core.heads import parse_heads
from phaselens.errors import InputError
from phaselens.results.phase_eval import PhaseEval


@dataclass(frozen=True)
class KnockoutState:
    """The knockout (its heads parsed, its calibration computed)."""

    knockout: Knockout


@dataclass(frozen=True)
class KnockoutEvaluation(Evaluation):
    """The evaluation, each block of items answered with the heads knocked out. Checked, ``method`` and
    ``positions`` are normalised; the heads are parsed before any item is built (the error ``ablate`` gives)."""

    name = "knockout"
    stage = "knockout"
    black_box = False  # hooks need the model's internals

    heads: Any = None
    method: str = "mean"
    positions: Any = "last"
    calibration: Any = None

    def check(self, model: PhaseModel, options: Common) -> KnockoutEvaluation:
        parse_heads(self.heads, model.dims)
        checked = super().check(model, options)
        return replace(checked, method=check_method(self.method), positions=check_positions(self.positions))

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """The calibration (mean and resample: the task's items, 64 per forward), then one hooked forward of
        every item."""
        return Units(item_passes=1, calibration_items=calibration_items(self.method, self.calibration,
                                                                        int(items.modulus)))

    def prepare(self, run: Run) -> KnockoutState:
        pos = self.positions
        if isinstance(pos, torch.Tensor) and len(pos) != len(run.batch):
            raise InputError(f"positions is a tensor of {len(pos)} slots but the analysis has {len(run.batch)} items; "
                             "pass one slot per item, or 'last' (each item's last position).")
        return KnockoutState(knocked_out(run.model, self.heads, method=self.method, positions=pos,
                                         calibration=self.calibration, task=run.task, seed=run.options.seed))

    def fingerprint(self, run: Run, state: KnockoutState) -> dict[str, Any]:
        ko = state.knockout
        return dict(heads=[str(h) for h in ko.heads], method=self.method, positions=self.positions,
                    calibration=None if ko.calibration is None else ko.calibration.z, seed=run.options.seed)

    def forward(self, run: Run, state: KnockoutState) -> Forward:
        ko, model = state.knockout, run.model
        per_item = isinstance(ko.positions, torch.Tensor)

        def forward(tokens: torch.Tensor, query_pos: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
            pos = ko.positions[items] if per_item else None  # the items' own slots, or ko.positions
            return model_logits(model, tokens, query_pos, ko.fwd_hooks(pos, items=items))

        return forward

    def note(self, run: Run, state: KnockoutState) -> dict[str, Any]:
        ko = state.knockout
        return {"knocked_out": [str(h) for h in ko.heads], "method": ko.method,
                "calibration": None if ko.calibration is None else ko.calibration.source}


@public
def knockout(model: PhaseModel, heads: Any, task: Any = None, *, method: Method = "mean", positions: Any = "last",
             calibration: Any = None, n_permutations: int = 2000, **options: Unpack[ResamplingOptions]) -> PhaseEval:
    """Evaluate ``model`` on ``task`` with ``heads`` knocked out: the :class:`PhaseEval` of the knocked-out model.

    Args:
        model: a phaselens model (or adapter, or phase ensemble).
        heads: ``(layer, head)``, ``"L2H3"``, ``"L2"``, ``"L2KV0"``, or a list of these.
        task, phase, n_per_residue, residues, seed, batch_size, stride, progress, journal, n_bootstrap: the
            common options (docs/api.md). A journal holds finished blocks of ``batch_size`` items; its
            fingerprint covers the model, the items, the heads, method, positions, calibration and seed.
        method: ``"mean"`` (calibration mean, the paper's choice), ``"zero"`` or ``"resample"``.
        positions: where the heads are knocked out: ``"last"`` (each item's last position, its query), ``"all"``,
            an int slot, or a ``[N]`` tensor of one slot per item.
        calibration: the calibration items for ``mean``/``resample`` (default: the task's own, another seed).
        n_permutations: permutations of the gap test.

    ``metadata`` names the heads knocked out (``knocked_out``), the method and the calibration's source.

    Example:
        >>> ev = phaselens.knockout(phaselens.load("zoo:w8s4"), "L0H3", n_per_residue=32)  # doctest: +SKIP
        >>> ev.per_phase()["acc"], ev.worst  # doctest: +SKIP
    """
    arguments = arguments_of(knockout, locals())
    return run(KnockoutEvaluation.from_arguments(arguments), model, task, arguments)


__all__ = ["KnockoutEvaluation", "KnockoutState", "knockout"]
