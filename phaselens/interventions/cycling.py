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

from phaselens.errors import InputError, NotApplicableError
from phaselens.evaluate import evaluate
from phaselens.items import as_int, check_options
from phaselens.models.compressor import Pooler
from phaselens.protocol import PhaseModel, metadata_of, require
from phaselens.results import Result


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


def roll_offset_gates(model: Any, delta: int) -> Any:
    """A copy of a phaselens model whose offset-specific gate parameters are rolled by ``delta``.

    The parameters of offset ``i`` move to offset ``(i + delta) mod S`` (``torch.roll(..., shifts=delta)``):
    per-offset gate weights ``[group, phase, d_model, channels]`` and the per-offset bias
    ``[group, phase, channels]`` roll along ``phase``. For DeepSeek's ``overlap_split`` layout the S rows of
    the bias roll alike in both halves (Ca and Cb). Payload maps are unchanged. This is the model side of the
    ``cycle_gates`` capability (``CompressedTransformer.cycle_gates``).

    Raises:
        NotApplicableError: the model has no offset-specific gate parameters (uniform pooling, or shared gates
            without a position bias): cycling would be the identity.
    """
    if not _offset_params(model):
        raise NotApplicableError(
            "this model has no compressor with offset-specific gate parameters (uniform pooling, or shared "
            "gates without a per-offset bias), so there is nothing to roll; gate cycling does not apply."
        )
    out = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in _offset_params(out):
            p.copy_(torch.roll(p, shifts=int(delta), dims=1))
    if hasattr(out, "setup"):
        out.setup()
    return out


def cycle_gates(model: Any, delta: int) -> Any:
    """A copy of ``model`` with its offset-specific gate parameters rolled by ``delta`` (the ``cycle_gates``
    capability of the model; a phase ensemble cycles the model it wraps).

    Raises:
        NotApplicableError: the model does not offer gate cycling, or has nothing to roll.
    """
    delta = as_int("delta", delta)
    fn = require(model, "cycle_gates", "gate cycling rolls a phaselens compressor's offset-specific gate "
                                        "parameters, which this model does not expose.")
    return fn(delta)


@dataclass(frozen=True, repr=False, eq=False)
class GateCyclingResult(Result):
    """Observed against predicted per-phase accuracy under gate cycling.

    Attributes:
        frame: rows (``delta``, ``phase``, ``observed``, ``predicted``, ``boundary``).
        r2: R^2 of observed against predicted (identity line), pooled over deltas, boundary phase excluded.
            A negative R^2 means the prediction "the profile moves with the gates" fits worse than a flat
            line at the observed mean: the weak phases did not move with the gate parameters.
        r2_all: the same with the boundary phase included.
        boundary: accuracy of the boundary phase under each delta (``{delta: acc}``), reported separately.
        base: per-phase accuracy of the unmodified model.
        evals: the :class:`~phaselens.evaluate.PhaseEval` of each delta (0: the unmodified model).
    """

    frame: pd.DataFrame
    r2: float
    r2_all: float
    boundary: dict[int, float]
    base: np.ndarray
    stride: int
    evals: dict[int, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def per_residue(self) -> pd.DataFrame:
        """Accuracy per residue under each delta (``delta`` 0 is the unmodified model), with Wilson CIs."""
        return pd.concat([ev.per_residue().assign(delta=d) for d, ev in self.evals.items()], ignore_index=True)

    def per_phase(self) -> pd.DataFrame:
        """Per delta and phase: ``acc`` (observed), ``predicted`` (the unmodified profile rolled by delta),
        Wilson ``ci_low`` / ``ci_high`` and ``n``; ``boundary`` marks phase S - 1."""
        rows = []
        for d, ev in self.evals.items():
            ph = ev.per_phase().assign(delta=d)
            ph["predicted"] = self.base[(ph["phase"].to_numpy() - d) % self.stride]
            rows.append(ph)
        return pd.concat(rows, ignore_index=True)

    def summary(self) -> str:
        b = ", ".join(f"{d:+d}: {100 * a:.1f}%" for d, a in self.boundary.items())
        return (f"GateCyclingResult(stride {self.stride}: R^2 {self.r2:.2f} without the boundary phase "
                f"({self.r2_all:.2f} with it; below 0: the weak phases did not move with the gates); boundary "
                f"accuracy by delta {b})")

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.gate_cycling_scatter(self, **kwargs)


def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    """1 - SS_res / SS_tot against the identity line."""
    ss_res = float(((observed - predicted) ** 2).sum())
    ss_tot = float(((observed - observed.mean()) ** 2).sum())
    return 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def gate_cycling_test(
    model: PhaseModel,
    task: Any = None,
    *,
    deltas: Sequence[int] = (-3, -2, -1, 1, 2, 3),
    n_per_residue: int = 128,
    residues: Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int = 64,
    progress: bool = True,
    stride: int | None = None,
) -> GateCyclingResult:
    """Evaluate the model and its gate-cycled copies; compare ``A_delta(p)`` with ``A_0((p - delta) mod S)``.

    Raises:
        NotApplicableError: the model cannot cycle its gates (``cycle_gates`` capability), or has nothing to roll.
    """
    require(model, "cycle_gates", "gate cycling rolls offset-specific gate parameters.")
    check_options(n_per_residue=n_per_residue, seed=seed, batch_size=batch_size, progress=progress, stride=stride)
    S = (model.analysis_spec.stride if stride is None else int(stride))
    try:
        ds = [as_int("delta", d) for d in deltas]
    except TypeError:
        raise InputError(f"deltas must be a list of ints, got {deltas!r}.") from None
    ds = [d for d in ds if d % S]
    if not ds:
        raise InputError(f"deltas {list(deltas)!r} hold no shift that is nonzero mod the stride {S}; pass e.g. "
                         f"deltas={tuple(range(1, S))}.")
    kw = dict(n_per_residue=n_per_residue, residues=residues, seed=seed, batch_size=batch_size, progress=progress,
              n_permutations=1, n_bootstrap=0, stride=stride)
    cycled = cycle_gates(model, ds[0])  # raises NotApplicableError before any evaluation when nothing rolls
    evals = {0: evaluate(model, task, **kw)}
    base = evals[0].per_phase()["acc"].to_numpy()
    rows, boundary = [], {}
    for delta in ds:
        copy, cycled = (cycled if delta == ds[0] else cycle_gates(model, delta)), None
        evals[delta] = ev = evaluate(copy, task, **kw)
        obs = ev.per_phase()["acc"].to_numpy()
        for p in range(S):
            rows.append(dict(delta=int(delta), phase=p, observed=obs[p], predicted=base[(p - delta) % S],
                             boundary=p == S - 1))
        boundary[int(delta)] = float(obs[S - 1])
    frame = pd.DataFrame(rows)
    inner = frame[~frame["boundary"]]
    r2 = r_squared(inner["observed"].to_numpy(), inner["predicted"].to_numpy())
    r2_all = r_squared(frame["observed"].to_numpy(), frame["predicted"].to_numpy())
    meta = metadata_of(model, deltas=list(deltas), n_per_residue=n_per_residue, residues=residues, seed=seed,
                       batch_size=batch_size, stride=stride)
    return GateCyclingResult(frame, r2, r2_all, boundary, base, S, evals, meta)
