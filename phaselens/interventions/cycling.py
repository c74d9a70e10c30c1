"""Gate cycling: roll the compressor's offset-specific gate parameters and see the weak phases move.

If a model's phase preferences live in its offset-specific gate parameters (per-offset gate weights and
the per-offset bias), rolling them by delta should move the accuracy profile with them:
``A_delta(p) ~ A_0((p - delta) mod S)`` (science.md §3). The payload maps stay fixed.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from phaselens.errors import NotApplicableError
from phaselens.evaluate import evaluate
from phaselens.models.compressor import Pooler


def _offset_params(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """Offset-specific gate parameters as (name, parameter) with the phase axis at dim 1."""
    out = []
    if not hasattr(model, "named_modules"):  # an adapter: transformers' compressors are not phaselens Poolers
        return out
    for name, mod in model.named_modules():
        if not isinstance(mod, Pooler):
            continue
        if mod.gate is not None and mod.gate.weight.shape[1] == mod.stride and mod.stride > 1:
            out.append((f"{name}.gate.weight", mod.gate.weight))
        if mod.position_bias is not None:
            out.append((f"{name}.position_bias", mod.position_bias))
    return out


def cycle_gates(model: Any, delta: int) -> Any:
    """A copy of ``model`` whose offset-specific gate parameters are rolled by ``delta`` along the phase axis.

    The parameters of offset ``i`` move to offset ``(i + delta) mod S`` (``torch.roll(..., shifts=delta)``):
    per-offset gate weights ``[group, phase, d_model, channels]`` and the per-offset bias
    ``[group, phase, channels]`` roll along ``phase``. For DeepSeek's ``overlap_split`` layout the S rows of
    the bias roll alike in both halves (Ca and Cb). Payload maps are unchanged.

    Raises:
        NotApplicableError: the model has no offset-specific gate parameters (uniform pooling, or shared gates
            without a position bias): cycling would be the identity.
    """
    if not _offset_params(model):
        raise NotApplicableError(
            "this model has no phaselens compressor with offset-specific gate parameters (uniform pooling, shared "
            "gates without a per-offset bias, or a model reached through an adapter), so there is nothing to roll; "
            "gate cycling does not apply."
        )
    out = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in _offset_params(out):
            p.copy_(torch.roll(p, shifts=int(delta), dims=1))
    if hasattr(out, "setup"):
        out.setup()
    return out


@dataclass(frozen=True, repr=False, eq=False)
class GateCyclingResult:
    """Observed against predicted per-phase accuracy under gate cycling.

    Attributes:
        frame: rows (``delta``, ``phase``, ``observed``, ``predicted``, ``boundary``).
        r2: R^2 of observed against predicted (identity line), pooled over deltas, boundary phase excluded.
        r2_all: the same with the boundary phase included.
        boundary: accuracy of the boundary phase under each delta (``{delta: acc}``), reported separately.
        base: per-phase accuracy of the unmodified model.
    """

    frame: pd.DataFrame
    r2: float
    r2_all: float
    boundary: dict[int, float]
    base: np.ndarray
    stride: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def __repr__(self) -> str:
        b = ", ".join(f"{d:+d}: {100 * a:.1f}%" for d, a in self.boundary.items())
        return (f"GateCyclingResult(stride {self.stride}: R^2 {self.r2:.2f} without the boundary phase "
                f"({self.r2_all:.2f} with it); boundary accuracy by delta {b})")

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.gate_cycling_scatter(self, **kwargs)


def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    """1 - SS_res / SS_tot against the identity line."""
    ss_res = float(((observed - predicted) ** 2).sum())
    ss_tot = float(((observed - observed.mean()) ** 2).sum())
    return 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def gate_cycling_test(
    model: Any,
    task: Any = None,
    deltas: Sequence[int] = (-3, -2, -1, 1, 2, 3),
    *,
    n_per_residue: int = 128,
    seed: int = 0,
    batch_size: int = 64,
    progress: bool = True,
) -> GateCyclingResult:
    """Evaluate the model and its gate-cycled copies; compare ``A_delta(p)`` with ``A_0((p - delta) mod S)``."""
    if not _offset_params(model):
        cycle_gates(model, 1)  # raises NotApplicableError with the explanation
    kw = dict(n_per_residue=n_per_residue, seed=seed, batch_size=batch_size, progress=progress,
              n_permutations=1, n_bootstrap=0)
    base_eval = evaluate(model, task, **kw)
    S = base_eval.stride
    base = base_eval.per_phase()["acc"].to_numpy()
    rows, boundary = [], {}
    for delta in deltas:
        if delta % S == 0:
            continue
        ev = evaluate(cycle_gates(model, delta), task, **kw)
        obs = ev.per_phase()["acc"].to_numpy()
        for p in range(S):
            rows.append(dict(delta=int(delta), phase=p, observed=obs[p], predicted=base[(p - delta) % S],
                             boundary=p == S - 1))
        boundary[int(delta)] = float(obs[S - 1])
    frame = pd.DataFrame(rows)
    inner = frame[~frame["boundary"]]
    r2 = r_squared(inner["observed"].to_numpy(), inner["predicted"].to_numpy())
    r2_all = r_squared(frame["observed"].to_numpy(), frame["predicted"].to_numpy())
    return GateCyclingResult(frame, r2, r2_all, boundary, base, S, {"n_per_residue": n_per_residue, "seed": seed})
