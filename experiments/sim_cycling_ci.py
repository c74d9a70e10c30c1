"""Coverage of the gate-cycling R^2 interval (``phaselens.analyses.cycling.r2_bootstrap_ci``) by simulation.

    .venv/bin/python -m experiments.sim_cycling_ci [--reps 500] [--bootstrap 1000]

Writes docs/data/cycling_ci_coverage.json (rendered into docs/zoo.md by ``python -m tools.gen_zoo_docs``); the
shipped file comes from ``python -m experiments.sim_cycling_ci --reps 1000 --bootstrap 1000``.

The simulated design is gate_cycling_test's: n items per residue (24 residues, S = 4), and every item answered
by the unmodified model and by each cycled copy (deltas 1, 2, 3), so the models' outcomes are paired. Item
difficulty varies: item i answers model m at phase p correctly with probability
``expit(logit(pi[m, p]) + u_i)``, ``u_i ~ N(0, 1.5^2)`` shared by all models. The true R^2 is the R^2 of the
population accuracies ``E_u expit(logit(pi) + u)`` (Gauss-Hermite quadrature), which is what an interval should
cover.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy.special import expit, logit

from phaselens.analyses.cycling import cycling_r2, r2_bootstrap_ci

ROOT = Path(__file__).resolve().parents[1]

DELTAS = (1, 2, 3)
RESIDUES = 24
ITEM_SD = 1.5
# pi[m, p]: row 0 the unmodified model, row d the copy cycled by d. The first two are the per-phase accuracies
# measured on zoo:w4s4 and zoo:w8s4 with gate_cycling_test (48 items per residue, seed 0), clipped to
# [0.005, 0.995]; "gate-driven" is a made-up profile that moves with delta up to a few points, while the
# boundary phase stays weak (true R^2 near the paper's 0.94-0.97).
_GATE = np.array([[0.88, 0.79, 0.50, 0.30], [0.30, 0.90, 0.74, 0.52], [0.46, 0.36, 0.83, 0.30], [0.81, 0.50, 0.23, 0.30]])
SCENARIOS = {
    "w4s4-like (moves, boundary stays)": np.array(
        [[0.983, 0.983, 0.986, 0.306], [0.222, 0.993, 0.965, 0.007], [0.892, 0.181, 0.965, 0.003],
         [0.833, 0.674, 0.205, 0.003]]),
    "w8s4-like (collapses)": np.array(
        [[0.84, 0.899, 0.997, 0.983], [0.285, 0.597, 0.587, 0.243], [0.861, 0.26, 0.625, 0.271],
         [0.677, 0.847, 0.309, 0.396]]),
    "gate-driven (R^2 near 1)": _GATE,
}


def population_accuracy(pi: np.ndarray, item_sd: float = ITEM_SD) -> np.ndarray:
    """``E_u expit(logit(pi) + u)`` for ``u ~ N(0, item_sd^2)``, by 60-point Gauss-Hermite quadrature."""
    x, w = np.polynomial.hermite_e.hermegauss(60)
    return (expit(logit(pi)[..., None] + item_sd * x) * (w / w.sum())).sum(-1)


def simulate(pi: np.ndarray, n_per_residue: int, reps: int, n_bootstrap: int, seed: int,
             include_boundary: bool = False) -> dict[str, float]:
    """Coverage of the basic and the percentile interval, the estimator's mean and the true R^2."""
    pi = np.clip(pi, 0.005, 0.995)
    S = pi.shape[1]
    truth = float(cycling_r2(population_accuracy(pi)[None], DELTAS, include_boundary=include_boundary)[0])
    rng = np.random.default_rng(seed)
    residue = np.repeat(np.arange(RESIDUES), n_per_residue)
    phase = residue % S
    hits = {"basic": 0, "percentile": 0}
    est, width = [], []
    for _ in range(reps):
        u = rng.normal(0.0, ITEM_SD, len(residue))
        y = rng.random((len(residue), len(pi))) < expit(logit(pi[:, phase]).T + u[:, None])
        acc = np.stack([np.bincount(phase, weights=col, minlength=S) for col in y.T.astype(float)])
        est.append(float(cycling_r2((acc / np.bincount(phase))[None], DELTAS, include_boundary=include_boundary)[0]))
        for method in hits:
            lo, hi = r2_bootstrap_ci(y, residue, DELTAS, S, include_boundary=include_boundary,
                                     n_bootstrap=n_bootstrap, seed=int(rng.integers(2**31)), method=method)
            hits[method] += lo <= truth <= hi
            if method == "basic":
                width.append(hi - lo)
    return {"true_r2": truth, "mean_estimate": float(np.mean(est)), "coverage_basic": hits["basic"] / reps,
            "coverage_percentile": hits["percentile"] / reps, "mean_width_basic": float(np.mean(width)),
            "reps": reps, "n_bootstrap": n_bootstrap, "n_per_residue": n_per_residue}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=500)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--n", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--out", default=str(ROOT / "docs" / "data" / "cycling_ci_coverage.json"))
    args = parser.parse_args()
    rows = []
    for i, (name, pi) in enumerate(SCENARIOS.items()):
        for n in args.n:
            row = {"scenario": name, **simulate(pi, n, args.reps, args.bootstrap, seed=1000 * i + n)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"command": " ".join(["python -m experiments.sim_cycling_ci", *sys.argv[1:]]), "residues": RESIDUES, "stride": 4,
           "deltas": list(DELTAS), "item_sd_logit": ITEM_SD, "level": 0.95, "rows": rows}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
