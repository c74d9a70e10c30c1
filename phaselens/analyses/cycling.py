"""Gate cycling: roll the compressor's offset-specific gate parameters and see the weak phases move.

If a model's phase preferences live in its offset-specific gate parameters (per-offset gate weights and
the per-offset bias), rolling them by delta should move the accuracy profile with them:
``A_delta(p) ~ A_0((p - delta) mod S)`` (science.md §3). The payload maps stay fixed.

R^2 of that prediction comes with a bootstrap interval over items (:func:`r2_bootstrap_ci`); its coverage is
checked by simulation in ``tests/analyses/test_cycling.py`` and tabulated in docs/mechanism.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Unpack

import numpy as np
import pandas as pd

from phaselens.analyses.evaluation import eval_from_items
from phaselens.analyses.runner import (
    Analysis,
    Common,
    NoState,
    ResamplingOptions,
    Run,
    arguments_of,
    public,
    run,
)
from phaselens.analyses.scoring import METRICS, block_metrics, items_from_metrics, plain_forward
from phaselens.analyses.units import Units
from phaselens.contract.protocol import PhaseModel, model_name, require
from phaselens.core.checks import as_int
from phaselens.errors import InputError, NotApplicableError, StatsInputError
from phaselens.results.gate_cycling import PhaseGateCycling
from phaselens.stats._checks import check_draws, check_level


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




def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    """1 - SS_res / SS_tot against the identity line."""
    ss_res = float(((observed - predicted) ** 2).sum())
    ss_tot = float(((observed - observed.mean()) ** 2).sum())
    return 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def cycling_r2(accuracy: np.ndarray, deltas: Sequence[int], *, include_boundary: bool = False) -> np.ndarray:
    """R^2 of ``A_delta(p)`` against ``A_0((p - delta) mod S)``, pooled over deltas, for a batch of profiles.

    Args:
        accuracy: ``[..., 1 + D, S]`` per-phase accuracy; row 0 the unmodified model, row ``1 + d`` the copy
            cycled by ``deltas[d]``.
        deltas: the D shifts.
        include_boundary: pool the boundary phase S - 1 too (``r2_all``); by default it is left out.

    Returns:
        ``[...]`` R^2 against the identity line (:func:`r_squared` on each profile set); NaN where the
        observed values do not vary.
    """
    acc = np.asarray(accuracy, dtype=float)
    S = acc.shape[-1]
    shift = (np.arange(S)[None, :] - np.asarray(deltas, dtype=int)[:, None]) % S  # [D, S]
    predicted = acc[..., 0, :][..., shift]  # [..., D, S]
    observed = acc[..., 1:, :]
    keep = np.ones(S, bool) if include_boundary else np.arange(S) != S - 1
    o = observed[..., keep].reshape(*acc.shape[:-2], -1)
    p = predicted[..., keep].reshape(*acc.shape[:-2], -1)
    ss_res = ((o - p) ** 2).sum(-1)
    ss_tot = ((o - o.mean(-1, keepdims=True)) ** 2).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ss_tot > 0, 1 - ss_res / ss_tot, np.nan)


def r2_bootstrap_ci(
    correct: np.ndarray,
    residue: np.ndarray,
    deltas: Sequence[int],
    stride: int,
    *,
    include_boundary: bool = False,
    level: float = 0.95,
    n_bootstrap: int = 2000,
    seed: int = 0,
    method: str = "basic",
) -> tuple[float, float]:
    """Bootstrap interval of the gate-cycling R^2 over items.

    Every model (the unmodified one and each cycled copy) answers the same items, so one replicate resamples
    items with replacement inside each residue (the design fixes the residue sizes) and recomputes every
    model's per-phase accuracy from that same resample. The interval is the basic (reverse-percentile) one,
    ``[2 R^2 - q_hi, 2 R^2 - q_lo]`` with the upper end capped at 1: R^2 is biased low, because sampling
    noise in both the observed and the predicted profile adds to the residuals, and a replicate carries that
    noise twice, so percentile intervals miss a true R^2 near 1 almost always (simulated coverage in
    docs/mechanism.md).

    Args:
        correct: ``[N, 1 + D]`` 0/1 outcomes; column 0 the unmodified model, column ``1 + d`` the copy cycled
            by ``deltas[d]``; the same N items in every column.
        residue: ``[N]`` each item's residue (its phase is ``residue mod stride``).
        deltas: the D shifts.
        stride: S.
        include_boundary: interval for ``r2_all`` instead of ``r2``.
        level: confidence level.
        n_bootstrap: replicates (those in which a phase has no item, or the observed profile is flat, drop).
        seed: seed for ``np.random.default_rng``.
        method: ``"basic"``, or ``"percentile"`` (the replicates' quantiles; kept for comparison only).

    Returns:
        ``(low, high)``.
    """
    if method not in ("basic", "percentile"):
        raise StatsInputError(f"method must be 'basic' or 'percentile', got {method!r}.")
    level, n_bootstrap = check_level(level), check_draws(n_bootstrap, "n_bootstrap")
    y = np.asarray(correct, dtype=float)
    res = np.asarray(residue, dtype=int)
    if y.ndim != 2 or y.shape[1] != len(deltas) + 1 or res.shape != (y.shape[0],):
        raise StatsInputError(
            f"correct must be [N, 1 + len(deltas)] = [N, {len(deltas) + 1}] with one residue per row; got "
            f"correct {y.shape} and residue {res.shape}."
        )
    n = len(res)
    phase_onehot = np.eye(stride)[res % stride]  # [N, S]
    design = (y[:, :, None] * phase_onehot[:, None, :]).reshape(n, -1)  # [N, (1 + D) * S]
    estimate = float(cycling_r2(_weighted_accuracy(np.ones((1, n)), design, phase_onehot), deltas,
                                include_boundary=include_boundary)[0])
    # Resample within residue: sort by residue, draw an offset inside each item's own residue block.
    order = np.argsort(res, kind="stable")
    sorted_res = res[order]
    start = np.searchsorted(sorted_res, sorted_res, side="left")
    size = np.bincount(sorted_res)[sorted_res]
    rng = np.random.default_rng(seed)
    reps = []
    chunk = max(1, (1 << 22) // max(n, 1))
    for b0 in range(0, n_bootstrap, chunk):  # chunks bound memory ([B, N] weights); each chunk is one batch
        b = min(chunk, n_bootstrap - b0)
        idx = order[start + (rng.random((b, n)) * size).astype(int)]
        weights = np.bincount((np.arange(b)[:, None] * n + idx).ravel(), minlength=b * n).reshape(b, n)
        with np.errstate(divide="ignore", invalid="ignore"):
            acc = _weighted_accuracy(weights.astype(float), design, phase_onehot)
        reps.append(cycling_r2(acc, deltas, include_boundary=include_boundary))
    boots = np.concatenate(reps)
    boots = boots[np.isfinite(boots)]
    if boots.size == 0 or not np.isfinite(estimate):
        return float("nan"), float("nan")
    q_lo, q_hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    if method == "percentile":
        return float(q_lo), float(q_hi)
    return float(2 * estimate - q_hi), float(min(1.0, 2 * estimate - q_lo))


def _weighted_accuracy(weights: np.ndarray, design: np.ndarray, phase_onehot: np.ndarray) -> np.ndarray:
    """Per-phase accuracy ``[B, 1 + D, S]`` of every model under item weights ``[B, N]``."""
    S = phase_onehot.shape[1]
    return (weights @ design).reshape(len(weights), -1, S) / (weights @ phase_onehot)[:, None, :]


@dataclass(frozen=True, eq=False)
class GateCycling(Analysis[NoState]):
    """One unit per model (the unmodified one, then each gate-cycled copy): every item's answers. Checked,
    ``deltas`` holds each shift once (nonzero mod S) and ``first`` the copy cycled by the first."""

    name = "gate_cycling_test"
    stage = "cycling"
    unit = "copy"
    bar_unit = "model"

    deltas: Any = (-3, -2, -1, 1, 2, 3)
    first: Any = None

    def check(self, model: PhaseModel, options: Common) -> GateCycling:
        require(model, "cycle_gates", "gate cycling rolls offset-specific gate parameters.")
        S = model.dims.analysis_spec.stride if options.stride is None else int(options.stride)
        if S < 2:
            raise NotApplicableError(f"{model_name(model)} has no compressed layers (analysis stride {S}), so there "
                                     "are no gates to cycle; run the gate-cycling test on a compressed model.")
        deltas = self.deltas
        if isinstance(deltas, str) or not isinstance(deltas, Iterable):
            raise InputError(f"deltas must be a list of ints, got {deltas!r}; e.g. deltas={tuple(range(1, S))}.")
        ds = tuple(dict.fromkeys(d for d in (as_int("delta", d) for d in deltas) if d % S))  # each shift once
        if not ds:
            raise InputError(f"deltas {list(deltas)!r} hold no shift that is nonzero mod the stride {S}; pass e.g. "
                             f"deltas={tuple(range(1, S))}.")
        # NotApplicableError before any item is built: nothing rolls
        return replace(self, deltas=ds, first=cycle_gates(model, ds[0]))

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """One forward of every item per model: the unmodified one, then each gate-cycled copy (held beside
        it: two copies of the weights)."""
        return Units(item_passes=1 + len(self.deltas), weight_copies=2, unit="copy")

    def prepare(self, run: Run) -> NoState:
        """Before any forward: the items must cover every phase, as the prediction for phase ``p`` under a
        shift is the unmodified accuracy of phase ``p - delta``."""
        covered = run.covered()
        S = run.stride
        phases = sorted({int(r) % S for r in covered}) if covered is not None else list(range(S))
        if len(phases) < S:
            given = (f"residues={list(run.options.residues)}" if run.options.residues is not None
                     else f"phase={run.options.phase!r}")
            raise InputError(
                f"gate_cycling_test compares each phase's accuracy under a shift with the unmodified accuracy of the "
                f"phase it came from, so its items must cover all {S} phases 0..{S - 1}: at least {S} residues, one "
                f"per phase (e.g. residues={list(range(S))}); {given} covers phases {phases}. Pass residues=None "
                "(every residue) or residues that cover every phase.")
        return NoState()

    def labels(self, run: Run, state: NoState) -> list[str]:
        return ["delta 0", *(f"delta {d:+d}" for d in self.deltas)]

    def fields(self, run: Run) -> tuple[str, ...]:
        return METRICS

    def fingerprint(self, run: Run, state: NoState) -> dict[str, Any]:
        return dict(deltas=list(self.deltas))

    def compute(self, run: Run, state: NoState, idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        out = []
        ds = self.deltas
        for i in idx:
            delta = 0 if i == 0 else ds[i - 1]
            model = run.model if i == 0 else self.first if delta == ds[0] else cycle_gates(run.model, delta)
            forward = plain_forward(model)
            out.append(tuple(np.concatenate(m) for m in zip(*(block_metrics(forward, run.batch, sl)
                                                                   for sl in run.blocks))))
        return out

    def result(self, run: Run, state: NoState, parts: list[tuple[np.ndarray, ...]]) -> PhaseGateCycling:
        S, ds, o = run.stride, self.deltas, run.options
        covered = run.covered()
        evals = {}
        for delta, part in zip([0, *ds], parts):
            items = items_from_metrics(run.batch, dict(zip(METRICS, part)))
            evals[delta] = eval_from_items(items, S, run.modulus, n_permutations=1, n_bootstrap=0, seed=o.seed,
                                           residues=covered)
        base = evals[0].per_phase()["acc"].to_numpy()
        rows, boundary = [], {}
        for delta in ds:
            obs = evals[delta].per_phase()["acc"].to_numpy()
            for p in range(S):
                rows.append(dict(delta=int(delta), phase=p, observed=obs[p], predicted=base[(p - delta) % S],
                                 boundary=p == S - 1))
            boundary[int(delta)] = float(obs[S - 1])
        frame = pd.DataFrame(rows)
        inner = frame[~frame["boundary"]]
        r2 = r_squared(inner["observed"].to_numpy(), inner["predicted"].to_numpy())
        r2_all = r_squared(frame["observed"].to_numpy(), frame["predicted"].to_numpy())
        cis = [(float("nan"), float("nan"))] * 2
        if o.n_bootstrap:
            y = np.stack([ev.items["correct"].to_numpy() for ev in evals.values()], axis=1)
            residue = evals[0].items["residue"].to_numpy()
            cis = [r2_bootstrap_ci(y, residue, ds, S, include_boundary=b, n_bootstrap=o.n_bootstrap, seed=o.seed)
                   for b in (False, True)]
        note = "95%, basic bootstrap over items resampled within residue, one resample for all models"
        return PhaseGateCycling(frame, r2, r2_all, boundary, base, S, evals, run.metadata(ci=note), cis[0], cis[1])


@public
def gate_cycling_test(
    model: PhaseModel,
    task: Any = None,
    *,
    deltas: Sequence[int] = (-3, -2, -1, 1, 2, 3),
    **options: Unpack[ResamplingOptions],
) -> PhaseGateCycling:
    """Evaluate the model and its gate-cycled copies; compare ``A_delta(p)`` with ``A_0((p - delta) mod S)``.

    Every copy answers the same items, so the R^2 intervals resample items once for all models
    (:func:`r2_bootstrap_ci`, ``n_bootstrap`` replicates; 0 skips them).

    Args:
        task, phase, n_per_residue, residues, seed, batch_size, stride, progress, journal, n_bootstrap: the common
            options (docs/api.md); a journal holds each finished model's answers.
        deltas: the shifts to roll the gates by (each nonzero mod S, once).

    Raises:
        NotApplicableError: the model cannot cycle its gates (``cycle_gates`` capability), or has nothing to roll.
    """
    arguments = arguments_of(gate_cycling_test, locals())
    return run(GateCycling.from_arguments(arguments), model, task, arguments)
