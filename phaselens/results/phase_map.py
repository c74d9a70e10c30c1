"""The result of ``specialization_map``: knockout effects of every cell at every residue (:class:`PhaseMap`), and the kinds of cell a map holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.labelled import Labelled
from phaselens.errors import InputError, ResidueError
from phaselens.results.base import Result
from phaselens.stats import benjamini_hochberg
from phaselens.stats.effects import EFFECT_COLUMNS, Effects, mcnemar_p
from phaselens.stats.specialization import specialization

KINDS = ("head", "kv_head", "layer")


@dataclass(frozen=True, repr=False, eq=False)
class PhaseMap(Result):
    """Knockout effects of every cell (head, KV head, layer) at every residue.

    Attributes:
        cells: one row per cell (``label``, ``kind``, ``layer``, ``index``, ``heads``).
        effects: :class:`~phaselens.stats.effects.Effects` ``[cells, residues]``: relative accuracy change (percent)
            with bootstrap CIs and exact McNemar p-values; ``phase_effects`` ``[cells, phases]`` the same with
            residues folded mod S (the same resampling).
        correct, logit_diff: ``[N]`` clean outcomes; correct_ko, logit_diff_ko: ``[cells, N]`` with each cell
            knocked out; residue: ``[N]`` (the item-level outcomes, named as in every result).
        stride, modulus, method, metadata.
    """

    LEVELS = ("residue", "phase")
    COLUMNS = {
        "residue": ("label", "kind", "layer", "index", "residue", "phase", *EFFECT_COLUMNS),
        "phase": ("label", "kind", "layer", "index", "phase", *EFFECT_COLUMNS, "boundary"),
    }

    cells: pd.DataFrame
    effects: Effects
    phase_effects: Effects
    correct: np.ndarray
    correct_ko: np.ndarray
    logit_diff: np.ndarray
    logit_diff_ko: np.ndarray
    residue: np.ndarray
    stride: int
    modulus: int
    method: str
    n_layers: int
    n_heads: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def _select(self, kind: str) -> pd.DataFrame:
        sel = self.cells[self.cells["kind"] == kind]
        if sel.empty:
            same = " (this model's KV heads are its heads, one each: kind='head' holds the same cells)" if (
                kind == "kv_head" and (self.cells["kind"] == "head").any()) else ""
            raise InputError(f"this map has no {kind!r} cells{same}; kinds present: {sorted(set(self.cells['kind']))}; "
                             f"map them with specialization_map(..., kinds=({kind!r},)).")
        return sel

    def values(self, kind: str = "head", quantity: str = "rel_change") -> Labelled:
        """``quantity`` (``rel_change``, ``ko_acc``, ``pvalue``, ``delta_logit_diff``) as
        ``Labelled[layer, head|kv_head, residue]`` (``[layer, residue]`` for ``kind="layer"``)."""
        sel = self._select(kind)
        arr = getattr(self.effects, quantity)
        lo = self.effects.ci_low if quantity == "rel_change" else None
        hi = self.effects.ci_high if quantity == "rel_change" else None
        layers = np.arange(self.n_layers)
        res = np.arange(self.modulus)
        if kind == "layer":
            idx = sel.index.to_numpy()
            return Labelled(arr[idx], ("layer", "residue"), {"layer": layers, "residue": res},
                            None if lo is None else lo[idx], None if hi is None else hi[idx], name=quantity)
        n_idx = int(sel["index"].max()) + 1
        dim = "head" if kind == "head" else "kv_head"
        rows, li, hi_idx = sel.index.to_numpy(), sel["layer"].to_numpy(int), sel["index"].to_numpy(int)
        out = np.full((self.n_layers, n_idx, self.modulus), np.nan)
        olo, ohi = out.copy(), out.copy()
        out[li, hi_idx] = arr[rows]
        if lo is not None and hi is not None:
            olo[li, hi_idx], ohi[li, hi_idx] = lo[rows], hi[rows]
        return Labelled(out, ("layer", dim, "residue"), {"layer": layers, dim: np.arange(n_idx), "residue": res},
                        olo if lo is not None else None, ohi if hi is not None else None, name=quantity)


    def _phase_frame(self, kind: str) -> pd.DataFrame:
        """Residues folded mod S, one row per cell of ``kind`` and phase (from ``phase_effects``)."""
        sel = self._select(kind)
        idx = sel.index.to_numpy()
        S = self.stride
        e = self.phase_effects
        C = len(idx)
        return pd.DataFrame({
            "label": np.repeat(sel["label"].to_numpy(), S), "kind": kind, "layer": np.repeat(sel["layer"].to_numpy(), S),
            "index": np.repeat(sel["index"].to_numpy(), S), "phase": np.tile(np.arange(S), C), "n": np.tile(e.n, C),
            "clean_acc": np.tile(e.clean_acc, C), "ko_acc": e.ko_acc[idx].ravel(), "rel_change": e.rel_change[idx].ravel(),
            "ci_low": e.ci_low[idx].ravel(), "ci_high": e.ci_high[idx].ravel(), "pvalue": e.pvalue[idx].ravel(),
            "delta_logit_diff": e.delta_logit_diff[idx].ravel(), "undefined": e.undefined[idx].ravel(),
            "boundary": np.tile(np.arange(S) == S - 1, C),
        }).query("n > 0").reset_index(drop=True)  # phases with items (all, unless residues=... was passed)

    def per_phase(self, kind: str | None = None) -> pd.DataFrame:
        """Residues folded mod S, one row per cell and phase: pooled clean / KO accuracy, relative change
        with its bootstrap CI, McNemar p and the logit-difference change; for one ``kind`` of cell, or every
        kind present (``None``)."""
        kinds = [kind] if kind else [k for k in KINDS if (self.cells["kind"] == k).any()]
        return pd.concat([self._phase_frame(k) for k in kinds], ignore_index=True)

    def bh_mask(self, alpha: float = 0.05, kind: str | None = None) -> np.ndarray:
        """Benjamini-Hochberg significance over the cells x residues p-values: bool ``[cells, residues]``."""
        p = self.effects.pvalue.copy()
        keep = np.ones(len(self.cells), bool)
        if kind is not None:  # a kind the map lacks is refused, not answered with an all-False mask
            keep = np.isin(np.arange(len(self.cells)), self._select(kind).index.to_numpy())
        out = np.zeros_like(p, dtype=bool)
        flat = p[keep].ravel()
        ok = ~np.isnan(flat)
        adj = np.full(flat.shape, np.nan)
        adj[ok] = benjamini_hochberg(flat[ok])
        out[keep] = (adj <= alpha).reshape(p[keep].shape)
        return out

    def specialization_index(self, alpha: float = 0.05, kind: str = "head", *, n_permutations: int = 200,
                             n_bootstrap: int = 200) -> pd.DataFrame:
        """Per cell: how concentrated its damage is over the S phases, corrected for small-sample bias.

        ``specialization`` is 0 for damage that does not depend on the phase and 1 when one phase takes all
        of it, with a 95% bootstrap CI (``ci_low``, ``ci_high``) and a permutation p-value ``p_perm``; see
        :mod:`phaselens.stats.specialization`. ``score`` (specialization x damage at the worst phase) ranks the
        cells: the table is sorted by it, so a head with negligible damage never heads it. ``significant``:
        a harmful total effect (pooled McNemar, Benjamini-Hochberg at ``alpha`` across cells) and phase
        dependence (``p_perm``, BH at ``alpha``). A cell whose knockout damages no phase has no
        specialization: ``specialization`` and its interval are NaN and ``note`` says ``"no damage"``.
        """
        sel = self._select(kind)
        idx = sel.index.to_numpy()
        seed = int(self.metadata.get("arguments", {}).get("seed", 0))
        sp = specialization(self.correct, self.correct_ko[idx], self.residue % self.stride, self.stride,
                            n_permutations=n_permutations, n_bootstrap=n_bootstrap, seed=seed)
        p_total = mcnemar_p(self.correct[None], self.correct_ko[idx])
        harmful = self.correct_ko[idx].mean(1) < self.correct.mean()
        sig = (benjamini_hochberg(p_total) <= alpha) & harmful & (benjamini_hochberg(sp.p_perm) <= alpha)
        out = pd.DataFrame({
            "label": sel["label"].to_numpy(), "layer": sel["layer"].to_numpy(), "index": sel["index"].to_numpy(),
            "specialization": sp.specialization, "ci_low": sp.ci_low, "ci_high": sp.ci_high, "p_perm": sp.p_perm,
            "raw_index": sp.raw, "null_mean": sp.null_mean, "worst_phase": sp.worst_phase,
            "worst_damage": sp.worst_damage, "mean_damage": sp.mean_damage, "score": sp.score,
            "p_total": p_total, "significant": sig,
            "note": np.where(sp.worst_damage > 0, "", "no damage"),
        })
        return out.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)

    def most_specialized(self, k: int = 3, kind: str = "head") -> pd.DataFrame:
        """The ``k`` significant cells with the highest ``score`` (see :meth:`specialization_index`)."""
        si = self.specialization_index(kind=kind)
        return si[si["significant"]].head(k).reset_index(drop=True)

    def top_heads(self, phase: int, k: int = 5, kind: str = "head", by: str = "rel_change") -> pd.DataFrame:
        """The ``k`` cells whose knockout hurts ``phase`` most: most negative ``by`` (``rel_change`` or
        ``delta_logit_diff``); cells with an undefined value sort last."""
        ph = self.per_phase(kind)
        if not (ph["phase"] == phase).any():  # in 0..S-1 (checked) but without items: not an empty table
            raise ResidueError(f"phase {phase} has no items in this map (phases with items: "
                               f"{sorted(set(ph['phase'].tolist()))}); pick one of those, or map that phase.")
        return ph[ph["phase"] == phase].sort_values(by, na_position="last").head(k).reset_index(drop=True)

    def per_residue(self) -> pd.DataFrame:
        """Tidy rows per (cell, residue) with every effect quantity."""
        e = self.effects
        C, M = e.ko_acc.shape
        res = np.tile(np.arange(M), C)
        out = {col: np.repeat(self.cells[col].to_numpy(), M) for col in ("label", "kind", "layer", "index")}
        out.update(residue=res, phase=res % self.stride, n=np.tile(e.n, C), clean_acc=np.tile(e.clean_acc, C))
        for name in ("ko_acc", "rel_change", "ci_low", "ci_high", "pvalue", "delta_logit_diff", "undefined"):
            out[name] = getattr(e, name).ravel()
        frame = pd.DataFrame(out)
        return frame[frame["n"] > 0].reset_index(drop=True)  # residues with items (all, unless residues=...)

    def summary(self) -> str:
        kinds = self.cells["kind"].value_counts().to_dict()
        kind = "head" if "head" in kinds else next(iter(kinds))
        top = self.most_specialized(3, kind=kind)
        tops = ", ".join(f"{r.label} {r.specialization:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}] at phase {r.worst_phase} "
                         f"(-{100 * r.worst_damage:.0f}%)" for r in top.itertuples())
        return (f"PhaseMap({self.method} knockouts; cells {kinds}; {len(self.residue)} items, stride {self.stride}, "
                f"residues mod {self.modulus}; engine {self.metadata.get('engine', '?')}; most specialized "
                f"{kind}s: {tops or 'none significant'})")

    def plot(self, **kwargs: Any):
        return self._figure("head_phase_heatmap", **kwargs)
