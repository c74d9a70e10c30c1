"""The statistics battery on per-item rows: the count battery plus the tests that need item identity."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from phaselens.errors import LabelError
from phaselens.stats._checks import check_alpha, check_draws, check_level
from phaselens.stats.battery import PhaseBattery, _pct, _row
from phaselens.stats.battery_counts import count_battery
from phaselens.stats.continuous import ContinuousResult, continuous_phase_tests
from phaselens.stats.gapci import MIN_DRAWS, item_interval
from phaselens.stats.item_data import DEFAULT_METRICS, item_table
from phaselens.stats.omnibus import cochran_q
from phaselens.stats.outcomes import GapInterval, PermutationResult, TestResult, fmt_p
from phaselens.stats.paired import nested_cochran_q
from phaselens.stats.period import PeriodResult, detect_period_paired
from phaselens.stats.resampling import within_item_permutation_test
from phaselens.stats.subset import paired_tests


@dataclass(frozen=True, repr=False, eq=False)
class ItemBattery:
    """Result of :func:`phase_battery_items`.

    Attributes:
        counts: the count battery on the per-residue totals (its ``gap_ci`` is ``None``: see ``gap_ci`` here).
        n_items: distinct item ids.
        design: ``"paired"`` (every item once at every residue) or ``"unpaired"``.
        pairing_note: why the design is not paired (``None`` when it is).
        cochran: Cochran's Q over the residues tested (paired designs only).
        cochran_skipped: why Cochran's Q was not run.
        within_item: within-item permutation test of the folded gap (paired designs only).
        within_item_skipped: why it was not run.
        gap_ci: interval and equivalence bound of the folded gap from the items
            (:func:`~phaselens.stats.gapci.item_gap_ci`; item-cluster covariance when items cross residues);
            ``None`` when ``n_bootstrap=0``.
        continuous: one :class:`ContinuousResult` per continuous metric present in the frame.
        omnibus: the omnibus test the decisions use: Cochran's Q when paired, else the count battery's G.
        nested: the nested test (mod M vs mod S) the decisions use: nested Cochran when paired, else nested G
            (``None`` on a subset of residues where each phase tested holds one residue).
        period: the period detection the decisions use (paired detector when paired, else the count
            battery's); ``None`` on a subset of residues (it needs the whole cycle).
        skipped: test name → why it is ``None`` (the count battery's reasons included).
    """

    counts: PhaseBattery
    n_items: int
    design: str
    pairing_note: str | None
    cochran: TestResult | None
    cochran_skipped: str | None
    within_item: PermutationResult | None
    within_item_skipped: str | None
    gap_ci: GapInterval | None
    continuous: tuple[ContinuousResult, ...]
    omnibus: TestResult | None
    nested: TestResult | None
    period: PeriodResult | None
    skipped: dict[str, str] = field(default_factory=dict)

    def metric(self, name: str) -> ContinuousResult:
        """The continuous result for metric ``name``."""
        for r in self.continuous:
            if r.metric == name:
                return r
        raise LabelError(f"no continuous metric {name!r}; present: {[r.metric for r in self.continuous]}")

    def to_frame(self) -> pd.DataFrame:
        """The count battery's long frame plus rows for the item-level tests (same columns, plus ``note``)."""
        frame = self.counts.to_frame()
        extra: list[dict[str, object]] = []
        q = self.cochran
        extra.append(
            _row("test", "cochran_q", note=self.cochran_skipped)
            if q is None
            else _row("test", "cochran_q", statistic=q.statistic, df=q.df, pvalue=q.pvalue)
        )
        paired = self.design == "paired"
        if paired and (n := self.nested) is not None:
            extra.append(_row("test", n.name, statistic=n.statistic, df=n.df, pvalue=n.pvalue))
        if self.period is not None:
            extra.append(_row("period", "detected_period (decision)", estimate=self.period.period,
                              note=f"{self.period.status}; {'paired' if paired else 'count'} tests"))
        extra.extend(_row("not run", name, note=why) for name, why in self.skipped.items())
        w = self.within_item
        name = "folded_gap permutation (within-item)"
        extra.append(
            _row("test", name, note=self.within_item_skipped)
            if w is None
            else _row("test", name, statistic=w.statistic, pvalue=w.pvalue)
        )
        if (ci := self.gap_ci) is not None:
            extra.append(
                _row(
                    "summary",
                    f"phase_gap ({ci.scheme})",
                    estimate=ci.estimate,
                    ci_low=ci.ci_low,
                    ci_high=ci.ci_high,
                    note=f"one-sided upper {ci.level:.0%} bound {ci.upper_bound:.6g}",
                )
            )
        for r in self.continuous:
            section = f"metric:{r.metric}"
            extra.extend(
                _row(section, "phase_mean", index=p, estimate=m) for p, m in enumerate(r.phase_means)
            )
            extra.extend(
                _row(section, t.test, statistic=t.statistic, df=t.df, pvalue=t.pvalue, note=t.note)
                for t in r.to_frame().itertuples()
            )
        return pd.concat([frame.assign(note=None), pd.DataFrame(extra)], ignore_index=True).reindex(
            columns=[*frame.columns, "note"]
        )

    def summary(self) -> str:
        lines = [self.counts.summary(), f"  items: {self.n_items}, design {self.design}"]
        if self.pairing_note:
            lines[-1] += f" ({self.pairing_note})"
        n, pr = self.nested, self.period
        lines.append(_or_skipped(
            self.cochran, lambda c: f"  paired tests (these decide): Cochran's Q={c.statistic:.2f} (df {c.df}) "
            f"p={fmt_p(c.pvalue)}"
            + ("" if n is None else f"; nested Cochran Q={n.statistic:.3f} (df {n.df}) p={fmt_p(n.pvalue)}")
            + ("" if pr is None else f"; period {pr.period} ({pr.status})"),
            f"  Cochran's Q skipped: {self.cochran_skipped}"))
        lines.append(_or_skipped(
            self.within_item, lambda w: f"  within-item permutation of the folded gap: p={fmt_p(w.pvalue)} "
            f"(null mean {_pct(w.null_mean)} pp)",
            f"  within-item permutation skipped: {self.within_item_skipped}"))
        if self.gap_ci is not None:
            ci = self.gap_ci
            lines.append(
                f"  folded gap {_pct(ci.estimate)} pp, {ci.level:.0%} CI from items ({ci.scheme}) "
                f"[{_pct(ci.ci_low)}, {_pct(ci.ci_high)}], one-sided upper {_pct(ci.upper_bound)} pp"
            )
        lines.extend(f"  {r!r}" for r in self.continuous)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


def _or_skipped(result: Any, line: Callable[[Any], str], skipped: str) -> str:
    """``line(result)``, or the line saying why the test was skipped when ``result`` is ``None``."""
    return skipped if result is None else line(result)


def phase_battery_items(
    frame: pd.DataFrame,
    stride: int,
    modulus: int | None = None,
    *,
    metrics: Sequence[str] = DEFAULT_METRICS,
    alpha: float = 0.05,
    level: float = 0.95,
    n_permutations: int = 9999,
    n_bootstrap: int = 2000,
    seed: int = 0,
    residues: Sequence[int] | None = None,
) -> ItemBattery:
    """Run the battery on per-item rows.

    Args:
        frame: one row per (item, residue) outcome with columns ``item_id``, ``residue`` (0..M−1) and
            ``correct`` (0/1 or bool); optional continuous columns named in ``metrics``.
        stride: S.
        modulus: M; default ``max(residue) + 1`` rounded up to a multiple of S. Every residue needs rows,
            unless ``residues`` lists the ones the design covers.
        metrics: continuous columns to test when present (default ``nll`` and ``logit_diff``).
        alpha, level, n_permutations, n_bootstrap, seed: as in :func:`phase_battery`.
        residues: the residues the design covers when it covers only some of 0..M−1 (each needs rows, and
            no row may lie outside them). The tests then run over the residues present
            (:mod:`phaselens.stats.subset`): pairing means every item once at every listed residue; the
            nested test and period detection are ``None`` where undefined, with the reason in ``skipped``.

    The count battery runs on the per-residue totals. In a paired design (every item exactly once at every
    residue) the decisions use tests that respect the pairing: Cochran's Q (omnibus), the nested Cochran test
    (mod M vs mod S) and :func:`~phaselens.stats.period.detect_period_paired`; continuous metrics use Friedman.
    Otherwise the paired tests are skipped, the result says why, and the decisions are the count battery's.
    """
    tab = item_table(frame, stride, modulus, metrics, residues)
    sub = tab.subset
    b = check_draws(n_permutations, "n_permutations")
    alpha, level = check_alpha(alpha), check_level(level)
    c, n = tab.counts()
    counts = count_battery(c, n, sub, alpha=alpha, level=level, n_permutations=b, n_draws=None, seed=seed)
    skipped = dict(counts.skipped)
    cochran = within = None
    omnibus, nested, period = counts.g, counts.nested, counts.period
    if tab.paired:
        m = tab.matrix(tab.correct)
        if sub.complete:
            cochran = cochran_q(m)
            within = within_item_permutation_test(m, tab.stride, n_permutations=b, seed=seed)
            nested = nested_cochran_q(m, tab.stride)
            period = detect_period_paired(m, alpha=alpha)
        else:
            paired = paired_tests(m, sub, n_permutations=b, seed=seed)
            cochran, within, nested = paired["cochran"], paired["within_item"], paired["nested"]
            skipped.update(paired["skipped"])
        omnibus = cochran
    ci = None
    if n_bootstrap and sub.phases.size >= 2:
        ci = item_interval(tab.item, tab.residue, tab.correct, tab.stride, sub.phases, level=level,
                           n_draws=max(check_draws(n_bootstrap, "n_bootstrap"), MIN_DRAWS), seed=seed)
    continuous = tuple(
        continuous_phase_tests(
            v,
            tab.residue,
            tab.stride,
            tab.modulus,
            item_ids=tab.item,
            metric=name,
            n_permutations=b,
            seed=seed,
        )
        for name, v in tab.metrics.items()
        if sub.phases.size >= 2
    )
    if sub.phases.size < 2:
        skipped["continuous"] = "one phase tested: nothing to compare across phases"
    return ItemBattery(
        counts=counts,
        n_items=tab.n_items,
        design="paired" if tab.paired else "unpaired",
        pairing_note=tab.pairing_note,
        cochran=cochran,
        cochran_skipped=tab.pairing_note or skipped.get("cochran"),
        within_item=within,
        within_item_skipped=tab.pairing_note or skipped.get("within_item"),
        gap_ci=ci,
        continuous=continuous,
        omnibus=omnibus,
        nested=nested,
        period=period,
        skipped=skipped,
    )
