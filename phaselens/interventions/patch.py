"""Per-phase activation patching of per-head ``z`` at the query position, with the tasks' corrupted twins."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from phaselens.by_residue import residue_mean
from phaselens.engine import Cell, SuffixEngine, supports_engine
from phaselens.errors import PhaseLensError
from phaselens.heads import Head, parse_heads
from phaselens.interventions.knockout import capture_z, query_rows, z_name
from phaselens.labelled import Labelled
from phaselens.protocol import build_items
from phaselens.scoring import answer_metrics, model_logits, plain_forward, query_logits

EPS_DENOM = 1e-3


@dataclass(frozen=True, repr=False, eq=False)
class PatchResult:
    """Normalized recovery per head and residue.

    Denoising: ``(M_patched - M_corrupt) / (M_clean - M_corrupt)``; noising:
    ``(M_clean - M_patched) / (M_clean - M_corrupt)``; each a ratio of means over a residue's items, with
    ``M`` the answer-minus-wrong logit difference. NaN (and ``undefined``) where ``|M_clean - M_corrupt|``
    is below ``eps``.
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
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        """Tidy rows per (layer, head, residue): recovery, ``undefined``, and the residue's M_clean / M_corrupt
        / M_patched."""
        frame = self.recovery.to_frame()
        L, H, M = self.recovery.values.shape
        frame["undefined"] = self.undefined.ravel()
        frame["m_patched"] = self.m_patched.ravel()
        frame["m_clean"] = np.tile(self.m_clean, L * H)
        frame["m_corrupt"] = np.tile(self.m_corrupt, L * H)
        return frame

    def __repr__(self) -> str:
        v = self.recovery.values
        best = np.unravel_index(np.nanargmax(np.nan_to_num(v, nan=-np.inf)), v.shape) if np.isfinite(v).any() else None
        where = f"; largest: L{best[0]}H{best[1]} residue {best[2]} ({v[best]:.2f})" if best else ""
        return f"PatchResult({self.direction}, {len(self.heads)} heads x {self.modulus} residues{where})"

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.patch_heatmap(self, **kwargs)


def patch(
    model: Any,
    task: Any = None,
    heads: Any = None,
    phase: Any = None,
    direction: Literal["denoise", "noise"] = "denoise",
    site: str = "z",
    *,
    n_per_residue: int = 64,
    seed: int = 0,
    batch_size: int = 64,
    eps: float = EPS_DENOM,
    engine: str = "auto",
    stride: int | None = None,
) -> PatchResult:
    """Patch each head's query-position ``z`` between clean items and their corrupted twins.

    Args:
        heads: which heads (default: all); any head spec ``parse_heads`` accepts.
        phase: phases to evaluate (int, list, or None for all).
        direction: ``"denoise"`` patches clean ``z`` into the corrupted run; ``"noise"`` the reverse.
        site: only ``"z"`` (the per-head input of the output projection) is supported.
    """
    if site != "z":
        raise PhaseLensError(f"site {site!r} is not supported; patching works on per-head 'z'.")
    if direction not in ("denoise", "noise"):
        raise PhaseLensError(f"direction must be 'denoise' or 'noise', got {direction!r}.")
    parsed = parse_heads(heads if heads is not None else [f"L{i}" for i in range(model.cfg.n_layers)], model.cfg)
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, phase=phase, seed=seed, stride=stride)
    clean, corrupt = batch.tokens, batch.corrupted
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    qp = batch.query_pos
    layers = sorted({h.layer for h in parsed})
    src_z = capture_z(model, source, qp, layers, batch_size=batch_size)  # {layer: [N, H, d]}

    def metric(tokens: torch.Tensor) -> np.ndarray:
        lg = query_logits(plain_forward(model), tokens, qp, batch_size=batch_size)
        return answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"]

    m_clean, m_corrupt = metric(clean), metric(corrupt)
    patched = _patched_metrics(model, base, qp, parsed, src_z, batch, batch_size, engine)  # [heads, N]
    res = batch.frame["residue"].to_numpy()
    M = batch.modulus
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    mc, mx = residue_mean(m_clean, res, M), residue_mean(m_corrupt, res, M)  # [M]
    per_head = residue_mean(patched.T, res, M)  # [heads, M]
    li = np.array([h.layer for h in parsed], dtype=int)
    hi = np.array([h.head for h in parsed], dtype=int)
    mp = np.full((L, H, M), np.nan)
    mp[li, hi] = per_head
    den = mc - mx
    und = np.zeros((L, H, M), bool)
    und[li, hi] = np.broadcast_to(np.abs(den) < eps, per_head.shape)
    num = mp - mx if direction == "denoise" else mc - mp
    with np.errstate(invalid="ignore", divide="ignore"):
        rec = np.where(und | np.isnan(mp), np.nan, num / np.where(np.abs(den) < eps, 1.0, den))
    coords = {"layer": np.arange(L), "head": np.arange(H), "residue": np.arange(M)}
    lab = Labelled(rec, ("layer", "head", "residue"), coords, name=f"{direction}_recovery")
    meta = {"engine": "suffix" if _use_engine(model, qp, engine) else "full forwards", "seed": seed,
            "n_per_residue": n_per_residue}
    return PatchResult(lab, und, mc, mx, mp, parsed, direction, spec.stride, M, meta)


def _use_engine(model: Any, qp: torch.Tensor, engine: str) -> bool:
    return engine == "suffix" or (engine == "auto" and supports_engine(model) and int(qp.min()) == int(qp.max()))


def _patched_metrics(model, base, qp, heads, src_z, batch, batch_size, engine) -> np.ndarray:
    """Logit differences ``[heads, N]`` of ``base`` with each head's query ``z`` replaced from ``src_z``."""
    if _use_engine(model, qp, engine):
        eng = SuffixEngine(model, base, int(qp[0]))
        cells = [Cell(h.layer, [h.head], src_z[h.layer][:, [h.head]]) for h in heads]
        logits = eng.run(cells)
        return np.stack([answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"] for lg in logits])
    out = []
    for h in heads:
        qpatch = _QueryPatch(h.head, src_z[h.layer])
        lg = query_logits(qpatch.forward(model, h.layer), base, qp, batch_size=batch_size)
        out.append(answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"])
    return np.stack(out)


class _QueryPatch:
    """Full-forward fallback: write one head's source ``z`` at each row's query position, batch by batch."""

    def __init__(self, head: int, source: torch.Tensor) -> None:
        self.head, self.source, self.offset = head, source, 0
        self.rows: torch.Tensor | None = None
        self.qp: torch.Tensor | None = None

    def hook(self, z: torch.Tensor, hook: Any) -> torch.Tensor:
        assert self.rows is not None and self.qp is not None
        z = z.clone()
        src = self.source[self.rows, self.head].to(device=z.device, dtype=z.dtype)
        at = query_rows(hook, self.qp, z.shape[1]).to(z.device)
        z[torch.arange(z.shape[0], device=z.device), at, self.head] = src
        return z

    def forward(self, model: Any, layer: int):
        def run(tokens: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
            self.rows = torch.arange(self.offset, self.offset + len(query_pos))
            self.qp = query_pos
            self.offset += len(query_pos)
            return model_logits(model, tokens, query_pos, [(z_name(layer), self.hook)])

        return run
