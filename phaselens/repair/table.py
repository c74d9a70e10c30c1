"""``repair_table``: every shift set and combining rule, measured on the same items, with the battery."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Unpack

import numpy as np
import pandas as pd
import torch

from phaselens.analyses.evaluation import eval_from_items, scored_metrics
from phaselens.analyses.items import check_options
from phaselens.analyses.runner import Analysis, Common, ResamplingOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import (
    METRICS,
    answer_metrics,
    black_box_metrics,
    items_from_metrics,
    model_logits,
    stack_metrics,
)
from phaselens.analyses.units import Units
from phaselens.contract.protocol import PhaseModel, is_black_box, model_name, require
from phaselens.core.checks import as_int, as_names
from phaselens.errors import InputError, NotApplicableError
from phaselens.repair.shifts import COMBINES, combine, default_pad_id, resolve_shifts, shifted_copies
from phaselens.results.phase_eval import PhaseEval
from phaselens.results.repair_rules import PhaseRepairTable


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


BLACK_BOX_COMBINES = ("max_conf", "vote")  # rules that need only each copy's greedy answer (and its confidence)


def block_copy_answers(model: Any, batch: Any, block: slice, shifts: Sequence[int], pad_id: int,
                       insert_at: int = 1, *, progress: bool = False) -> list[Any]:
    """A black-box model's :class:`~phaselens.contract.answers.Answers` for every shifted copy of the items in
    ``block``: one per copy, in the order of ``shifts`` (one call for all copies)."""
    tokens, qp = batch.tokens[block], batch.query_pos[block]
    K, B = len(shifts), tokens.shape[0]
    pos = torch.where(qp[None] < insert_at, qp[None], qp[None] + torch.as_tensor(shifts)[:, None])  # [K, B]
    copies = shifted_copies(tokens, shifts, pad_id, insert_at)
    ask = require(model, "answer_queries", "a black-box model is scored from its answers.")
    ans = ask(copies, pos.flatten(), batch.answer[block].repeat(K), batch.wrong[block].repeat(K), progress=progress)
    return [type(ans)(*(getattr(ans, f)[k * B:(k + 1) * B] for f in
                        ("predicted", "logp_answer", "logp_wrong", "logp_predicted"))) for k in range(K)]


def black_box_rule(copies: list[Any], answer: torch.Tensor, wrong: torch.Tensor, rule: str) -> dict[str, np.ndarray]:
    """The :data:`METRICS` of ``rule`` over a black-box model's per-copy answers (``[b]`` each).

    ``max_conf`` keeps the copy whose greedy token is most probable (it needs that log-probability).
    ``vote`` takes the most frequent greedy token; ties go to the token whose voters are most confident in
    it (in-process: the highest mean probability over all copies, which a server does not report), then to
    the first copy. Its ``p`` is (votes + 1e-3 x mean probability) / (copies + 1e-3), the in-process rule's
    normalized score (NaN where the server reports no probabilities)."""
    conf = np.stack([c.logp_predicted for c in copies])  # [K, b]
    if rule == "max_conf":
        if np.isnan(conf).any():
            raise NotApplicableError("combine='max_conf' needs each copy's confidence (the greedy token's "
                                     "log-probability), which this server does not report; use combines=('vote',).")
        best = conf.argmax(0)
        pick = {f: np.stack([getattr(c, f) for c in copies])[best, np.arange(best.size)]
                for f in ("predicted", "logp_answer", "logp_wrong", "logp_predicted")}
        return black_box_metrics(type(copies[0])(**pick), answer)
    k = len(copies)
    pred = np.stack([c.predicted for c in copies])  # [K, b]
    same = pred[:, None, :] == pred[None, :, :]  # [K, K, b]: copies j and i answered alike
    support = (same * np.nan_to_num(np.exp(conf))[None]).sum(1)  # [K, b]: confidence behind copy j's token
    score = same.sum(1) + 1e-3 * support / k - 1e-9 * np.arange(k)[:, None]
    winner = pred[score.argmax(0), np.arange(pred.shape[1])]
    a, w = answer.cpu().numpy(), wrong.cpu().numpy()
    mean_p = {f: np.exp(np.stack([getattr(c, f) for c in copies])).mean(0) for f in ("logp_answer", "logp_wrong")}
    p_a = ((pred == a).sum(0) + 1e-3 * mean_p["logp_answer"]) / (k + 1e-3)
    p_w = ((pred == w).sum(0) + 1e-3 * mean_p["logp_wrong"]) / (k + 1e-3)
    return {"correct": winner == a, "p_correct": p_a, "p_wrong": p_w, "logit_diff": np.log(p_a) - np.log(p_w),
            "nll": -np.log(p_a), "rank": np.where(winner == a, 0.0, np.nan), "predicted": winner.astype(np.int64)}


def black_box_rule_metrics(copies: list[Any], batch: Any, block: slice,
                           rules: Sequence[tuple[tuple[int, ...], str]]) -> tuple[np.ndarray, ...]:
    """:func:`rule_metrics` from a black-box model's per-copy answers instead of logits."""
    answer, wrong = batch.answer[block], batch.wrong[block]
    rows = [black_box_metrics(copies[0], answer)]
    rows += [black_box_rule([copies[k] for k in ks], answer, wrong, rule) for ks, rule in rules]
    copy_correct = np.stack([c.predicted == answer.cpu().numpy() for c in copies])
    return (*(np.stack([r[k] for r in rows]) for k in METRICS), copy_correct)


@dataclass(frozen=True)
class RepairState:
    """The pad token, every shift of the stride, each shift set (its label and shifts) and every
    (shifts, rule) pair measured."""

    pad: int
    all_shifts: tuple[int, ...]
    sets: list[tuple[str, tuple[int, ...]]]
    rules: list[tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class Repair(Analysis[RepairState]):
    """Every shifted copy of each block of items once; every (shift set, rule) combines the same answers."""

    name = "repair_table"
    stage = "repair"
    needs_phases = True
    black_box = True  # a served model's copies are combined from their answers (max_conf, vote)

    shift_sets: Any = ("all", "opposite")
    combines: Any = COMBINES
    pad_id: Any = None
    n_permutations: int = 2000

    def check(self, model: PhaseModel, options: Common) -> Repair:
        check_options(n_permutations=self.n_permutations)
        if "repair" in model.analysis_metadata:
            raise NotApplicableError(
                f"{model_name(model)} is already phase-repaired (it runs shifted copies); measure repair on the "
                "model it wraps (ensemble.model)."
            )
        default = self.combines is COMBINES
        combines = as_names("combines", self.combines, COMBINES)
        if is_black_box(model):
            if default:  # the rules a server's answers support
                combines = tuple(c for c in combines if c in BLACK_BOX_COMBINES)
            unsupported = [c for c in combines if c not in BLACK_BOX_COMBINES]
            if unsupported:
                raise NotApplicableError(
                    f"combines {unsupported} need every copy's full distribution over the vocabulary, which "
                    f"{model_name(model)} (a served model) does not report; use combines={BLACK_BOX_COMBINES}.")
        sets = self.shift_sets
        if isinstance(sets, str) or not isinstance(sets, Sequence) or not len(sets):
            raise InputError(f"shift_sets must be a non-empty list of shift sets, got {sets!r}; e.g. "
                             "shift_sets=('all', 'opposite', (0, 2)).")
        return replace(self, combines=tuple(combines))

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """One forward per block of items holding every shifted copy (``S`` copies, each ``S - 1`` tokens
        longer, padded), once: every rule combines the same copies."""
        S = int(options.stride if options.stride is not None else model.dims.analysis_spec.stride)
        return Units(item_passes=1, copies=S, extra_tokens=S - 1)

    def prepare(self, run: Run) -> RepairState:
        S = run.stride
        resolved = [resolve_shifts(shifts, S) for shifts in self.shift_sets]  # every set checked before the copies run
        pad = as_int("pad_id", self.pad_id, minimum=0) if self.pad_id is not None else default_pad_id(run.model, task=run.task)
        sets = [(shifts if isinstance(shifts, str) else ",".join(map(str, ks)), ks)
                for shifts, ks in zip(self.shift_sets, resolved)]
        return RepairState(pad, tuple(range(S)), sets, [(ks, rule) for _, ks in sets for rule in self.combines])

    def fields(self, run: Run) -> tuple[str, ...]:
        return (*METRICS, "copy_correct")

    def fingerprint(self, run: Run, state: RepairState) -> dict[str, Any]:
        return dict(shifts=state.all_shifts, rules=[[list(ks), rule] for ks, rule in state.rules], pad_id=state.pad,
                    insert_at=1, seed=run.options.seed)

    def compute(self, run: Run, state: RepairState, idx: list[int]) -> list[tuple[np.ndarray, ...]]:
        batch = run.batch
        if is_black_box(run.model):
            return [black_box_rule_metrics(block_copy_answers(run.model, batch, run.blocks[b], state.all_shifts,
                                                              state.pad, progress=run.options.progress),
                                           batch, run.blocks[b], state.rules) for b in idx]
        return [rule_metrics(block_copy_logits(run.model, batch, run.blocks[b], state.all_shifts, state.pad),
                             batch.answer[run.blocks[b]], batch.wrong[run.blocks[b]], state.rules) for b in idx]

    def result(self, run: Run, state: RepairState, parts: list[tuple[np.ndarray, ...]]) -> PhaseRepairTable:
        metrics = stack_metrics(parts, (*METRICS, "copy_correct"), axis=1)  # [1 + rules, N]; copies [K, N]
        copy_correct = metrics.pop("copy_correct")
        covered, o = run.covered(), run.options
        note: dict[str, Any] = {"pad_id": state.pad}

        def as_eval(r: int) -> PhaseEval:
            row = {k: v[r] for k, v in metrics.items()}
            tested, scored = scored_metrics(run.model, row)
            note.update(scored)
            return eval_from_items(items_from_metrics(run.batch, row), run.stride, run.modulus,
                                   n_permutations=self.n_permutations, n_bootstrap=o.n_bootstrap, seed=o.seed,
                                   residues=covered, metrics=tested)

        evals: dict[tuple[str, str], PhaseEval] = {("none", "none"): as_eval(0)}
        rows = [_row("none", "none", 1, evals[("none", "none")], copy_correct[0].mean())]
        r = 1
        for label, ks in state.sets:
            any_right = copy_correct[list(ks)].any(0).mean()
            for rule in self.combines:
                ev = as_eval(r)
                evals[(label, rule)] = ev
                rows.append(_row(label, rule, len(ks), ev, any_right))
                r += 1
        return PhaseRepairTable(pd.DataFrame(rows), evals, run.stride, run.metadata(**note))


@public
def repair_table(
    model: PhaseModel,
    task: Any = None,
    *,
    shift_sets: Sequence[Any] = ("all", "opposite"),
    combines: Sequence[str] = COMBINES,
    pad_id: int | None = None,
    n_permutations: int = 2000,
    **options: Unpack[ResamplingOptions],
) -> PhaseRepairTable:
    """Measure phase repair: every shift set x combining rule against the unrepaired model, same items.

    Each shifted copy runs once; every rule combines the same per-copy answers, one block of ``batch_size``
    items at a time (only a block's ``[K, b, V]`` logits are held).

    Args:
        task, phase, n_per_residue, residues, seed, batch_size, stride, progress, journal, n_bootstrap: the common
            options (docs/api.md). A journal holds the answer metrics of finished item blocks (every copy and
            rule); its fingerprint covers the model, the items, the shift sets, combining rules, pad token, seed
            and batch size, so a journal of another run is refused.
        shift_sets: ``"all"``, ``"opposite"`` or explicit shifts, one entry per set to compare.
        combines: the combining rules to compare (:data:`~phaselens.repair.shifts.COMBINES`).
        pad_id: the single-token pad (default: the model's or the task's filler).
        n_permutations: permutations of each row's gap test.
    """
    arguments = arguments_of(repair_table, locals())
    return run(Repair.from_arguments(arguments), model, task, arguments)


def _row(shifts: str, rule: str, cost: int, ev: PhaseEval, any_right: float) -> dict[str, Any]:
    c = ev.tests.counts
    lo, hi = ev.gap_ci
    return dict(shifts=shifts, combine=rule, cost=cost, mean=c.mean_accuracy, worst=c.worst_accuracy,
                worst_phase=c.worst_phase, boundary=c.boundary_accuracy, gap=c.phase_gap, gap_ci_low=lo, gap_ci_high=hi,
                any_copy_right=float(any_right), p_chi2=c.chi2.pvalue if c.chi2 else np.nan,
                p_g=c.g.pvalue if c.g else np.nan, period=ev.period,
                phase_accuracy=np.round(c.phase_accuracy, 6).tolist())
