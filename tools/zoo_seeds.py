"""The zoo's findings across seeds: per configuration and seed, from the cards' evaluation counts.

    .venv/bin/python -m tools.zoo_seeds [--zoo phaselens/zoo]

Writes docs/data/seeds.json (rendered into docs/zoo.md by tools/gen_zoo_docs.py). Seed 0 of a configuration
is its base model (``w4s4``), seed K its replicate ``w4s4-seedK`` (``python -m tools.train_zoo w4s4 --seed K``).
Every number comes from a card's per-residue counts (1,000 items per residue, the cards' evaluation):
phases fold residues mod S (the control by S = 4); the gap is the folded max - min with its 95% interval and
one-sided 95% upper bound (``gap_ci``); the boundary rank counts phases from the worst (1 = the boundary phase
is the worst phase); the period is phaselens's ``detect_period`` on the 24 residue counts (closed testing;
``period_status`` and ``period_candidates`` say whether the data single out one period); a phase is *weak*
when its accuracy lies at least 10 pp below the model's best phase.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from phaselens.stats import detect_period, g_test, gap_ci
from phaselens.train.zoo_recipes import COMPARE_STRIDE, RECIPES, SEED_CONFIGS, SEED_SUFFIX

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "docs" / "data" / "seeds.json"
WEAK_PP = 0.10


def seed_summary(card: dict, stride: int) -> dict:
    """One seed's numbers from its card's per-residue counts."""
    correct = np.asarray(card["evaluation"]["correct"], dtype=float)
    n = np.asarray(card["evaluation"]["n"], dtype=float)
    phase_acc = np.bincount(np.arange(correct.size) % stride, weights=correct) / np.bincount(
        np.arange(n.size) % stride, weights=n)
    order = np.argsort(phase_acc, kind="stable")
    weak = [int(p) for p in np.flatnonzero(phase_acc <= phase_acc.max() - WEAK_PP)]
    c, t = correct.astype(int), n.astype(int)
    per = detect_period(c, t)
    gi = gap_ci(c, t, stride)
    return {
        "model": card["name"], "weights_sha256": card["weights_sha256"],
        "mean": float(correct.sum() / n.sum()), "phase_accuracy": phase_acc.round(5).tolist(),
        "gap": float(phase_acc.max() - phase_acc.min()), "residue_gap": float((correct / n).max() - (correct / n).min()),
        "worst_phase": int(order[0]), "boundary": float(phase_acc[stride - 1]),
        "boundary_rank": int(np.flatnonzero(order == stride - 1)[0]) + 1,
        "gap_ci": [gi.ci_low, gi.ci_high], "gap_upper_bound": gi.upper_bound,
        "period": per.period, "period_status": per.status, "period_candidates": list(per.candidates),
        "card_period": card["battery"]["period"], "p_g": g_test(c, t).pvalue, "weak_phases": weak,
    }


def spread(values: list[float]) -> dict:
    v = np.asarray(values, dtype=float)
    return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if v.size > 1 else None,
            "min": float(v.min()), "max": float(v.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", default=str(ROOT / "phaselens" / "zoo"), help="directory of model directories")
    args = parser.parse_args()
    zoo = Path(args.zoo)
    configs = {}
    for base in SEED_CONFIGS:
        comp = RECIPES[base].config.compression
        stride = comp.stride if comp is not None else COMPARE_STRIDE
        names = {0: base} | {int(m.group(1)): p.name for p in zoo.iterdir()
                             if (m := re.fullmatch(re.escape(base + SEED_SUFFIX) + r"(\d+)", p.name))}
        seeds = {k: seed_summary(json.loads((zoo / names[k] / "card.json").read_text()), stride)
                 for k in sorted(names) if (zoo / names[k] / "card.json").is_file()}
        rows = list(seeds.values())
        weak_count = {p: sum(p in r["weak_phases"] for r in rows) for p in range(stride)}
        configs[base] = {
            "stride": stride, "compressed": comp is not None, "seeds": {str(k): v for k, v in seeds.items()},
            "n_seeds": len(rows),
            "period_equals_stride_in_every_seed": all(r["period"] == stride for r in rows) if comp else None,
            "no_period_in_every_seed": all(r["period"] is None for r in rows) if comp is None else None,
            "mean": spread([r["mean"] for r in rows]), "gap": spread([r["gap"] for r in rows]),
            "boundary": spread([r["boundary"] for r in rows]),
            "boundary_rank": spread([r["boundary_rank"] for r in rows]),
            "weak_phase_count": weak_count,
            "boundary_weak_in_every_seed": weak_count[stride - 1] == len(rows),
            "recurring_weak_phases": [p for p, c in weak_count.items() if c == len(rows) and c > 0],
        }
    out = {"command": "python -m tools.zoo_seeds" + ("" if args.zoo == parser.get_default("zoo") else f" --zoo {args.zoo}"),
           "weak_rule_pp": 100 * WEAK_PP, "configs": configs}
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(OUT)
    print(json.dumps({b: {k: c[k] for k in ("n_seeds", "period_equals_stride_in_every_seed", "recurring_weak_phases")}
                      for b, c in configs.items()}))


if __name__ == "__main__":
    main()
