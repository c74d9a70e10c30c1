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

from phaselens.by_residue import residue_mean
from phaselens.errors import PhaseLensError
from phaselens.interventions.knockout import calibrate, z_name
from phaselens.labelled import Labelled
from phaselens.protocol import build_items


@dataclass(frozen=True, repr=False, eq=False)
class AttributionMap:
    """Estimated change of the logit difference per ``[layer, head, residue]``.

    ``spearman`` is the rank correlation with an exact :class:`~phaselens.maps.PhaseMap`'s
    ``delta_logit_diff`` over the same cells, when one was given.
    """

    estimate: Labelled
    spearman: float | None
    method: str
    stride: int
    modulus: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        return self.estimate.to_frame()

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.attribution_heatmap(self, **kwargs)

    def __repr__(self) -> str:
        rho = "n/a" if self.spearman is None else f"{self.spearman:.3f}"
        return f"AttributionMap({self.method}; stride {self.stride}, residues mod {self.modulus}; Spearman vs exact: {rho})"


def attribution_map(
    model: Any,
    task: Any = None,
    method: str = "mean",
    n_per_residue: int = 64,
    *,
    seed: int = 0,
    batch_size: int = 64,
    calibration: Any = None,
    exact: Any = None,
    stride: int | None = None,
) -> AttributionMap:
    """Estimate every head's knockout effect on the answer-minus-wrong logit difference, per residue.

    Args:
        method: ``"mean"`` or ``"zero"`` replacement (as in :func:`phaselens.specialization_map`).
        exact: an exact PhaseMap built on the same items (same task, ``n_per_residue`` and ``seed``) to
            report the Spearman correlation with.
    """
    if method not in ("mean", "zero"):
        raise PhaseLensError(f"attribution_map supports method 'mean' or 'zero', got {method!r}.")
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, seed=seed, stride=stride)
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    cal = None if method == "zero" else calibrate(model, calibration, list(range(L)), task=task)
    est = []
    for i in range(0, len(batch), batch_size):
        tokens = batch.tokens[i : i + batch_size]
        qp = batch.query_pos[i : i + batch_size]
        rows = torch.arange(len(qp))
        kept: dict[int, torch.Tensor] = {}

        def keep(z: torch.Tensor, hook: Any, _kept: dict[int, torch.Tensor] = kept) -> None:
            _kept[int(hook.name.split(".")[1])] = z

        with torch.enable_grad():
            logits = model.run_with_hooks(tokens, fwd_hooks=[(z_name(layer), keep) for layer in range(L)])
            dev = logits.device
            r, q_at = rows.to(dev), qp.to(dev)
            q = logits[r, q_at]
            ld = q[r, batch.answer[i : i + batch_size].to(dev)] - q[r, batch.wrong[i : i + batch_size].to(dev)]
            # gradients with respect to z only: no parameter .grad is filled
            grads = torch.autograd.grad(ld.sum(), [kept[layer] for layer in range(L)])
        per_layer = []
        for layer in range(L):
            z = kept[layer].detach()[r, q_at]  # [b, H, d]
            g = grads[layer][r, q_at]
            repl = torch.zeros_like(z) if cal is None else cal.mean(layer).to(device=z.device, dtype=z.dtype).expand_as(z)
            per_layer.append(((repl - z) * g).sum(-1))  # [b, H]
        est.append(torch.stack(per_layer, 1).float().cpu())
    values = torch.cat(est).numpy()  # [N, L, H]
    residue = batch.frame["residue"].to_numpy()
    M = batch.modulus
    mean = residue_mean(values, residue, M)  # [L, H, M]
    coords = {"layer": np.arange(L), "head": np.arange(H), "residue": np.arange(M)}
    lab = Labelled(mean, ("layer", "head", "residue"), coords, name="estimated_delta_logit_diff")
    rho = None
    if exact is not None:
        ex = exact.values("head", "delta_logit_diff").values
        ok = ~np.isnan(ex) & ~np.isnan(mean)
        rho = float(sps.spearmanr(mean[ok], ex[ok]).statistic)
    return AttributionMap(lab, rho, method, spec.stride, M, {"n_per_residue": n_per_residue, "seed": seed})
