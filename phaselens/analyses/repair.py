"""``repair_table``: every shift set and combining rule, measured on the same items, with the battery."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from phaselens.analyses.evaluation import PhaseEval, eval_from_items
from phaselens.analyses.items import build_items, check_battery_items, check_options
from phaselens.analyses.scoring import METRICS, answer_metrics, items_from_metrics, model_logits
from phaselens.contract.protocol import PhaseModel, check_model, metadata_of, model_name
from phaselens.core.checks import as_int, as_names
from phaselens.core.errors import InputError, NotApplicableError
from phaselens.results.base import Result
from phaselens.runtime.checkpoints import check_checkpoint_path
from phaselens.runtime.distributed import block_labels, item_blocks, open_checkpoint, shard_map, sharded
from phaselens.runtime.phase_shift import COMBINES, combine, default_pad_id, resolve_shifts, shifted_copies


@dataclass(frozen=True, repr=False, eq=False)
class RepairTable(Result):
    """Repaired against unrepaired accuracy.

    Attributes:
        rows: one row per (shift set, rule) plus the unrepaired baseline: ``cost`` (forward multiple), ``mean``,
            ``worst``, ``worst_phase``, ``boundary``, ``gap`` with its 95% CI, ``any_copy_right`` (the share of
            items some copy answers correctly: an upper bound for any rule), the battery's ``p_chi2`` and
            ``period`` on the repaired counts.
        evals: the :class:`PhaseEval` of each row, keyed like ``("all", "max_conf")``; ``("none", "none")`` is
            the unrepaired model.
    """

    rows: pd.DataFrame
    evals: dict[tuple[str, str], PhaseEval]
    stride: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> PhaseEval:
        return self.evals[("none", "none")]

    def best(self) -> tuple[str, str]:
        rep = self.rows[self.rows["shifts"] != "none"]
        r = rep.sort_values(["worst", "mean"], ascending=False).iloc[0]
        return str(r["shifts"]), str(r["combine"])

    LEVELS = ("residue", "phase", "rule")

    def per_rule(self) -> pd.DataFrame:
        """One row per (shift set, combining rule) and the baseline (the summary table)."""
        return self.rows.copy()

    def _stack(self, level: str) -> pd.DataFrame:
        parts = [getattr(ev, "per_" + level)().assign(shifts=k[0], combine=k[1]) for k, ev in self.evals.items()]
        out = pd.concat(parts, ignore_index=True)
        return out[["shifts", "combine", *[c for c in out.columns if c not in ("shifts", "combine")]]]

    def per_residue(self) -> pd.DataFrame:
        """Accuracy per residue for every row (``shifts``, ``combine``; ``none`` is the unrepaired model)."""
        return self._stack("residue")

    def per_phase(self) -> pd.DataFrame:
        """Accuracy per phase for every row, with Wilson CIs and ``boundary``."""
        return self._stack("phase")

    def summary(self) -> str:
        lines = [f"RepairTable (stride {self.stride}; accuracies in %)"]
        for r in self.rows.itertuples():
            lines.append(f"  {r.shifts:>8} {r.combine:>12} x{r.cost}: mean {100 * r.mean:.1f}, worst {100 * r.worst:.1f}, "
                         f"gap {100 * r.gap:.1f} [{100 * r.gap_ci_low:.1f}, {100 * r.gap_ci_high:.1f}], "
                         f"any-copy {100 * r.any_copy_right:.1f}, p={r.p_chi2:.2g}, period {r.period}")
        return "\n".join(lines)

    def plot(self, **kwargs: Any):
        from phaselens import plots

        return plots.repair_panel(self, **kwargs)


@torch.no_grad()
def copy_query_logits(model: Any, batch: Any, shifts: Sequence[int], pad_id: int, *, batch_size: int = 64,
                      insert_at: int = 1, progress: bool = False) -> torch.Tensor:
    """Query logits of every shifted copy: ``[K, N, V]`` (copy k reads position ``query_pos + k``).

    Under torch.distributed the blocks of ``batch_size`` items are split across ranks and gathered."""
    blocks = item_blocks(len(batch), batch_size)
    out = shard_map(lambda idx: [block_copy_logits(model, batch, blocks[b], shifts, pad_id, insert_at) for b in idx],
                    block_labels(blocks), progress=progress, stage="repair", model=model)
    return torch.cat(out, 1)


@torch.no_grad()
def block_copy_logits(model: Any, batch: Any, block: slice, shifts: Sequence[int], pad_id: int,
                      insert_at: int = 1) -> torch.Tensor:
    """Query logits ``[K, b, V]`` (CPU, float) of every shifted copy of the items in ``block`` (one forward)."""
    tokens = batch.tokens[block]
    qp = batch.query_pos[block]
    K, B = len(shifts), tokens.shape[0]
    k = torch.as_tensor(shifts)[:, None]
    pos = torch.where(qp[None] < insert_at, qp[None], qp[None] + k)  # [K, B]
    copies = shifted_copies(tokens, shifts, pad_id, insert_at)
    logits = model_logits(model, copies, pos.flatten())  # the query rows only: [K*B, T', V]
    at = (pos.flatten() - (copies.shape[1] - logits.shape[1])).to(logits.device)
    return logits[torch.arange(K * B, device=logits.device), at].view(K, B, -1).float().cpu()


def rule_metrics(per_copy: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor,
                 rules: Sequence[tuple[tuple[int, ...], str]]) -> tuple[np.ndarray, ...]:
    """Answer metrics of the unrepaired model (copy 0) and of each ``(copies, rule)``, from per-copy logits
    ``[K, b, V]``: one array ``[1 + len(rules), b]`` per name in ``METRICS``, then ``copy_correct`` ``[K, b]``.

    Every quantity is per item, so a block's metrics equal those of the whole batch's rows."""
    rows = [answer_metrics(per_copy[0], answer, wrong)]
    rows += [answer_metrics(combine(per_copy[list(ks)], rule)[0], answer, wrong) for ks, rule in rules]
    copy_correct = np.stack([answer_metrics(c, answer, wrong)["correct"] for c in per_copy])
    return (*(np.stack([r[k] for r in rows]) for k in METRICS), copy_correct)


@sharded
def repair_table(
    model: PhaseModel,
    task: Any = None,
    *,
    shift_sets: Sequence[Any] = ("all", "opposite"),
    combines: Sequence[str] = COMBINES,
    n_per_residue: int = 256,
    residues: Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int = 64,
    pad_id: int | None = None,
    progress: bool = True,
    stride: int | None = None,
    n_permutations: int = 2000,
    n_bootstrap: int = 1000,
    checkpoint: str | os.PathLike | None = None,
) -> RepairTable:
    """Measure phase repair: every shift set x combining rule against the unrepaired model, same items.

    Each shifted copy runs once; every rule combines the same per-copy answers, one block of ``batch_size``
    items at a time (only a block's ``[K, b, V]`` logits are held).

    Args:
        checkpoint: a file path: the answer metrics of finished item blocks (every copy and rule) are written
            there atomically and a rerun (with any number of processes) resumes. The fingerprint covers the
            model, the items, the shift sets, combining rules, pad token, seed and batch size: a checkpoint of
            another run is refused.
    """
    check_model(model)
    check_options(batch_size=batch_size, progress=progress, n_bootstrap=n_bootstrap, n_permutations=n_permutations)
    check_checkpoint_path(checkpoint)
    if "repair" in (getattr(model, "analysis_metadata", None) or {}):
        raise NotApplicableError(
            f"{model_name(model)} is already phase-repaired (it runs shifted copies); measure repair on the model "
            "it wraps (ensemble.model)."
        )
    combines = as_names("combines", combines, COMBINES)
    if isinstance(shift_sets, str) or not isinstance(shift_sets, Sequence) or not len(shift_sets):
        raise InputError(f"shift_sets must be a non-empty list of shift sets, got {shift_sets!r}; e.g. "
                         "shift_sets=('all', 'opposite', (0, 2)).")
    task, spec, batch = build_items(model, task, n_per_residue=n_per_residue, residues=residues, seed=seed,
                                    stride=stride)
    S = spec.stride
    check_battery_items(spec, batch, stride, "repair_table")
    for shifts in shift_sets:  # every set checked before the copies run
        resolve_shifts(shifts, S)
    pad = as_int("pad_id", pad_id, minimum=0) if pad_id is not None else default_pad_id(model)
    all_shifts = tuple(range(S))
    sets = [(shifts if isinstance(shifts, str) else ",".join(map(str, resolve_shifts(shifts, S))),
             resolve_shifts(shifts, S)) for shifts in shift_sets]
    rules = [(ks, rule) for _, ks in sets for rule in combines]
    store = None
    if checkpoint is not None:
        from phaselens.runtime.fingerprints import analysis_fingerprint

        fp = analysis_fingerprint(model, analysis="repair_table", items=batch.tokens, query_pos=batch.query_pos,
                                  answers=batch.answer, wrong=batch.wrong, shifts=all_shifts,
                                  rules=[[list(ks), rule] for ks, rule in rules], pad_id=pad, insert_at=1,
                                  seed=seed, batch_size=batch_size)
        store = open_checkpoint(checkpoint, fp, (*METRICS, "copy_correct"))
    blocks = item_blocks(len(batch), batch_size)

    def compute(idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        return [rule_metrics(block_copy_logits(model, batch, blocks[b], all_shifts, pad), batch.answer[blocks[b]],
                             batch.wrong[blocks[b]], rules) for b in idx]

    # item blocks split across ranks under torch.distributed; finished blocks checkpointed after every round
    parts = shard_map(compute, block_labels(blocks), store=store, progress=progress, stage="repair", model=model)
    metrics = {k: np.concatenate([p[j] for p in parts], 1) for j, k in enumerate(METRICS)}  # [1 + rules, N]
    copy_correct = np.concatenate([p[-1] for p in parts], 1)  # [K, N]

    covered = None if residues is None else np.unique(batch.frame["residue"].to_numpy())

    def as_eval(r: int) -> PhaseEval:
        items = items_from_metrics(batch, {k: v[r] for k, v in metrics.items()})
        return eval_from_items(items, S, batch.modulus, n_permutations=n_permutations, n_bootstrap=n_bootstrap,
                               seed=seed, residues=covered)

    evals: dict[tuple[str, str], PhaseEval] = {("none", "none"): as_eval(0)}
    rows = [_row("none", "none", 1, evals[("none", "none")], copy_correct[0].mean())]
    r = 1
    for label, ks in sets:
        any_right = copy_correct[list(ks)].any(0).mean()
        for rule in combines:
            ev = as_eval(r)
            evals[(label, rule)] = ev
            rows.append(_row(label, rule, len(ks), ev, any_right))
            r += 1
    meta = metadata_of(model, shift_sets=list(shift_sets), combines=list(combines), n_per_residue=n_per_residue,
                       residues=residues, seed=seed, batch_size=batch_size, pad_id=pad_id, stride=stride,
                       n_permutations=n_permutations, n_bootstrap=n_bootstrap,
                       checkpoint=None if checkpoint is None else str(checkpoint))
    meta["pad_id"] = pad
    return RepairTable(pd.DataFrame(rows), evals, S, meta)


def _row(shifts: str, rule: str, cost: int, ev: PhaseEval, any_right: float) -> dict[str, Any]:
    c = ev.tests.counts
    lo, hi = ev.gap_ci
    return dict(shifts=shifts, combine=rule, cost=cost, mean=c.mean_accuracy, worst=c.worst_accuracy,
                worst_phase=c.worst_phase, boundary=c.boundary_accuracy, gap=c.phase_gap, gap_ci_low=lo, gap_ci_high=hi,
                any_copy_right=float(any_right), p_chi2=c.chi2.pvalue if c.chi2 else np.nan,
                p_g=c.g.pvalue if c.g else np.nan, period=ev.period,
                phase_accuracy=np.round(c.phase_accuracy, 6).tolist())
