"""``attribution_map``: a gradient screen of head knockouts (attribution patching).

A first-order estimate of each head's knockout effect on the logit difference at the query position:
``delta ~ (z_replacement - z_clean) . d(logit_diff)/dz``, from one forward and one backward pass over the
items (about three forward-equivalents in all, against one pass per head for the exact map).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from scipy import stats as sps

from phaselens.analyses.items import build_items, check_options
from phaselens.analyses.knockouts import calibrate, check_method, z_name
from phaselens.analyses.scoring import model_logits
from phaselens.contract.protocol import HookContext, PhaseModel, metadata_of, model_name
from phaselens.core.errors import InputError, NotApplicableError
from phaselens.core.labelled import Labelled
from phaselens.results.base import Result
from phaselens.runtime.distributed import block_labels, item_blocks, shard_map, sharded
from phaselens.stats.by_residue import residue_mean_ci


@dataclass(frozen=True, repr=False, eq=False)
class AttributionMap(Result):
    """Estimated change of the logit difference per ``[layer, head, residue]`` (mean over items, t CI).

    ``spearman`` is the rank correlation with an exact :class:`~phaselens.analyses.maps.PhaseMap`'s
    ``delta_logit_diff`` over the same cells, when one was given. ``items`` ``[N, layer, head]`` holds the
    per-item estimates, ``residue`` ``[N]``.
    """

    estimate: Labelled
    spearman: float | None
    method: str
    stride: int
    modulus: int
    items: np.ndarray
    residue: np.ndarray
    metadata: dict[str, Any] = field(default_factory=dict)

    def per_residue(self) -> pd.DataFrame:
        """Tidy rows per (layer, head, residue): ``value`` with ``ci_low`` / ``ci_high``."""
        out = self.estimate.to_frame()
        out.insert(out.columns.get_loc("residue") + 1, "phase", out["residue"] % self.stride)
        return out[out["residue"].isin(np.unique(self.residue))].reset_index(drop=True)  # residues with items

    def per_phase(self) -> pd.DataFrame:
        """The same per (layer, head, phase): residues folded mod S."""
        m, lo, hi = residue_mean_ci(self.items, self.residue % self.stride, self.stride)
        c = self.estimate.coords
        lab = Labelled(m, ("layer", "head", "phase"), {"layer": c["layer"], "head": c["head"],
                                                       "phase": np.arange(self.stride)}, lo, hi, name=self.estimate.name)
        out = lab.to_frame()
        out["boundary"] = out["phase"] == self.stride - 1
        return out[out["phase"].isin(np.unique(self.residue % self.stride))].reset_index(drop=True)

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.attribution_heatmap(self, **kwargs)

    def summary(self) -> str:
        rho = "n/a" if self.spearman is None else f"{self.spearman:.3f}"
        return f"AttributionMap({self.method}; stride {self.stride}, residues mod {self.modulus}; Spearman vs exact: {rho})"


@sharded
def attribution_map(
    model: PhaseModel,
    task: Any = None,
    *,
    method: str = "mean",
    n_per_residue: int = 64,
    residues: Any = None,
    seed: int = 0,
    batch_size: int = 64,
    calibration: Any = None,
    exact: Any = None,
    stride: int | None = None,
    progress: bool = False,
) -> AttributionMap:
    """Estimate every head's knockout effect on the answer-minus-wrong logit difference, per residue.

    Gradients flow through the query rows only, so under chunked prefill this is exactly the gradient of a
    query-row intervention; on a phase ensemble a head is knocked out in every copy (the estimate sums the
    copies' first-order terms).

    Args:
        method: ``"mean"`` or ``"zero"`` replacement (as in :func:`phaselens.specialization_map`).
        exact: an exact PhaseMap built on the same items (same task, ``n_per_residue`` and ``seed``) to
            report the Spearman correlation with.
    """
    method = check_method(method, ("mean", "zero"))
    check_options(batch_size=batch_size, progress=progress)
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, residues=residues, seed=seed,
                                    stride=stride)
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    _check_exact(exact, L, H, batch.modulus)
    cal = None if method == "zero" else calibrate(model, calibration, list(range(L)), task=task)
    blocks = item_blocks(len(batch), batch_size)

    def one(i: int) -> torch.Tensor:  # estimates [b, L, H] of the block of items starting at i
        tokens = batch.tokens[i : i + batch_size]
        qp = batch.query_pos[i : i + batch_size]
        b = len(qp)
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(z: torch.Tensor, hook: HookContext, _qp: torch.Tensor = qp, _kept: dict = kept) -> None:
            _kept[hook.layer()] = (z, hook.rows(_qp, z.shape[1]))

        with torch.enable_grad():
            logits = model_logits(model, tokens, qp, [(z_name(layer), keep) for layer in range(L)])
            dev = logits.device
            r = torch.arange(b, device=dev)
            q = logits[r, (qp - (tokens.shape[1] - logits.shape[1])).to(dev)]
            ld = q[r, batch.answer[i : i + batch_size].to(dev)] - q[r, batch.wrong[i : i + batch_size].to(dev)]
            # gradients with respect to z only: no parameter .grad is filled
            zs = [kept[layer][0] for layer in range(L)]
            if not all(z.requires_grad for z in zs) or not ld.requires_grad:
                raise NotApplicableError(
                    f"{model_name(model)} passes its hooks tensors that carry no gradient to the logits (e.g. the "
                    "DeepSeek-V4 adapter's nnsight backend); run attribution_map with backend='torch'."
                )
            grads = torch.autograd.grad(ld.sum(), zs, allow_unused=True)
            if any(g is None for g in grads):
                raise NotApplicableError(
                    f"{model_name(model)}'s hooked z is not on the gradient path of its logits (e.g. the "
                    "DeepSeek-V4 adapter's nnsight backend); run attribution_map with backend='torch'."
                )
        per_layer = []
        for layer in range(L):
            z_all, at = kept[layer]
            rows = torch.arange(len(at), device=z_all.device)
            z = z_all.detach()[rows, at.to(z_all.device)]  # [R, H, d]; R = copies x b
            g = grads[layer][rows, at.to(z_all.device)]
            repl = torch.zeros_like(z) if cal is None else cal.mean(layer).to(device=z.device, dtype=z.dtype).expand_as(z)
            per_layer.append(((repl - z) * g).sum(-1).view(-1, b, H).sum(0))  # copies' terms summed: [b, H]
        return torch.stack(per_layer, 1).float().cpu()

    # item blocks split across ranks under torch.distributed
    est = shard_map(lambda idx: [one(blocks[b].start) for b in idx], block_labels(blocks), progress=progress,
                    stage="attribution", model=model)
    values = torch.cat(est).numpy()  # [N, L, H]
    residue = batch.frame["residue"].to_numpy()
    M = batch.modulus
    mean, lo, hi = residue_mean_ci(values, residue, M)  # [L, H, M]
    coords = {"layer": np.arange(L), "head": np.arange(H), "residue": np.arange(M)}
    lab = Labelled(mean, ("layer", "head", "residue"), coords, lo, hi, name="estimated_delta_logit_diff")
    rho = None
    if exact is not None:
        ex = exact.values("head", "delta_logit_diff").values
        ok = ~np.isnan(ex) & ~np.isnan(mean)
        rho = float(sps.spearmanr(mean[ok], ex[ok]).statistic)
    meta = metadata_of(model, method=method, n_per_residue=n_per_residue, residues=residues, seed=seed,
                       batch_size=batch_size, stride=stride)
    meta.update(calibration=None if cal is None else cal.source)
    return AttributionMap(lab, rho, method, spec.stride, M, values, residue, meta)


def _check_exact(exact: Any, n_layers: int, n_heads: int, modulus: int) -> None:
    """``exact`` must be a PhaseMap with head cells on the same layers, heads and residues (checked before the
    gradients run)."""
    from phaselens.analyses.maps import PhaseMap

    if exact is None:
        return
    if not isinstance(exact, PhaseMap):
        raise InputError(f"exact must be a PhaseMap (from specialization_map on the same items) or None, got "
                         f"{type(exact).__name__}.")
    want = (n_layers, n_heads, modulus)
    got = exact.values("head", "delta_logit_diff").values.shape
    if tuple(got) != want:
        raise InputError(f"exact has head cells of shape {tuple(got)} (layer, head, residue), but this map has "
                         f"{want}; build it with specialization_map on the same model and task.")
