"""Layer x head x phase maps: ``specialization_map`` (exact knockouts) and its ``PhaseMap`` result."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Unpack

import numpy as np
import pandas as pd

from phaselens.analyses.knockout_runs import engine_metrics, full_metrics
from phaselens.analyses.knockouts import Calibration, Knockout, calibrate, check_method
from phaselens.analyses.runner import Analysis, Common, ResamplingOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import items_from_logits, score_items
from phaselens.contract.protocol import PhaseModel, choose_engine
from phaselens.core.checks import as_int, as_names
from phaselens.core.errors import InputError, ResidueError
from phaselens.core.labelled import Labelled
from phaselens.core.margins import cell_margins
from phaselens.results.base import Result
from phaselens.runtime.planning import MapPlan, plan_map
from phaselens.stats import benjamini_hochberg
from phaselens.stats.effects import EFFECT_COLUMNS, Effects, mcnemar_p, relative_effects
from phaselens.stats.specialization import specialization

KINDS = ("head", "kv_head", "layer")


def map_cells(cfg: Any, kinds: tuple[str, ...] = KINDS) -> pd.DataFrame:
    """The cells of a map: one row per knockout (``label``, ``kind``, ``layer``, ``heads``).

    A KV head's cell knocks out the query heads that share it. Without GQA sharing (``n_key_value_heads ==
    n_heads``) KV head k is query head k alone: its cells (``L0KV0``, ...) are then made only when ``kinds``
    asks for KV heads without heads, as they would repeat the head cells."""
    kinds = as_names("kinds", kinds, KINDS)
    L, H = int(cfg.n_layers), int(cfg.n_heads)
    Hkv = int(getattr(cfg, "n_key_value_heads", None) or H)
    G = H // Hkv
    rows = []
    for layer in range(L):
        if "head" in kinds:
            rows += [dict(label=f"L{layer}H{h}", kind="head", layer=layer, index=h, heads=(h,)) for h in range(H)]
        if "kv_head" in kinds and (Hkv < H or "head" not in kinds):
            rows += [dict(label=f"L{layer}KV{k}", kind="kv_head", layer=layer, index=k,
                          heads=tuple(range(k * G, (k + 1) * G))) for k in range(Hkv)]
        if "layer" in kinds:
            rows.append(dict(label=f"L{layer}", kind="layer", layer=layer, index=0, heads=tuple(range(H))))
    return pd.DataFrame(rows)


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
        from phaselens import plots

        return plots.head_phase_heatmap(self, **kwargs)


@dataclass(frozen=True)
class MapState:
    """What every cell of a map shares: the calibration, one knockout per cell, the clean outcomes and the
    query-suffix engine (``None`` with full forwards)."""

    calibration: Calibration | None
    knockouts: list[Knockout]
    clean: pd.DataFrame
    engine: Any = None


@dataclass(frozen=True, eq=False)
class Map(Analysis[MapState]):
    """A clean pass, then one unit per cell (a head, KV head or layer knocked out), batched by the engine.
    Checked, ``engine`` is the engine used and ``cells`` the cells of the model's map."""

    name = "specialization_map"
    stage = "map"
    unit = "cell"
    bar_unit = "cell"
    leave = True

    method: str = "mean"
    kinds: Any = KINDS
    calibration: Any = None
    rows_per_pass: int = 4096
    engine: str = "auto"
    plan: bool = False
    cells: pd.DataFrame | None = None

    def check(self, model: PhaseModel, options: Common) -> Map:
        method = check_method(self.method)
        kinds = as_names("kinds", self.kinds, KINDS)
        rows_per_pass = as_int("rows_per_pass", self.rows_per_pass, minimum=1)
        if not isinstance(self.plan, bool):
            raise InputError(f"plan must be True or False, got {self.plan!r}.")
        return replace(self, method=method, kinds=kinds, rows_per_pass=rows_per_pass,
                       engine=choose_engine(model, self.engine), cells=map_cells(model.dims, tuple(kinds)))

    def prices_only(self) -> bool:
        return self.plan

    def dry_run(self, model: PhaseModel, items: Any, options: Common) -> MapPlan:
        return plan_map(model, items, self.cells, engine=self.engine, method=self.method,
                        calibration=self.calibration, batch_size=options.batch_size,
                        rows_per_pass=self.rows_per_pass)

    def prepare(self, run: Run) -> MapState:
        model, batch, o, cells = run.model, run.batch, run.options, self._cells
        layers = sorted(set(cells["layer"]))
        cal = None if self.method == "zero" else calibrate(model, self.calibration, layers, task=run.task,
                                                            batch_size=o.batch_size)
        kos = [Knockout(model, tuple(_heads(row)), self.method, "last", cal, o.seed + i) for i, row in cells.iterrows()]
        if self.engine == "suffix":
            eng = model.query_engine(batch.tokens, batch.query_pos, rows_per_pass=self.rows_per_pass,
                                     batch_size=o.batch_size)
            return MapState(cal, kos, items_from_logits(batch, eng.clean_logits), eng)
        return MapState(cal, kos, score_items(model, batch, batch_size=o.batch_size, desc="clean"))

    @property
    def _cells(self) -> pd.DataFrame:
        assert self.cells is not None, "check() sets the cells"
        return self.cells

    def labels(self, run: Run, state: MapState) -> list[str]:
        return list(self._cells["label"])

    def fields(self, run: Run) -> tuple[str, ...]:
        return ("correct", "logit_diff", "fragile")

    def fingerprint(self, run: Run, state: MapState) -> dict[str, Any]:
        cal = state.calibration
        return dict(task=getattr(run.batch, "task", ""), calibration=None if cal is None else cal.z,
                    method=self.method, seed=run.options.seed, cells=list(self._cells["label"]), stride=run.stride)

    def per_call(self, run: Run, state: MapState) -> int:
        return max(1, self.rows_per_pass // len(run.batch)) if self.engine == "suffix" else 1

    def compute(self, run: Run, state: MapState, idx: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        batch = run.batch
        unmeasured = np.full(len(batch), np.nan)  # fragile: 1.0 / 0.0 where the engine measured it, else NaN
        if state.engine is not None:
            got: list[dict[str, np.ndarray]] = []
            engine_metrics(state.engine, batch, [state.knockouts[i] for i in idx], per_pass=len(idx),
                           on_chunk=lambda _i, m: got.extend(m))
            return [(m["correct"], m["logit_diff"], m["fragile"].astype(float) if "fragile" in m else unmeasured)
                    for m in got]
        return [(m["correct"], m["logit_diff"], unmeasured) for m in
                (full_metrics(run.model, batch, state.knockouts[i], batch_size=run.options.batch_size) for i in idx)]

    def result(self, run: Run, state: MapState, parts: list[tuple[np.ndarray, np.ndarray]]) -> PhaseMap:
        ko_correct = np.stack([d[0] for d in parts]).astype(bool)
        ko_ld = np.stack([d[1] for d in parts])
        clean = state.clean
        clean_correct = clean["correct"].to_numpy().astype(bool)
        residue = clean["residue"].to_numpy()
        o = run.options

        def effects(groups: np.ndarray, n_groups: int) -> Effects:
            return relative_effects(clean_correct, ko_correct, groups, n_groups, clean_ld=clean["logit_diff"].to_numpy(),
                                    ko_ld=ko_ld, n_bootstrap=o.n_bootstrap, seed=o.seed)

        cal = state.calibration
        fragile = cell_margins(np.stack([d[2] for d in parts]), run.model.dims.dtype)
        return PhaseMap(self._cells, effects(residue, run.modulus), effects(residue % run.stride, run.stride),
                        clean_correct, ko_correct, clean["logit_diff"].to_numpy(), ko_ld, residue,
                        run.stride, run.modulus, self.method, run.model.dims.n_layers, run.model.dims.n_heads,
                        run.metadata(engine=self.engine, calibration=None if cal is None else cal.source,
                                     rounding_margins=fragile))



@public
def specialization_map(
    model: PhaseModel,
    task: Any = None,
    *,
    n_per_residue: int = 64,
    method: str = "mean",
    kinds: tuple[str, ...] = KINDS,
    calibration: Any = None,
    rows_per_pass: int = 4096,
    engine: str = "auto",
    plan: bool = False,
    **options: Unpack[ResamplingOptions],
) -> PhaseMap | MapPlan:
    """Knock out every head (and KV head, and layer) at each item's query position; effects per residue.

    Args:
        model: a phaselens model (our model, the DeepSeek-V4 adapter, or a phase ensemble).
        task, n_per_residue, residues, seed, batch_size, stride, progress, checkpoint, n_bootstrap: the common
            options (docs/api.md). A checkpoint holds finished cells (one safetensors file, its manifest in the
            header); its fingerprint covers every parameter of the model, its ``analysis_metadata``, the items,
            the calibration and every setting that changes the numbers, so a checkpoint of another map is
            refused.
        method: ``"mean"``, ``"zero"`` or ``"resample"`` replacement of ``z``.
        kinds: which cells to map (drawn from ``("head", "kv_head", "layer")``).
        calibration: the calibration items for ``mean``/``resample`` (default: the task's own, another seed).
        rows_per_pass: query rows per batched engine pass.
        engine: ``"auto"`` (the fastest exact engine the model offers), ``"suffix"`` (the query-suffix engine:
            the clean prefix once, then only the query rows per cell) or ``"full"`` (one full forward per cell,
            the reference way); ``metadata["engine"]`` names the one used.
        plan: a dry run: return a :class:`~phaselens.runtime.planning.MapPlan` (cells, forwards, token passes, a
            memory estimate) for this model, task and settings without running the model (items are built).

    Example:
        >>> pm = phaselens.specialization_map(phaselens.load("zoo:w4s4"), n_per_residue=32)  # doctest: +SKIP
        >>> pm.specialization_index().head()  # doctest: +SKIP
    """
    return run(Map(method, kinds, calibration, rows_per_pass, engine, plan), model, task,
               arguments_of(specialization_map, locals()))


def _heads(row: pd.Series) -> list[Any]:
    from phaselens.core.heads import Head

    return [Head(int(row.layer), int(h)) for h in row.heads]
