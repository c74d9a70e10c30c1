"""``phaselens.ablate(model, heads, phase)``: accuracy with and without a knockout, per residue and phase."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.effects import EPS_CLEAN, Effects, relative_effects
from phaselens.evaluate import score_items
from phaselens.heads import Head, parse_heads
from phaselens.interventions.knockout import knockout
from phaselens.protocol import build_items
from phaselens.scoring import model_logits


@dataclass(frozen=True, repr=False, eq=False)
class AblationResult:
    """Clean against knocked-out accuracy for one set of heads.

    ``effects`` holds ``[1, residues]`` arrays (see :class:`~phaselens.effects.Effects`); ``items`` one row
    per item with ``correct`` / ``correct_ko`` and ``logit_diff`` / ``logit_diff_ko``.
    """

    heads: tuple[Head, ...]
    method: str
    effects: Effects
    items: pd.DataFrame
    stride: int
    modulus: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def per_residue(self) -> pd.DataFrame:
        e = self.effects
        df = pd.DataFrame({
            "residue": np.arange(self.modulus), "phase": np.arange(self.modulus) % self.stride, "n": e.n,
            "clean_acc": e.clean_acc, "ko_acc": e.ko_acc[0], "rel_change": e.rel_change[0],
            "ci_low": e.ci_low[0], "ci_high": e.ci_high[0], "pvalue": e.pvalue[0],
            "delta_logit_diff": e.delta_logit_diff[0], "undefined": e.undefined[0],
        })
        return df[df["n"] > 0].reset_index(drop=True)

    def per_phase(self) -> pd.DataFrame:
        """Residues folded mod S: pooled clean and KO accuracy and the relative change."""
        it = self.items
        g = it.groupby(it["residue"] % self.stride)
        df = pd.DataFrame({"n": g.size(), "clean_acc": g["correct"].mean(), "ko_acc": g["correct_ko"].mean()})
        df.index.name = "phase"
        df = df.reset_index()
        ok = df["clean_acc"] >= EPS_CLEAN
        df["rel_change"] = np.where(ok, 100 * (df["ko_acc"] - df["clean_acc"]) / df["clean_acc"].where(ok), np.nan)
        df["undefined"] = ~ok
        df["boundary"] = df["phase"] == self.stride - 1
        return df

    def to_frame(self) -> pd.DataFrame:
        return self.per_residue()

    def summary(self) -> str:
        ph = self.per_phase()
        heads = ", ".join(map(str, self.heads[:6])) + ("..." if len(self.heads) > 6 else "")
        lines = [f"AblationResult: knock out {heads} ({self.method}) on {len(self.items)} items, stride {self.stride}"]
        for row in ph.itertuples():
            rc = "undefined (clean acc < eps)" if row.undefined else f"{row.rel_change:+.1f}%"
            lines.append(f"  phase {row.phase}{' (boundary)' if row.boundary else ''}: clean {100 * row.clean_acc:.1f}% "
                         f"-> KO {100 * row.ko_acc:.1f}%  ({rc})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.phase_rose(self, **kwargs)


def ablate(
    model: Any,
    heads: Any,
    phase: int | Sequence[int] | None = None,
    *,
    task: Any = None,
    method: str = "mean",
    n_per_residue: int = 128,
    seed: int = 0,
    batch_size: int = 64,
    calibration: Any = None,
    n_bootstrap: int = 1000,
    progress: bool = True,
    stride: int | None = None,
) -> AblationResult:
    """Evaluate ``task`` with and without knocking out ``heads`` at the query position.

    Args:
        model: a phaselens model (or adapter).
        heads: ``(layer, head)``, ``"L2H3"``, ``"L2"``, ``"L2KV0"``, or a list of these.
        phase: phases (residue mod S) to evaluate: an int, a list, or ``None`` for all.
        method: ``"mean"`` (calibration mean, the paper's choice), ``"zero"`` or ``"resample"``.

    Example:
        >>> res = phaselens.ablate(phaselens.load("zoo:w4s4"), "L1H2", phase=0)  # doctest: +SKIP
        >>> res.per_phase()  # doctest: +SKIP
    """
    parsed = parse_heads(heads, model.cfg)
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, phase=phase, seed=seed, stride=stride)
    clean = score_items(model, batch, batch_size=batch_size, progress=progress)
    with knockout(model, parsed, method=method, calibration=calibration, task=task, seed=seed) as ko:
        def forward(tokens, query_pos):
            ko.positions = query_pos
            return model_logits(model, tokens, query_pos)

        ablated = score_items(model, batch, batch_size=batch_size, progress=progress, forward=forward)
    items = clean.copy()
    items["correct_ko"] = ablated["correct"].to_numpy()
    items["logit_diff_ko"] = ablated["logit_diff"].to_numpy()
    eff = relative_effects(
        items["correct"].to_numpy(), items["correct_ko"].to_numpy()[None], items["residue"].to_numpy(),
        batch.modulus, clean_ld=items["logit_diff"].to_numpy(), ko_ld=items["logit_diff_ko"].to_numpy()[None],
        n_bootstrap=n_bootstrap, seed=seed,
    )
    meta = {"n_per_residue": n_per_residue, "seed": seed, "phase": phase, "engine": "full forwards"}
    return AblationResult(parsed, method, eff, items, spec.stride, batch.modulus, meta)
