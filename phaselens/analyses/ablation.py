"""``phaselens.ablate(model, heads, task, phase=...)``: accuracy with and without a knockout, per residue and phase."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Unpack

import numpy as np

from phaselens.analyses.knockout_runs import KO_FIELDS, ablate_block, knockout_cell
from phaselens.analyses.knockouts import Knockout, calibration_items, knocked_out
from phaselens.analyses.runner import Analysis, Common, ResamplingOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import METRICS, items_from_metrics, stack_metrics
from phaselens.analyses.units import Units
from phaselens.contract.cells import Cell
from phaselens.contract.protocol import PhaseModel, choose_engine
from phaselens.core.heads import parse_heads
from phaselens.results.ablation_effects import PhaseAblation
from phaselens.stats.effects import Effects, relative_effects


@dataclass(frozen=True)
class AblationState:
    """The knockout, the engine used (``"full"`` when the heads span layers) and its cell."""

    knockout: Knockout
    engine: str
    cell: Cell | None


@dataclass(frozen=True)
class Ablation(Analysis[AblationState]):
    """Clean and knocked-out answers of every item, one block of items per unit. Checked, ``used`` is the
    engine chosen for the model."""

    name = "ablate"
    stage = "ablate"

    heads: Any
    method: str = "mean"
    calibration: Any = None
    engine: str = "auto"
    used: str = "auto"

    def check(self, model: PhaseModel, options: Common) -> Ablation:
        parse_heads(self.heads, model.dims)  # a bad head spec before any item is built
        return replace(self, used=choose_engine(model, self.engine))  # refused before the calibration runs

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """The calibration (mean and resample: the task's items, 64 per forward), then per block of items a
        clean and a knocked-out forward (``"full"``), or a query-suffix engine over the block with the one
        cell (``"suffix"``: heads of one layer)."""
        layers = sorted({h.layer for h in parse_heads(self.heads, model.dims)})
        engine = "full" if self.used == "suffix" and self.engine == "auto" and len(layers) > 1 else self.used
        cal = calibration_items(self.method, self.calibration, int(items.modulus))
        if engine == "suffix":
            return Units("suffix", item_passes=0, cells={"knockout": 1}, cell_layers=(layers[0],),
                         engine_scope="block", calibration_items=cal)
        return Units(item_passes=1, cells={"knockout": 1}, calibration_items=cal)

    def prepare(self, run: Run) -> AblationState:
        ko = knocked_out(run.model, self.heads, method=self.method, calibration=self.calibration, task=run.task,
                      seed=run.options.seed)
        used = self.used
        if used == "suffix" and self.engine == "auto" and len({h.layer for h in ko.heads}) > 1:
            used = "full"  # the engine intervenes at one layer per cell
        return AblationState(ko, used, knockout_cell(ko, len(run.batch)) if used == "suffix" else None)

    def fields(self, run: Run) -> tuple[str, ...]:
        return (*METRICS, *KO_FIELDS)

    def fingerprint(self, run: Run, state: AblationState) -> dict[str, Any]:
        ko = state.knockout
        return dict(heads=[str(h) for h in ko.heads], method=self.method,
                    calibration=None if ko.calibration is None else ko.calibration.z, seed=run.options.seed,
                    engine=state.engine)

    def compute(self, run: Run, state: AblationState, idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        return [ablate_block(run.model, run.batch, state.knockout, state.cell, run.blocks[b],
                             batch_size=run.options.batch_size) for b in idx]

    def result(self, run: Run, state: AblationState, parts: list[tuple[np.ndarray, ...]]) -> PhaseAblation:
        m = stack_metrics(parts, (*METRICS, *KO_FIELDS))
        items = items_from_metrics(run.batch, {k: m[k] for k in METRICS})
        items["correct_ko"] = np.asarray(m["correct_ko"], bool)
        items["logit_diff_ko"] = m["logit_diff_ko"]
        o = run.options

        def effects(groups: np.ndarray, n_groups: int) -> Effects:
            return relative_effects(items["correct"].to_numpy(), items["correct_ko"].to_numpy()[None], groups,
                                    n_groups, clean_ld=items["logit_diff"].to_numpy(),
                                    ko_ld=items["logit_diff_ko"].to_numpy()[None], n_bootstrap=o.n_bootstrap,
                                    seed=o.seed)

        residue = items["residue"].to_numpy()
        cal = state.knockout.calibration
        return PhaseAblation(state.knockout.heads, self.method, effects(residue, run.modulus),
                              effects(residue % run.stride, run.stride), items, run.stride, run.modulus,
                              run.metadata(engine=state.engine, calibration=None if cal is None else cal.source))


@public
def ablate(
    model: PhaseModel,
    heads: Any,
    task: Any = None,
    *,
    method: str = "mean",
    calibration: Any = None,
    engine: str = "auto",
    **options: Unpack[ResamplingOptions],
) -> PhaseAblation:
    """Evaluate ``task`` with and without knocking out ``heads`` at each item's query position.

    Args:
        model: a phaselens model (or adapter, or phase ensemble).
        heads: ``(layer, head)``, ``"L2H3"``, ``"L2"``, ``"L2KV0"``, or a list of these.
        task, phase, n_per_residue, residues, seed, batch_size, stride, progress, journal, n_bootstrap: the common
            options (docs/api.md). A journal holds finished blocks of ``batch_size`` items (clean and knocked
            out); its fingerprint covers the model, the items, the heads, method, calibration, seed, batch size
            and engine, so a journal of another run is refused.
        method: ``"mean"`` (calibration mean, the paper's choice), ``"zero"`` or ``"resample"``.
        calibration: the calibration items for ``mean``/``resample`` (default: the task's own, another seed).
        engine: ``"auto"`` (the query-suffix engine when the model offers it and the heads sit in one layer),
            ``"suffix"`` or ``"full"``; ``metadata["engine"]`` names the one used.

    Example:
        >>> res = phaselens.ablate(phaselens.load("zoo:w8s4"), "L0H3", phase=3, n_per_residue=32)  # doctest: +SKIP
        >>> res.per_phase()  # doctest: +SKIP
    """
    arguments = arguments_of(ablate, locals())
    return run(Ablation.from_arguments(arguments), model, task, arguments)
