"""Layer x head x phase maps: ``specialization_map`` (exact knockouts) and its ``PhaseMap`` result."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from phaselens.effects import EPS_CLEAN, Effects, mcnemar_p, relative_effects
from phaselens.engine import Cell, SuffixEngine, supports_engine
from phaselens.errors import CheckpointError, PhaseLensError
from phaselens.evaluate import score_items
from phaselens.interventions.knockout import calibrate, knockout
from phaselens.labelled import Labelled
from phaselens.protocol import build_items
from phaselens.scoring import answer_metrics, model_logits
from phaselens.stats import benjamini_hochberg


def map_cells(cfg: Any, kinds: tuple[str, ...] = ("head", "kv_head", "layer")) -> pd.DataFrame:
    """The cells of a map: one row per knockout (``label``, ``kind``, ``layer``, ``heads``)."""
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
class PhaseMap:
    """Knockout effects of every cell (head, KV head, layer) at every residue.

    Attributes:
        cells: one row per cell (``label``, ``kind``, ``layer``, ``index``, ``heads``).
        effects: :class:`~phaselens.effects.Effects` ``[cells, residues]``: relative accuracy change (percent)
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
            raise PhaseLensError(f"this map has no {kind!r} cells; kinds present: {sorted(set(self.cells['kind']))}.")
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
        out = np.full((self.n_layers, n_idx, self.modulus), np.nan)
        olo, ohi = out.copy(), out.copy()
        for i, row in sel.iterrows():
            out[row.layer, row["index"]] = arr[i]
            if lo is not None and hi is not None:
                olo[row.layer, row["index"]], ohi[row.layer, row["index"]] = lo[i], hi[i]
        return Labelled(out, ("layer", dim, "residue"), {"layer": layers, dim: np.arange(n_idx), "residue": res},
                        olo if lo is not None else None, ohi if hi is not None else None, name=quantity)

    def by_phase(self, kind: str = "head") -> pd.DataFrame:
        """Residues folded mod S: pooled clean / KO accuracy, relative change, logit-difference change and
        McNemar p per cell and phase (one row each)."""
        sel = self._select(kind)
        idx = sel.index.to_numpy()
        masks = (self.residue[None, :] % self.stride) == np.arange(self.stride)[:, None]  # [S, N]
        n = masks.sum(1)  # [S]
        with np.errstate(invalid="ignore", divide="ignore"):
            clean = (masks & self.clean_correct[None]).sum(1) / n  # [S]
            ko = (self.ko_correct[idx][:, None, :] & masks[None]).sum(-1) / n  # [C, S]
            rel = np.where(clean >= EPS_CLEAN, 100 * (ko - clean) / clean, np.nan)
            dld = ((self.ko_logit_diff[idx] - self.clean_logit_diff[None]) @ masks.T) / n  # [C, S]
        pval = mcnemar_p(self.clean_correct[None, None, :] & masks[None], self.ko_correct[idx][:, None, :] & masks[None])
        C, S = len(idx), self.stride
        return pd.DataFrame({
            "label": np.repeat(sel["label"].to_numpy(), S), "kind": kind, "layer": np.repeat(sel["layer"].to_numpy(), S),
            "index": np.repeat(sel["index"].to_numpy(), S), "phase": np.tile(np.arange(S), C),
            "clean_acc": np.tile(clean, C), "ko_acc": ko.ravel(), "rel_change": rel.ravel(),
            "delta_logit_diff": dld.ravel(), "pvalue": pval.ravel(), "boundary": np.tile(np.arange(S) == S - 1, C),
        })

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

    def specialization_index(self, alpha: float = 0.05, kind: str = "head") -> pd.DataFrame:
        """Per cell: how concentrated its damage is over the S phases.

        Damage at phase p is ``max(0, -rel_change_p)`` (residues folded mod S); with ``q_p`` the damage
        normalised over phases, the index is ``1 - H(q) / log(S)``: 0 when every phase is hurt equally,
        1 when one phase takes all the damage. Only cells whose total knockout effect is significant
        (pooled McNemar over all items, Benjamini-Hochberg at ``alpha`` across cells) and harmful get an
        index; the rest get NaN, so a head whose damage is pure noise never looks specialized.
        """
        sel = self._select(kind)
        idx = sel.index.to_numpy()
        S = self.stride
        rel = self.by_phase(kind)["rel_change"].to_numpy().reshape(len(idx), S)
        dmg = np.clip(-np.nan_to_num(rel, nan=0.0), 0, None)  # [C, S]
        total = dmg.sum(1)
        p_total = mcnemar_p(self.clean_correct[None], self.ko_correct[idx])
        adj = benjamini_hochberg(p_total)
        harmful = self.ko_correct[idx].mean(1) < self.clean_correct.mean()
        sig = (adj <= alpha) & harmful
        with np.errstate(invalid="ignore", divide="ignore"):
            q = dmg / total[:, None]
            ent = -np.where(q > 0, q * np.log(np.where(q > 0, q, 1)), 0).sum(1)
            index = 1 - ent / np.log(S) if S > 1 else np.full(len(idx), np.nan)
        index = np.where(sig & (total > 0), index, np.nan)
        return pd.DataFrame({
            "label": sel["label"].to_numpy(), "layer": sel["layer"].to_numpy(), "index": sel["index"].to_numpy(),
            "specialization": index, "total_damage": total,
            "worst_phase": np.where(total > 0, dmg.argmax(1), -1), "p_total": p_total, "p_adjusted": adj,
            "significant": sig,
        })

    def top_heads(self, phase: int, k: int = 5, kind: str = "head", by: str = "rel_change") -> pd.DataFrame:
        """The ``k`` cells whose knockout hurts ``phase`` most: most negative ``by`` (``rel_change`` or
        ``delta_logit_diff``); cells with an undefined value sort last."""
        ph = self.by_phase(kind)
        return ph[ph["phase"] == phase].sort_values(by, na_position="last").head(k).reset_index(drop=True)

    def to_frame(self) -> pd.DataFrame:
        """Tidy rows per (cell, residue) with every effect quantity."""
        e = self.effects
        C, M = e.ko_acc.shape
        res = np.tile(np.arange(M), C)
        out = {col: np.repeat(self.cells[col].to_numpy(), M) for col in ("label", "kind", "layer", "index")}
        out.update(residue=res, phase=res % self.stride, clean_acc=np.tile(e.clean_acc, C))
        for name in ("ko_acc", "rel_change", "ci_low", "ci_high", "pvalue", "delta_logit_diff", "undefined"):
            out[name] = getattr(e, name).ravel()
        return pd.DataFrame(out)

    def __repr__(self) -> str:
        kinds = self.cells["kind"].value_counts().to_dict()
        si = self.specialization_index()
        top = si.sort_values("specialization", ascending=False).head(3)
        tops = ", ".join(f"{r.label} {r.specialization:.2f}" for r in top.itertuples() if not np.isnan(r.specialization))
        return (f"PhaseMap({self.method} knockouts; cells {kinds}; {len(self.residue)} items, stride {self.stride}, "
                f"residues mod {self.modulus}; most specialized heads: {tops or 'none significant'})")

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.head_phase_heatmap(self, **kwargs)


def _fingerprint(model: Any, batch: Any, method: str, seed: int, cells: pd.DataFrame) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(batch.task if hasattr(batch, "task") else "", default=str).encode())
    h.update(batch.tokens.numpy().tobytes())
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
    if isinstance(module, torch.nn.Module):  # a sample of the weights: another model must not resume this map
        for p in list(module.parameters())[:4]:
            h.update(p.detach().float().cpu().numpy().tobytes()[:4096])
    h.update(f"{method}/{seed}/{list(cells['label'])}".encode())
    return h.hexdigest()


class _Checkpoint:
    """Completed cells in ``path`` (.npz) with a JSON manifest; written atomically after each chunk."""

    def __init__(self, path: str | os.PathLike | None, fingerprint: str) -> None:
        self.path = Path(path) if path is not None else None
        self.fp = fingerprint
        self.done: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if self.path is not None and self.manifest.is_file():
            man = json.loads(self.manifest.read_text())
            if man.get("fingerprint") != fingerprint:
                raise CheckpointError(f"{self.path} holds a different map (model, items or method); use another path.")
            with np.load(self.path) as data:
                for label in man["cells"]:
                    self.done[label] = (data[f"{label}.correct"], data[f"{label}.ld"])

    @property
    def manifest(self) -> Path:
        assert self.path is not None
        return self.path.with_suffix(".json")

    def add(self, label: str, correct: np.ndarray, ld: np.ndarray) -> None:
        self.done[label] = (correct, ld)

    def flush(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp.npz")
        arrays = {f"{k}.correct": v[0] for k, v in self.done.items()} | {f"{k}.ld": v[1] for k, v in self.done.items()}
        np.savez(tmp, **arrays)
        os.replace(tmp, self.path)
        tmpj = self.manifest.with_name(self.manifest.name + ".tmp")
        tmpj.write_text(json.dumps({"fingerprint": self.fp, "cells": list(self.done)}))
        os.replace(tmpj, self.manifest)


def specialization_map(
    model: Any,
    task: Any = None,
    method: str = "mean",
    n_per_residue: int = 64,
    *,
    residues: Any = None,
    seed: int = 0,
    kinds: tuple[str, ...] = ("head", "kv_head", "layer"),
    calibration: Any = None,
    batch_size: int = 64,
    rows_per_pass: int = 4096,
    checkpoint: str | os.PathLike | None = None,
    n_bootstrap: int = 500,
    progress: bool = True,
    stride: int | None = None,
    engine: str = "auto",
) -> PhaseMap:
    """Knock out every head (and KV head, and layer) at the query position; effects per residue.

    Args:
        model: a phaselens model. ``CompressedTransformer`` uses the query-suffix engine (exact, fast);
            other models (the DeepSeek-V4 adapter) fall back to one full forward per cell.
        method: ``"mean"``, ``"zero"`` or ``"resample"`` replacement of ``z``.
        kinds: which cells to map.
        checkpoint: write finished cells atomically to this ``.npz`` (+ ``.json`` manifest) and resume from it.
        engine: ``"auto"``, ``"suffix"`` or ``"full"`` (full forwards, the reference way).

    Example:
        >>> pm = phaselens.specialization_map(phaselens.load("zoo:w4s4"), n_per_residue=32)  # doctest: +SKIP
        >>> pm.specialization_index().head()  # doctest: +SKIP
    """
    if method not in ("mean", "zero", "resample"):
        raise PhaseLensError(f"method must be 'mean', 'zero' or 'resample', got {method!r}.")
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, residues=residues, seed=seed,
                                    stride=stride)
    cells = map_cells(model.cfg, kinds)
    layers = sorted(set(cells["layer"]))
    cal = None if method == "zero" else calibrate(model, calibration, layers, task=task)
    ckpt = _Checkpoint(checkpoint, _fingerprint(model, batch, method, seed, cells))
    use_engine = engine == "suffix" or (engine == "auto" and supports_engine(model))
    qp = batch.query_pos
    if use_engine and int(qp.min()) != int(qp.max()):
        use_engine = False  # items with different query positions: one engine per position is not worth it here
    clean = score_items(model, batch, batch_size=batch_size, progress=False)
    todo = [i for i, row in cells.iterrows() if row.label not in ckpt.done]
    bar = None
    if progress:
        from phaselens.progress import progress_bar

        bar = progress_bar(stage="map", unit="cell", total=len(cells), initial=len(cells) - len(todo), leave=True)
    try:
        if use_engine:
            eng = SuffixEngine(model, batch.tokens, int(qp[0]), rows_per_pass=rows_per_pass)
            per_pass = max(1, rows_per_pass // len(batch))
            for j in range(0, len(todo), per_pass):
                chunk = todo[j : j + per_pass]
                cl = [_cell(cells.loc[i], cal, method, len(batch), seed + i) for i in chunk]
                logits = eng.run(cl)
                for i, lg in zip(chunk, logits):
                    m = answer_metrics(lg, batch.answer, batch.wrong)
                    ckpt.add(cells.loc[i, "label"], m["correct"], m["logit_diff"])
                ckpt.flush()
                if bar is not None:
                    bar.update(len(chunk))
        else:
            for i in todo:
                row = cells.loc[i]
                heads = [(int(row.layer), h) for h in row.heads]
                with knockout(model, heads, method=method, calibration=cal, seed=seed + i) as ko:
                    def forward(tokens, query_pos, _ko=ko):
                        _ko.positions = query_pos
                        return model_logits(model, tokens, query_pos)

                    m = score_items(model, batch, batch_size=batch_size, forward=forward)
                ckpt.add(row.label, m["correct"].to_numpy(), m["logit_diff"].to_numpy())
                ckpt.flush()
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    ko_correct = np.stack([ckpt.done[label][0] for label in cells["label"]]).astype(bool)
    ko_ld = np.stack([ckpt.done[label][1] for label in cells["label"]])
    clean_correct = clean["correct"].to_numpy().astype(bool)
    residue = clean["residue"].to_numpy()
    eff = relative_effects(clean_correct, ko_correct, residue, batch.modulus, clean_ld=clean["logit_diff"].to_numpy(),
                           ko_ld=ko_ld, n_bootstrap=n_bootstrap, seed=seed)
    meta = {"engine": "suffix" if use_engine else "full forwards", "n_per_residue": n_per_residue, "seed": seed,
            "calibration": None if cal is None else cal.source, **(getattr(model, "analysis_metadata", None) or {})}
    return PhaseMap(cells, eff, clean_correct, ko_correct, clean["logit_diff"].to_numpy(), ko_ld, residue, spec.stride, batch.modulus, method,
                    int(model.cfg.n_layers), int(model.cfg.n_heads), meta)


def _cell(row: pd.Series, cal: Any, method: str, n_items: int, seed: int) -> Cell:
    heads = list(row.heads)
    if method == "zero":
        return Cell(int(row.layer), heads, None)
    z = cal.z[int(row.layer)][:, heads]  # [Ncal, h, d]
    if method == "mean":
        return Cell(int(row.layer), heads, z.mean(0))
    g = torch.Generator().manual_seed(seed)
    return Cell(int(row.layer), heads, z[torch.randint(0, z.shape[0], (n_items,), generator=g)])
