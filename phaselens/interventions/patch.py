"""Per-phase activation patching of per-head ``z`` at the query position, with the tasks' corrupted twins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from phaselens.by_residue import bootstrap_counts, bootstrap_group_means, group_counts, residue_mean
from phaselens.engine import Cell
from phaselens.errors import PhaseLensError
from phaselens.heads import Head, parse_heads
from phaselens.interventions.knockout import capture_z, z_name
from phaselens.items import build_items, check_options
from phaselens.labelled import Labelled
from phaselens.protocol import HookContext, PhaseModel, choose_engine, metadata_of
from phaselens.results import Result
from phaselens.scoring import answer_metrics, model_logits, plain_forward, query_logits

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
) -> PatchResult:
    """Patch each head's query-position ``z`` between clean items and their corrupted twins.

    Args:
        heads: which heads (default: all); any head spec ``parse_heads`` accepts.
        phase, residues: which items (phases, or residues; default all).
        direction: ``"denoise"`` patches clean ``z`` into the corrupted run; ``"noise"`` the reverse.
        site: only ``"z"`` (the per-head input of the output projection) is supported.
        engine: ``"auto"``, ``"suffix"`` (query rows over a cached prefix) or ``"full"``.
    """
    if site != "z":
        raise PhaseLensError(f"site {site!r} is not supported; patching works on per-head 'z'.")
    if direction not in ("denoise", "noise"):
        raise PhaseLensError(f"direction must be 'denoise' or 'noise', got {direction!r}.")
    check_options(batch_size=batch_size, progress=progress, n_bootstrap=n_bootstrap)
    used = choose_engine(model, engine)
    parsed = parse_heads(heads if heads is not None else [f"L{i}" for i in range(model.cfg.n_layers)], model.cfg)
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, phase=phase, residues=residues,
                                    seed=seed, stride=stride)
    clean, corrupt = batch.tokens, batch.corrupted
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    qp = batch.query_pos
    layers = sorted({h.layer for h in parsed})
    src_z = capture_z(model, source, qp, layers, batch_size=batch_size)  # {layer: [N, copies, H, d]}

    def metric(tokens: torch.Tensor) -> np.ndarray:
        lg = query_logits(plain_forward(model), tokens, qp, batch_size=batch_size)
        return answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"]

    item_clean, item_corrupt = metric(clean), metric(corrupt)
    patched = _patched_metrics(model, base, qp, parsed, src_z, batch, batch_size, used)  # [heads, N]
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
                       n_bootstrap=n_bootstrap, engine=engine, stride=stride)
    meta["engine"] = used
    return PatchResult(lab, grid(und_k, False), mc, mx, grid(mp_k), parsed, direction, spec.stride, M,
                       item_clean, item_corrupt, patched, res, meta)


def _patched_metrics(model, base, qp, heads, src_z, batch, batch_size, engine) -> np.ndarray:
    """Logit differences ``[heads, N]`` of ``base`` with each head's query ``z`` replaced from ``src_z``."""
    if engine == "suffix":
        eng = model.query_engine(base, qp, batch_size=batch_size)
        cells = [Cell(h.layer, [h.head], src_z[h.layer][:, 0, [h.head]]) for h in heads]
        logits = eng.run(cells)
        return np.stack([answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"] for lg in logits])
    out = []
    for h in heads:
        lg = query_logits(_query_patch(model, h, src_z[h.layer]), base, qp, batch_size=batch_size)
        out.append(answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"])
    return np.stack(out)


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
