"""Seeded simulations behind docs/statistics.md: gap-interval coverage, paired-test size and power, and the
period detector's answers. Writes docs/data/stats_simulations.json (numbers and the markdown tables the page
quotes verbatim; tests/stats/test_docs.py checks that they match).

Usage (from the repository root): OMP_NUM_THREADS=1 python -m experiments.stats_simulations [--tables 2000] [--out PATH]

The shipped file comes from ``OMP_NUM_THREADS=1 python -m experiments.stats_simulations --tables 2000``.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from scipy import stats as sps

from phaselens import stats
from phaselens.stats.gapci import batch_count_bounds, batch_paired_bounds
from phaselens.stats.omnibus import g_statistic
from phaselens.stats.paired import stratified_q
from phaselens.stats.periodicity import nested_fold_statistic
from phaselens.stats.simulate import count_tables, paired_tables

S, M, N, ITEM_SD = 4, 8, 256, 1.5
GAPS = (0.0, 0.02, 0.05, 0.10, 0.20, 0.40)


def profile(shape: str, gap: float, top: float = 0.7) -> np.ndarray:
    """Per-residue accuracy: one phase dipped by ``gap`` (three tied at the top) or four distinct phases."""
    phase = np.full(S, top) if shape == "dip" else top - gap * np.arange(S) / (S - 1)
    if shape == "dip":
        phase[-1] -= gap
    return np.tile(phase, M // S)


def percentile_bootstrap_low_high(c: np.ndarray, rng: np.random.Generator, b: int = 500) -> tuple:
    """The interval this replaced: percentile bootstrap of the folded max − min (binomial resampling)."""
    folded = c.reshape(c.shape[0], M // S, S).sum(axis=1)
    n = N * (M // S)
    boots = np.ptp(rng.binomial(n, folded[:, None, :] / n, size=(c.shape[0], b, S)) / n, axis=-1)
    return np.quantile(boots, 0.025, axis=1), np.quantile(boots, 0.975, axis=1)


def coverage(tables: int) -> dict:
    rows = []
    for design in ("independent", "paired"):
        for shape in ("dip", "distinct"):
            for gap in GAPS:
                rng = np.random.default_rng(1000 + int(1000 * gap) + (shape == "dip") + 10 * (design == "paired"))
                p = profile(shape, gap)
                if design == "independent":
                    c = count_tables(p, N, tables, rng)
                    b = batch_count_bounds(c, np.full_like(c, N), S, n_draws=4000, seed=1)
                    old_lo, old_hi = percentile_bootstrap_low_high(c, rng)
                    old = float(np.mean((old_lo <= gap + 1e-12) & (gap <= old_hi + 1e-12)))
                else:
                    b = batch_paired_bounds(paired_tables(p, N, ITEM_SD, tables, rng), S, n_draws=4000, seed=1)
                    old = None
                inside = (b["low"] <= gap + 1e-12) & (gap <= b["high"] + 1e-12)
                rows.append(dict(design=design, shape=shape, gap=gap, two_sided=float(inside.mean()),
                                 lower_side=float(np.mean(b["low"] <= gap + 1e-12)),
                                 one_sided_upper=float(np.mean(gap <= b["upper"] + 1e-12)),
                                 width=float(np.mean(b["high"] - b["low"])), percentile_bootstrap=old))
    return {"tables": tables, "rows": rows}


def paired_size_power(tables: int) -> dict:
    out = {}
    for name, prof in (("null", np.full(M, 0.6)), ("dip 7 pp", np.tile([0.6, 0.6, 0.6, 0.53], 2))):
        x = paired_tables(prof, N, ITEM_SD, tables, np.random.default_rng(7 + len(name)))
        c = x.sum(axis=1)
        n = np.full_like(c, N)
        q_all, _ = stratified_q(x, 1)
        q_nest, informative = stratified_q(x, S)
        df = np.maximum(informative.sum(axis=-1) * (M // S - 1), 1)
        out[name] = {
            "G": float(np.mean(sps.chi2.sf(g_statistic(c, n), M - 1) < 0.05)),
            "nested G": float(np.mean(sps.chi2.sf(nested_fold_statistic(c, n, S), M - S) < 0.05)),
            "Cochran Q": float(np.mean(sps.chi2.sf(q_all[:, 0], M - 1) < 0.05)),
            "nested Cochran": float(np.mean(sps.chi2.sf(q_nest.sum(axis=-1), df) < 0.05)),
        }
    # Continuous metric under the null with item effects: Kruskal treats rows as independent.
    rng = np.random.default_rng(21)
    kw = fr = 0
    reps = max(200, tables // 10)
    for _ in range(reps):
        v = rng.normal(0, 1.0, (N, 1)) + rng.normal(0, 0.3, (N, M))
        per_phase = v.reshape(N, M // S, S).mean(axis=1)
        kw += sps.kruskal(*[v[:, p::S].ravel() for p in range(S)]).pvalue < 0.05
        fr += sps.friedmanchisquare(*per_phase.T).pvalue < 0.05
    out["nll null"] = {"Kruskal-Wallis": kw / reps, "Friedman": fr / reps, "tables": reps}
    return {"tables": tables, "rates": out}


def sequential_period(c: np.ndarray, n: int, alpha: float = 0.05) -> int | None:
    """The detector this replaced: the first divisor whose nested test does not reject."""
    if not stats.g_test(c, n).rejects(alpha):
        return None
    for p in (d for d in range(2, c.size + 1) if c.size % d == 0):
        if not stats.nested_fold_test(c, n, p).rejects(alpha):
            return p
    return c.size


def _answer(r: stats.PeriodResult) -> str:
    return str(r.period) if r.status == "identified" else r.status


SCENARIOS = (
    ("no effect", [0.6] * 4, N),
    ("period 4, 10 pp dip", [0.6, 0.6, 0.6, 0.5], N),
    ("period 4, 20 pp dip", [0.6, 0.6, 0.6, 0.4], N),
    ("period 4, 10 pp dip, n = 1024", [0.6, 0.6, 0.6, 0.5], 1024),
    ("period 2, 10 pp dip", [0.6, 0.5], N),
    ("period 8, one residue 20 pp low", [0.6] * 7 + [0.4], N),
)


def detector(tables: int) -> dict:
    rows = []
    for name, prof, n in SCENARIOS:
        c = count_tables(np.tile(prof, M // len(prof)), n, tables, np.random.default_rng(zlib.crc32(name.encode())))
        new = Counter(_answer(stats.detect_period(row, n)) for row in c)
        old = Counter(str(sequential_period(row, n)).replace("None", "no effect") for row in c)
        rows.append(dict(scenario=name, n=n, new={k: v / tables for k, v in new.items()},
                         old={k: v / tables for k, v in old.items()}))
    paired = []
    for name, prof in (("no effect", [0.6] * 4), ("period 4, 10 pp dip", [0.6, 0.6, 0.6, 0.5])):
        x = paired_tables(np.tile(prof, 2), N, ITEM_SD, tables // 2, np.random.default_rng(len(name)))
        found = Counter(_answer(stats.detect_period_paired(t)) for t in x)
        paired.append(dict(scenario=name, new={k: v / (tables // 2) for k, v in found.items()}))
    return {"tables": tables, "rows": rows, "paired": paired, "paired_tables": tables // 2}


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def markdown(res: dict) -> dict[str, str]:
    cov = res["coverage"]["rows"]
    t1 = ["| design | profile | true gap (pp) | two-sided 95% | lower side | one-sided upper 95% | mean width (pp) "
          "| old percentile bootstrap |", "|---|---|---|---|---|---|---|---|"]
    for r in cov:
        t1.append(f"| {r['design']} | {r['shape']} | {100 * r['gap']:.0f} | {pct(r['two_sided'])} | "
                  f"{pct(r['lower_side'])} | {pct(r['one_sided_upper'])} | {100 * r['width']:.1f} | "
                  f"{pct(r['percentile_bootstrap'])} |")
    rates = res["paired"]["rates"]
    t2 = ["| paired table (256 items × 8 residues, item SD 1.5) | G | nested G | Cochran's Q | nested Cochran |",
          "|---|---|---|---|---|"]
    for name in ("null", "dip 7 pp"):
        r = rates[name]
        t2.append(f"| {name} | {pct(r['G'])} | {pct(r['nested G'])} | {pct(r['Cochran Q'])} | "
                  f"{pct(r['nested Cochran'])} |")
    nll = rates["nll null"]
    t2.append(f"\nNLL under the null with item effects ({nll['tables']} tables): Kruskal–Wallis rejects "
              f"{pct(nll['Kruskal-Wallis'])}%, Friedman {pct(nll['Friedman'])}%.")
    keys = ("no effect", "ambiguous", "2", "4", "8")
    t3 = ["| scenario (M = 8) | n per residue | detector | no period | ambiguous | 2 | 4 | 8 |",
          "|---|---|---|---|---|---|---|---|"]
    for r in res["detector"]["rows"]:
        for label, d in (("new", r["new"]), ("old sequential", r["old"])):
            t3.append(f"| {r['scenario']} | {r['n']} | {label} | " + " | ".join(
                "–" if (k == "ambiguous" and label != "new") else pct(d.get(k, 0.0)) for k in keys) + " |")
    for r in res["detector"]["paired"]:
        t3.append(f"| {r['scenario']}, paired items (SD 1.5) | 256 items | new (paired) | "
                  + " | ".join(pct(r["new"].get(k, 0.0)) for k in keys) + " |")
    return {"coverage": "\n".join(t1), "paired": "\n".join(t2), "detector": "\n".join(t3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs/data/stats_simulations.json")
    args = ap.parse_args()
    t0 = time.time()
    res = {"command": f"OMP_NUM_THREADS=1 python -m experiments.stats_simulations --tables {args.tables}",
           "settings": {"stride": S, "modulus": M, "n_per_residue": N, "item_sd_logit": ITEM_SD, "alpha": 0.05,
                        "level": 0.95}}
    res["coverage"] = coverage(args.tables)
    res["paired"] = paired_size_power(2 * args.tables)
    res["detector"] = detector(args.tables)
    res["tables_md"] = markdown(res)
    res["seconds"] = round(time.time() - t0)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(args.out)  # atomic
    print("\n\n".join(res["tables_md"].values()))
    print(f"wrote {args.out} in {res['seconds']} s")


if __name__ == "__main__":
    main()
