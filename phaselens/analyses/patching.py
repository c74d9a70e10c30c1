"""Per-phase activation patching of per-head ``z`` at the query position, with the tasks' corrupted twins."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from phaselens.analyses.items import build_items, check_options
from phaselens.analyses.knockouts import capture_z, z_name
from phaselens.analyses.scoring import (
    answer_metrics,
    model_logits,
    plain_forward,
    query_logits,
    query_metrics,
)
from phaselens.contract.protocol import HookContext, PhaseModel, check_model, choose_engine, metadata_of
from phaselens.core.checks import as_float
from phaselens.core.errors import InputError
from phaselens.core.heads import Head, parse_heads
from phaselens.core.labelled import Labelled
from phaselens.results.base import Result
from phaselens.runtime.checkpoints import check_checkpoint_path
from phaselens.runtime.distributed import open_checkpoint, shard_map, sharded, world
from phaselens.runtime.engines import Cell
from phaselens.stats.by_residue import bootstrap_counts, bootstrap_group_means, group_counts, residue_mean

EPS_DENOM = 1e-3


@dataclass(frozen=True, repr=False, eq=False)
class PatchResult(Result):
    """Normalized recovery per head and residue.

    Denoising: ``(M_patched - M_corrupt) / (M_clean - M_corrupt)``; noising:
    ``(M_clean - M_patched) / (M_clean - M_corrupt)``; each a ratio of means over a group's items (a
    residue, or a phase), with ``M`` the answer-minus-wrong logit difference. NaN (and ``undefined``) where
    ``|M_clean - M_corrupt|`` is below ``eps``.

    Attributes:
        recovery: ``Labelled[layer, head, residue]`` with 95% bootstrap CIs (items resampled per residue).
        undefined: ``[layer, head, residue]`` bool; m_clean, m_corrupt: ``[residue]``; m_patched:
            ``[layer, head, residue]`` (group means of the logit difference).
        item_clean, item_corrupt: ``[N]``, item_patched: ``[heads, N]``, residue: ``[N]`` (per-item values).
    """

    recovery: Labelled
    undefined: np.ndarray
    m_clean: np.ndarray
    m_corrupt: np.ndarray
    m_patched: np.ndarray
    heads: tuple[Head, ...]
    direction: str
    stride: int
    modulus: int
    item_clean: np.ndarray
    item_corrupt: np.ndarray
    item_patched: np.ndarray
    residue: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)

    def _frame(self, groups: np.ndarray, n_groups: int, level: str) -> pd.DataFrame:
        args = self.metadata.get("arguments", {})
        rec, lo, hi, und, mc, mx, mp = recovery(self.item_clean, self.item_corrupt, self.item_patched, groups,
                                                n_groups, self.direction, float(args.get("eps", EPS_DENOM)),
                                                n_bootstrap=int(args.get("n_bootstrap", 500)),
                                                seed=int(args.get("seed", 0)))
        K = len(self.heads)
        g = np.arange(n_groups)
        out = pd.DataFrame({
            "layer": np.repeat([h.layer for h in self.heads], n_groups),
            "head": np.repeat([h.head for h in self.heads], n_groups),
            level: np.tile(g, K), "n": np.tile(group_counts(groups, n_groups), K),
            "recovery": rec.ravel(), "ci_low": lo.ravel(), "ci_high": hi.ravel(), "undefined": und.ravel(),
            "m_clean": np.tile(mc, K), "m_corrupt": np.tile(mx, K), "m_patched": mp.ravel(),
        })
        if level == "residue":
            out.insert(3, "phase", out["residue"] % self.stride)
        else:
            out["boundary"] = out["phase"] == self.stride - 1
        return out[out["n"] > 0].reset_index(drop=True)

    def per_residue(self) -> pd.DataFrame:
        """Tidy rows per (layer, head, residue): recovery with its CI, ``undefined``, and the group means
        M_clean / M_corrupt / M_patched."""
        return self._frame(self.residue, self.modulus, "residue")

    def per_phase(self) -> pd.DataFrame:
        """The same per (layer, head, phase): residues folded mod S."""
        return self._frame(self.residue % self.stride, self.stride, "phase")

    def summary(self) -> str:
        v = self.recovery.values
        best = np.unravel_index(np.nanargmax(np.nan_to_num(v, nan=-np.inf)), v.shape) if np.isfinite(v).any() else None
        where = f"; largest: L{best[0]}H{best[1]} residue {best[2]} ({v[best]:.2f})" if best else ""
        return f"PatchResult({self.direction}, {len(self.heads)} heads x {self.modulus} residues{where})"

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.patch_heatmap(self, **kwargs)


def recovery(item_clean: np.ndarray, item_corrupt: np.ndarray, item_patched: np.ndarray, groups: np.ndarray,
             n_groups: int, direction: str, eps: float, *, n_bootstrap: int = 0, seed: int = 0,
             level: float = 0.95) -> tuple[np.ndarray, ...]:
    """Normalized recovery per head and group from per-item logit differences.

    Args:
        item_clean, item_corrupt: ``[N]``; item_patched: ``[K, N]``; groups: ``[N]`` in ``0..G-1``.

    Returns:
        ``(recovery, ci_low, ci_high, undefined, m_clean, m_corrupt, m_patched)``: ``[K, G]`` except the
        ``[G]`` means; the CI is a percentile bootstrap of the ratio (items resampled within groups).
    """
    def ratio(mc: np.ndarray, mx: np.ndarray, mp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        den = mc - mx
        und = np.abs(den) < eps
        num = mp - mx if direction == "denoise" else mc - mp
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(und | np.isnan(mp), np.nan, num / np.where(und, 1.0, den)), und

    mc, mx = residue_mean(item_clean, groups, n_groups), residue_mean(item_corrupt, groups, n_groups)
    mp = residue_mean(np.atleast_2d(item_patched).T, groups, n_groups)  # [K, G]
    rec, und = ratio(mc[None], mx[None], mp)
    und = np.broadcast_to(und, rec.shape).copy()
    lo = hi = np.full(rec.shape, np.nan)
    if n_bootstrap:
        counts = bootstrap_counts(groups, n_groups, n_bootstrap, np.random.default_rng(seed))
        b = bootstrap_group_means(np.vstack([item_clean, item_corrupt, np.atleast_2d(item_patched)]), counts,
                                  groups, n_groups)  # [2 + K, B, G]
        r_b, _ = ratio(b[0][None], b[1][None], b[2:])  # [K, B, G]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            q = np.nanquantile(r_b, [(1 - level) / 2, (1 + level) / 2], axis=1)
        lo, hi = np.where(np.isnan(rec), np.nan, q[0]), np.where(np.isnan(rec), np.nan, q[1])
    return rec, lo, hi, und, mc, mx, mp


@sharded
def patch(
    model: PhaseModel,
    task: Any = None,
    *,
    heads: Any = None,
    phase: Any = None,
    residues: Sequence[int] | None = None,
    direction: Literal["denoise", "noise"] = "denoise",
    site: str = "z",
    n_per_residue: int = 64,
    seed: int = 0,
    batch_size: int = 64,
    eps: float = EPS_DENOM,
    n_bootstrap: int = 500,
    engine: str = "auto",
    stride: int | None = None,
    progress: bool = False,
    checkpoint: str | os.PathLike | None = None,
) -> PatchResult:
    """Patch each head's query-position ``z`` between clean items and their corrupted twins.

    Args:
        heads: which heads (default: all); any head spec ``parse_heads`` accepts.
        phase, residues: which items (phases, or residues; default all).
        direction: ``"denoise"`` patches clean ``z`` into the corrupted run; ``"noise"`` the reverse.
        site: only ``"z"`` (the per-head input of the output projection) is supported.
        engine: ``"auto"``, ``"suffix"`` (query rows over a cached prefix) or ``"full"``.
        checkpoint: a file path: finished cells (heads) are written there atomically and a rerun (with any
            number of processes) resumes. The fingerprint covers the model, the clean and corrupted items, the
            heads, direction, site, seed, batch size and engine: a checkpoint of another run is refused.
    """
    check_model(model)
    if site != "z":
        raise InputError(f"site {site!r} is not supported; patching works on per-head 'z' (site='z').")
    if direction not in ("denoise", "noise"):
        raise InputError(f"direction must be 'denoise' or 'noise', got {direction!r}.")
    eps = as_float("eps", eps, positive=True, fix="It is the smallest |clean - corrupt| metric gap that counts "
                   f"as defined (default {EPS_DENOM}).")
    check_options(batch_size=batch_size, progress=progress, n_bootstrap=n_bootstrap)
    check_checkpoint_path(checkpoint)
    used = choose_engine(model, engine)
    parsed = parse_heads(heads if heads is not None else [f"L{i}" for i in range(model.cfg.n_layers)], model.cfg)
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, phase=phase, residues=residues,
                                    seed=seed, stride=stride)
    clean, corrupt = batch.tokens, batch.corrupted
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    qp = batch.query_pos
    layers = sorted({h.layer for h in parsed})
    store = None
    if checkpoint is not None:  # hashing every parameter is cheap here, but only needed to resume
        from phaselens.runtime.fingerprints import analysis_fingerprint

        fp = analysis_fingerprint(model, analysis="patch", items=clean, corrupted=corrupt, query_pos=qp,
                                  answers=batch.answer, wrong=batch.wrong, heads=[str(h) for h in parsed],
                                  direction=direction, site=site, seed=seed, batch_size=batch_size, engine=used)
        store = open_checkpoint(checkpoint, fp, ("logit_diff",))
    src_z = capture_z(model, source, qp, layers, batch_size=batch_size)  # {layer: [N, copies, H, d]}

    def metric(tokens: torch.Tensor) -> np.ndarray:  # item blocks split across ranks under torch.distributed
        b = SimpleNamespace(tokens=tokens, query_pos=qp, answer=batch.answer, wrong=batch.wrong)
        return query_metrics(plain_forward(model), b, batch_size=batch_size, desc="patch")["logit_diff"]

    item_clean, item_corrupt = metric(clean), metric(corrupt)
    patched = _patched_metrics(model, base, qp, parsed, src_z, batch, batch_size, used, store)  # [heads, N]
    res = batch.frame["residue"].to_numpy()
    M = batch.modulus
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    rec, lo, hi, und_k, mc, mx, mp_k = recovery(item_clean, item_corrupt, patched, res, M, direction, eps,
                                                 n_bootstrap=n_bootstrap, seed=seed)
    li = np.array([h.layer for h in parsed], dtype=int)
    hi_ = np.array([h.head for h in parsed], dtype=int)

    def grid(values: np.ndarray, fill: Any = np.nan) -> np.ndarray:
        out = np.full((L, H, M), fill, dtype=np.asarray(values).dtype if fill is False else float)
        out[li, hi_] = values
        return out

    coords = {"layer": np.arange(L), "head": np.arange(H), "residue": np.arange(M)}
    lab = Labelled(grid(rec), ("layer", "head", "residue"), coords, grid(lo), grid(hi), name=f"{direction}_recovery")
    meta = metadata_of(model, heads=[str(h) for h in parsed], phase=phase, residues=residues, direction=direction,
                       site=site, n_per_residue=n_per_residue, seed=seed, batch_size=batch_size, eps=eps,
                       n_bootstrap=n_bootstrap, engine=engine, stride=stride,
                       checkpoint=None if checkpoint is None else str(checkpoint))
    meta["engine"] = used
    return PatchResult(lab, grid(und_k, False), mc, mx, grid(mp_k), parsed, direction, spec.stride, M,
                       item_clean, item_corrupt, patched, res, meta)


def _patched_metrics(model, base, qp, heads, src_z, batch, batch_size, engine, store=None) -> np.ndarray:
    """Logit differences ``[heads, N]`` of ``base`` with each head's query ``z`` replaced from ``src_z``
    (the heads split across ranks under torch.distributed; ``store``: a checkpoint of finished heads)."""
    if engine == "suffix":
        eng = model.query_engine(base, qp, batch_size=batch_size)

        def compute(idx: list[int]) -> list[np.ndarray]:
            cells = [Cell(heads[i].layer, [heads[i].head], src_z[heads[i].layer][:, 0, [heads[i].head]]) for i in idx]
            return [(answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"],) for lg in eng.run(cells)]
    else:
        def compute(idx: list[int]) -> list[np.ndarray]:
            return [(answer_metrics(query_logits(_query_patch(model, heads[i], src_z[heads[i].layer]), base, qp,
                                                 batch_size=batch_size), batch.answer, batch.wrong)["logit_diff"],)
                    for i in idx]
    if store is None:  # each rank's whole share in one call: nothing to write between cells
        per_call = max(1, -(-len(heads) // world().size))
    else:  # a round per engine pass (per head with full forwards): the checkpoint is written after each
        per_call = max(1, 4096 // max(1, len(batch))) if engine == "suffix" else 1
    out = shard_map(compute, [str(h) for h in heads], per_call=per_call, store=store, unit="cell", stage="patch")
    return np.stack([o[0] for o in out])


def _query_patch(model: Any, head: Head, source: torch.Tensor):
    """A ``Forward`` that writes ``head``'s source ``z`` ``[N, copies, H, d]`` at each row's query slot (copy k's
    rows from copy k of the source)."""

    def run(tokens: torch.Tensor, query_pos: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        def hook(z: torch.Tensor, hook: HookContext) -> torch.Tensor:
            z = z.clone()
            src = source[items, :, head.head].transpose(0, 1).flatten(0, 1)  # copy-major rows [copies * b, d]
            at = hook.rows(query_pos, z.shape[1]).to(z.device)
            z[torch.arange(z.shape[0], device=z.device), at, head.head] = src.to(device=z.device, dtype=z.dtype)
            return z

        return model_logits(model, tokens, query_pos, [(z_name(head.layer), hook)])

    return run
