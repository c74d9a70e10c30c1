"""Layer x head x phase maps: ``specialization_map`` (exact knockouts) and its ``PhaseMap`` result."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.analyses.items import build_items, check_options
from phaselens.analyses.knockout_runs import engine_metrics, full_metrics
from phaselens.analyses.knockouts import Knockout, calibrate, check_method
from phaselens.analyses.scoring import items_from_logits, score_items
from phaselens.contract.protocol import PhaseModel, choose_engine, metadata_of, model_name
from phaselens.core.checks import as_int, as_names
from phaselens.core.errors import InputError
from phaselens.core.labelled import Labelled
from phaselens.results.base import Result
from phaselens.runtime.checkpoints import check_checkpoint_path
from phaselens.runtime.distributed import open_checkpoint, shard_map, sharded
from phaselens.runtime.fingerprints import analysis_fingerprint
from phaselens.runtime.planning import MapPlan, plan_map
from phaselens.stats import benjamini_hochberg
from phaselens.stats.effects import Effects, mcnemar_p, relative_effects
from phaselens.stats.specialization import specialization

KINDS = ("head", "kv_head", "layer")


def map_cells(cfg: Any, kinds: tuple[str, ...] = KINDS) -> pd.DataFrame:
    """The cells of a map: one row per knockout (``label``, ``kind``, ``layer``, ``heads``)."""
    kinds = as_names("kinds", kinds, KINDS)
    L, H = int(cfg.n_layers), int(cfg.n_heads)
    Hkv = int(getattr(cfg, "n_key_value_heads", None) or H)
    G = H // Hkv
    rows = []
    for layer in range(L):
        if "head" in kinds:
            rows += [dict(label=f"L{layer}H{h}", kind="head", layer=layer, index=h, heads=(h,)) for h in range(H)]
        if "kv_head" in kinds and Hkv < H:
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
            with bootstrap CIs and exact McNemar p-values.
        clean_correct, clean_logit_diff: ``[N]``; ko_correct, ko_logit_diff: ``[cells, N]``; residue: ``[N]``
            (the item-level outcomes).
        stride, modulus, method, metadata.
    """

    cells: pd.DataFrame
    effects: Effects
    clean_correct: np.ndarray
    ko_correct: np.ndarray
    clean_logit_diff: np.ndarray
    ko_logit_diff: np.ndarray
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
            raise InputError(f"this map has no {kind!r} cells; kinds present: {sorted(set(self.cells['kind']))}; map "
                             f"them with specialization_map(..., kinds=({kind!r},)).")
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

    def by_phase(self, kind: str = "head", *, n_bootstrap: int | None = None) -> pd.DataFrame:
        """Residues folded mod S, one row per cell and phase: pooled clean / KO accuracy, relative change
        with its bootstrap CI (``n_bootstrap`` resamples; default the map's own), McNemar p and the
        logit-difference change."""
        sel = self._select(kind)
        idx = sel.index.to_numpy()
        S = self.stride
        args = self.metadata.get("arguments", {})
        e = relative_effects(self.clean_correct, self.ko_correct[idx], self.residue % S, S,
                             clean_ld=self.clean_logit_diff, ko_ld=self.ko_logit_diff[idx],
                             n_bootstrap=int(args.get("n_bootstrap", 500) if n_bootstrap is None else n_bootstrap),
                             seed=int(args.get("seed", 0)))
        C = len(idx)
        return pd.DataFrame({
            "label": np.repeat(sel["label"].to_numpy(), S), "kind": kind, "layer": np.repeat(sel["layer"].to_numpy(), S),
            "index": np.repeat(sel["index"].to_numpy(), S), "phase": np.tile(np.arange(S), C), "n": np.tile(e.n, C),
            "clean_acc": np.tile(e.clean_acc, C), "ko_acc": e.ko_acc.ravel(), "rel_change": e.rel_change.ravel(),
            "ci_low": e.ci_low.ravel(), "ci_high": e.ci_high.ravel(), "pvalue": e.pvalue.ravel(),
            "delta_logit_diff": e.delta_logit_diff.ravel(), "undefined": e.undefined.ravel(),
            "boundary": np.tile(np.arange(S) == S - 1, C),
        }).query("n > 0").reset_index(drop=True)  # phases with items (all, unless residues=... was passed)

    def per_phase(self, kind: str | None = None) -> pd.DataFrame:
        """:meth:`by_phase` for one ``kind`` of cell, or every kind present (``None``)."""
        kinds = [kind] if kind else [k for k in KINDS if (self.cells["kind"] == k).any()]
        return pd.concat([self.by_phase(k) for k in kinds], ignore_index=True)

    def bh_mask(self, alpha: float = 0.05, kind: str | None = None) -> np.ndarray:
        """Benjamini-Hochberg significance over the cells x residues p-values: bool ``[cells, residues]``."""
        p = self.effects.pvalue.copy()
        keep = np.ones(len(self.cells), bool) if kind is None else (self.cells["kind"] == kind).to_numpy()
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
        dependence (``p_perm``, BH at ``alpha``).
        """
        sel = self._select(kind)
        idx = sel.index.to_numpy()
        seed = int(self.metadata.get("arguments", {}).get("seed", 0))
        sp = specialization(self.clean_correct, self.ko_correct[idx], self.residue % self.stride, self.stride,
                            n_permutations=n_permutations, n_bootstrap=n_bootstrap, seed=seed)
        p_total = mcnemar_p(self.clean_correct[None], self.ko_correct[idx])
        harmful = self.ko_correct[idx].mean(1) < self.clean_correct.mean()
        sig = (benjamini_hochberg(p_total) <= alpha) & harmful & (benjamini_hochberg(sp.p_perm) <= alpha)
        out = pd.DataFrame({
            "label": sel["label"].to_numpy(), "layer": sel["layer"].to_numpy(), "index": sel["index"].to_numpy(),
            "specialization": sp.specialization, "ci_low": sp.ci_low, "ci_high": sp.ci_high, "p_perm": sp.p_perm,
            "raw_index": sp.raw, "null_mean": sp.null_mean, "worst_phase": sp.worst_phase,
            "worst_damage": sp.worst_damage, "mean_damage": sp.mean_damage, "score": sp.score,
            "p_total": p_total, "significant": sig,
        })
        return out.sort_values("score", ascending=False, kind="stable").reset_index(drop=True)

    def most_specialized(self, k: int = 3, kind: str = "head") -> pd.DataFrame:
        """The ``k`` significant cells with the highest ``score`` (see :meth:`specialization_index`)."""
        si = self.specialization_index(kind=kind)
        return si[si["significant"]].head(k).reset_index(drop=True)

    def top_heads(self, phase: int, k: int = 5, kind: str = "head", by: str = "rel_change") -> pd.DataFrame:
        """The ``k`` cells whose knockout hurts ``phase`` most: most negative ``by`` (``rel_change`` or
        ``delta_logit_diff``); cells with an undefined value sort last."""
        ph = self.by_phase(kind)
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


@sharded
def specialization_map(
    model: PhaseModel,
    task: Any = None,
    *,
    method: str = "mean",
    n_per_residue: int = 64,
    residues: Any = None,
    seed: int = 0,
    kinds: tuple[str, ...] = KINDS,
    calibration: Any = None,
    batch_size: int = 64,
    rows_per_pass: int = 4096,
    checkpoint: str | os.PathLike | None = None,
    n_bootstrap: int = 500,
    progress: bool = True,
    stride: int | None = None,
    engine: str = "auto",
    plan: bool = False,
) -> PhaseMap | MapPlan:
    """Knock out every head (and KV head, and layer) at each item's query position; effects per residue.

    Args:
        model: a phaselens model (our model, the DeepSeek-V4 adapter, or a phase ensemble).
        method: ``"mean"``, ``"zero"`` or ``"resample"`` replacement of ``z``.
        kinds: which cells to map (drawn from ``("head", "kv_head", "layer")``).
        checkpoint: a file path (any name): finished cells are written there atomically (one safetensors file,
            its manifest in the header) and a rerun resumes from it. The run's fingerprint covers every
            parameter of the model, its ``analysis_metadata``, the items, the calibration and every setting
            that changes the numbers: a checkpoint of another map is refused.
        engine: ``"auto"`` (the fastest exact engine the model offers), ``"suffix"`` (the query-suffix engine:
            the clean prefix once, then only the query rows per cell) or ``"full"`` (one full forward per cell,
            the reference way); ``metadata["engine"]`` names the one used.
        plan: a dry run: return a :class:`~phaselens.runtime.planning.MapPlan` (cells, forwards, token passes, a memory
            estimate) for this model, task and settings without running the model (items are built).

    Example:
        >>> pm = phaselens.specialization_map(phaselens.load("zoo:w4s4"), n_per_residue=32)  # doctest: +SKIP
        >>> pm.specialization_index().head()  # doctest: +SKIP
    """
    method = check_method(method)
    kinds = as_names("kinds", kinds, KINDS)
    check_options(batch_size=batch_size, progress=progress, n_bootstrap=n_bootstrap)
    rows_per_pass = as_int("rows_per_pass", rows_per_pass, minimum=1)
    check_checkpoint_path(checkpoint)
    used = choose_engine(model, engine)
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, residues=residues, seed=seed,
                                    stride=stride)
    cells = map_cells(model.cfg, tuple(kinds))
    if not isinstance(plan, bool):
        raise InputError(f"plan must be True or False, got {plan!r}.")
    if plan:
        return plan_map(model, batch, cells, engine=used, method=method, calibration=calibration,
                        batch_size=batch_size, rows_per_pass=rows_per_pass)
    layers = sorted(set(cells["layer"]))
    cal = None if method == "zero" else calibrate(model, calibration, layers, task=task, batch_size=batch_size)
    kos = [Knockout(model, tuple(_heads(row)), method, "last", cal, seed + i) for i, row in cells.iterrows()]
    fp = None
    if checkpoint is not None:  # hashing every parameter is cheap here, but only needed to resume
        fp = analysis_fingerprint(model, task=getattr(batch, "task", ""), items=batch.tokens, answers=batch.answer,
                                  query_pos=batch.query_pos, calibration=None if cal is None else cal.z,
                                  method=method, seed=seed, cells=list(cells["label"]), stride=spec.stride)
    ckpt = open_checkpoint(checkpoint, fp or "", fields=("correct", "logit_diff"))
    model_name(model)
    per_call = 1
    if used == "suffix":
        eng = model.query_engine(batch.tokens, batch.query_pos, rows_per_pass=rows_per_pass, batch_size=batch_size)
        clean = items_from_logits(batch, eng.clean_logits)
        per_call = max(1, rows_per_pass // len(batch))

        def compute(idx: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
            got: list[dict[str, np.ndarray]] = []
            engine_metrics(eng, batch, [kos[i] for i in idx], per_pass=len(idx), on_chunk=lambda _i, m: got.extend(m))
            return [(m["correct"], m["logit_diff"]) for m in got]
    else:
        clean = score_items(model, batch, batch_size=batch_size, desc="clean")

        def compute(idx: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
            return [(m["correct"], m["logit_diff"]) for m in
                    (full_metrics(model, batch, kos[i], batch_size=batch_size) for i in idx)]
    # cells split across ranks under torch.distributed; finished cells checkpointed after every round
    done = shard_map(compute, list(cells["label"]), per_call=per_call, store=ckpt, unit="cell", progress=progress,
                     stage="map", bar_unit="cell", leave=True, model=model)
    ko_correct = np.stack([d[0] for d in done]).astype(bool)
    ko_ld = np.stack([d[1] for d in done])
    clean_correct = clean["correct"].to_numpy().astype(bool)
    residue = clean["residue"].to_numpy()
    eff = relative_effects(clean_correct, ko_correct, residue, batch.modulus, clean_ld=clean["logit_diff"].to_numpy(),
                           ko_ld=ko_ld, n_bootstrap=n_bootstrap, seed=seed)
    meta = metadata_of(model, method=method, n_per_residue=n_per_residue, residues=residues, seed=seed,
                       kinds=list(kinds), batch_size=batch_size, n_bootstrap=n_bootstrap, stride=stride, engine=engine,
                       checkpoint=None if checkpoint is None else str(checkpoint))
    meta.update(engine=used, calibration=None if cal is None else cal.source)
    return PhaseMap(cells, eff, clean_correct, ko_correct, clean["logit_diff"].to_numpy(), ko_ld, residue, spec.stride,
                    batch.modulus, method, int(model.cfg.n_layers), int(model.cfg.n_heads), meta)


def _heads(row: pd.Series) -> list[Any]:
    from phaselens.core.heads import Head

    return [Head(int(row.layer), int(h)) for h in row.heads]
