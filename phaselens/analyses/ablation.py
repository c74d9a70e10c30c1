"""``phaselens.ablate(model, heads, phase)``: accuracy with and without a knockout, per residue and phase."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.analyses.items import build_items, check_options
from phaselens.analyses.knockout_runs import KO_FIELDS, ablate_blocks
from phaselens.analyses.knockouts import knockout
from phaselens.contract.protocol import PhaseModel, choose_engine, metadata_of
from phaselens.core.heads import Head
from phaselens.results.base import Result
from phaselens.runtime.checkpoints import check_checkpoint_path
from phaselens.runtime.distributed import open_checkpoint, sharded
from phaselens.stats.effects import Effects, relative_effects


@dataclass(frozen=True, repr=False, eq=False)
class AblationResult(Result):
    """Clean against knocked-out accuracy for one set of heads.

    ``effects`` holds ``[1, residues]`` arrays (see :class:`~phaselens.stats.effects.Effects`); ``items`` one row
    per item with ``correct`` / ``correct_ko`` and ``logit_diff`` / ``logit_diff_ko``.
    """

    LEVELS = ("residue", "phase", "item")

    heads: tuple[Head, ...]
    method: str
    effects: Effects
    items: pd.DataFrame
    stride: int
    modulus: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def per_residue(self) -> pd.DataFrame:
        """One row per residue with items: clean and KO accuracy, relative change with its bootstrap CI,
        McNemar p, and the mean change of the logit difference."""
        return _frame(self.effects, self.modulus, self.stride, "residue")

    def per_phase(self) -> pd.DataFrame:
        """Residues folded mod S: the same columns per phase, plus ``boundary``."""
        it = self.items
        eff = relative_effects(it["correct"].to_numpy(), it["correct_ko"].to_numpy()[None],
                               it["residue"].to_numpy() % self.stride, self.stride,
                               clean_ld=it["logit_diff"].to_numpy(), ko_ld=it["logit_diff_ko"].to_numpy()[None],
                               n_bootstrap=int(self.metadata.get("arguments", {}).get("n_bootstrap", 1000)),
                               seed=int(self.metadata.get("arguments", {}).get("seed", 0)))
        out = _frame(eff, self.stride, self.stride, "phase")
        out["boundary"] = out["phase"] == self.stride - 1
        return out

    def per_item(self) -> pd.DataFrame:
        return self.items.copy()

    def summary(self) -> str:
        ph = self.per_phase()
        heads = ", ".join(map(str, self.heads[:6])) + ("..." if len(self.heads) > 6 else "")
        lines = [f"AblationResult: knock out {heads} ({self.method}) on {len(self.items)} items, stride {self.stride}"]
        for row in ph.itertuples():
            rc = "undefined (clean acc < 2%)" if row.undefined else (
                f"{row.rel_change:+.1f}% [{row.ci_low:+.1f}, {row.ci_high:+.1f}], p={row.pvalue:.2g}")
            lines.append(f"  phase {row.phase}{' (boundary)' if row.boundary else ''}: clean {100 * row.clean_acc:.1f}% "
                         f"-> KO {100 * row.ko_acc:.1f}%  ({rc})")
        return "\n".join(lines)

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.phase_rose(self, **kwargs)


def _frame(e: Effects, n_groups: int, stride: int, level: str) -> pd.DataFrame:
    g = np.arange(n_groups)
    df = pd.DataFrame({
        level: g, **({"phase": g % stride} if level == "residue" else {}), "n": e.n,
        "clean_acc": e.clean_acc, "ko_acc": e.ko_acc[0], "rel_change": e.rel_change[0],
        "ci_low": e.ci_low[0], "ci_high": e.ci_high[0], "pvalue": e.pvalue[0],
        "delta_logit_diff": e.delta_logit_diff[0], "undefined": e.undefined[0],
    })
    return df[df["n"] > 0].reset_index(drop=True)


@sharded
def ablate(
    model: PhaseModel,
    heads: Any,
    phase: int | Sequence[int] | None = None,
    *,
    task: Any = None,
    method: str = "mean",
    n_per_residue: int = 128,
    residues: Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int = 64,
    calibration: Any = None,
    n_bootstrap: int = 1000,
    progress: bool = True,
    stride: int | None = None,
    engine: str = "auto",
    checkpoint: str | os.PathLike | None = None,
) -> AblationResult:
    """Evaluate ``task`` with and without knocking out ``heads`` at each item's query position.

    Args:
        model: a phaselens model (or adapter, or phase ensemble).
        heads: ``(layer, head)``, ``"L2H3"``, ``"L2"``, ``"L2KV0"``, or a list of these.
        phase: phases (residue mod S) to evaluate: an int, a list, or ``None`` for all (or pass ``residues``).
        method: ``"mean"`` (calibration mean, the paper's choice), ``"zero"`` or ``"resample"``.
        engine: ``"auto"`` (the query-suffix engine when the model offers it and the heads sit in one layer),
            ``"suffix"`` or ``"full"``; ``metadata["engine"]`` names the one used.
        checkpoint: a file path: finished blocks of ``batch_size`` items (clean and knocked out) are written
            there atomically and a rerun (with any number of processes) resumes. The fingerprint covers the
            model, the items, the heads, method, calibration, seed, batch size and engine: a checkpoint of
            another run is refused.

    Example:
        >>> res = phaselens.ablate(phaselens.load("zoo:w8s4"), "L0H3", phase=3, n_per_residue=32)  # doctest: +SKIP
        >>> res.per_phase()  # doctest: +SKIP
    """
    check_options(batch_size=batch_size, progress=progress, n_bootstrap=n_bootstrap)
    check_checkpoint_path(checkpoint)
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, phase=phase, residues=residues,
                                    seed=seed, stride=stride)
    used = choose_engine(model, engine)  # a bad engine is refused before the calibration runs
    ko = knockout(model, heads, method=method, calibration=calibration, task=task, seed=seed)
    if used == "suffix" and engine == "auto" and len({h.layer for h in ko.heads}) > 1:
        used = "full"  # the engine intervenes at one layer per cell
    store = None
    if checkpoint is not None:
        from phaselens.analyses.scoring import METRICS
        from phaselens.runtime.fingerprints import analysis_fingerprint

        cal = ko.calibration
        fp = analysis_fingerprint(model, analysis="ablate", items=batch.tokens, query_pos=batch.query_pos,
                                  answers=batch.answer, wrong=batch.wrong, heads=[str(h) for h in ko.heads],
                                  method=method, calibration=None if cal is None else cal.z, seed=seed,
                                  batch_size=batch_size, engine=used)
        store = open_checkpoint(checkpoint, fp, (*METRICS, *KO_FIELDS))
    # one unit per block of batch_size items (clean and knocked out): the blocks are split across ranks
    clean, ablated = ablate_blocks(model, batch, ko, engine=used, batch_size=batch_size, progress=progress,
                                   store=store)
    items = clean.copy()
    items["correct_ko"] = np.asarray(ablated["correct"], bool)
    items["logit_diff_ko"] = ablated["logit_diff"]
    eff = relative_effects(
        items["correct"].to_numpy(), items["correct_ko"].to_numpy()[None], items["residue"].to_numpy(),
        batch.modulus, clean_ld=items["logit_diff"].to_numpy(), ko_ld=items["logit_diff_ko"].to_numpy()[None],
        n_bootstrap=n_bootstrap, seed=seed,
    )
    meta = metadata_of(model, heads=[str(h) for h in ko.heads], phase=phase, residues=residues, method=method,
                       n_per_residue=n_per_residue, seed=seed, batch_size=batch_size, n_bootstrap=n_bootstrap,
                       stride=stride, engine=engine, checkpoint=None if checkpoint is None else str(checkpoint))
    meta.update(engine=used, calibration=None if ko.calibration is None else ko.calibration.source)
    return AblationResult(ko.heads, method, eff, items, spec.stride, batch.modulus, meta)
