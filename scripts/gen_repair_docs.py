"""Generate docs/repair.md: the measured phase-repair table for every zoo model.

    .venv/bin/python scripts/gen_repair_docs.py [--n-per-residue 1000] [--cache runs/repair_docs]

Each model's table is kept in ``--cache`` (one JSON per model, written atomically) under a fingerprint of the
model (every weight, the config and the default task: ``phaselens.runtime.fingerprints.model_fingerprint``) and the
settings: an interrupted run resumes, and a retrained or edited model recomputes only its own table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import phaselens  # noqa: E402
from phaselens.models.zoo import list_models  # noqa: E402
from phaselens.runtime.checkpoints import ResultCache  # noqa: E402
from phaselens.runtime.files import atomic_write_text  # noqa: E402
from phaselens.runtime.fingerprints import fingerprint, model_fingerprint  # noqa: E402
from phaselens.train.recipes import COMPARE_STRIDE, RECIPES  # noqa: E402


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def cache_fingerprint(model: Any, name: str, args: argparse.Namespace) -> str:
    """Everything that sets the numbers of one model's table: the model itself and the script's settings."""
    return fingerprint(model=model_fingerprint(model), name=name, n=args.n_per_residue,
                       n_large=args.n_per_residue_large_stride, seed=args.seed, compare_stride=COMPARE_STRIDE,
                       table="repair_table/1")


def model_section(name: str, model: Any, args: argparse.Namespace) -> dict:
    """Measure one model's repair table: its markdown section, its verdict line and the seconds taken."""
    control = RECIPES[name].config.compression is None
    t = time.time()
    stride = COMPARE_STRIDE if control else model.analysis_spec.stride
    n = args.n_per_residue if stride == 4 else args.n_per_residue_large_stride
    table = phaselens.repair_table(model, n_per_residue=n, seed=args.seed, progress=False,
                                   stride=COMPARE_STRIDE if control else None, batch_size=256)
    secs = time.time() - t
    rows = ["| shifts | rule | cost | mean | worst (phase) | boundary | folded gap [95% CI] | any copy right | p (chi2) | period |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.rows.itertuples():
        rows.append(f"| {r.shifts} | {r.combine} | {r.cost}x | {pct(r.mean)} | {pct(r.worst)} ({r.worst_phase}) | "
                    f"{pct(r.boundary)} | {pct(r.gap)} [{pct(r.gap_ci_low)}, {pct(r.gap_ci_high)}] | "
                    f"{pct(r.any_copy_right)} | {r.p_chi2:.2g} | {r.period} |")
    base = table.rows.iloc[0]
    alls = table.rows[(table.rows["shifts"] == "all") & (table.rows["combine"] == "max_conf")].iloc[0]
    if control:
        verdict = (f"- `{name}` (control): mean {pct(base['mean'])}% -> {pct(alls['mean'])}% with "
                   f"shifts=all/max_conf (change {100 * (alls['mean'] - base['mean']):+.2f} pp).")
    else:
        flat = alls["p_chi2"] >= 0.05
        third = alls["gap_ci_high"] < base["gap"] / 3
        verdict = (f"- `{name}` (S={table.stride}): unrepaired gap {pct(base['gap'])} pp; shifts=all/max_conf "
                   f"gap {pct(alls['gap'])} pp, upper 95% bound {pct(alls['gap_ci_high'])} pp "
                   f"({'below' if third else 'NOT below'} a third of the unrepaired gap); residual phase "
                   f"dependence p = {alls['p_chi2']:.2g} ({'none significant' if flat else 'still significant'}); "
                   f"mean {pct(base['mean'])} -> {pct(alls['mean'])}%.")
    section = (f"### `{name}`\n{table.rows.shape[0]} rows, {n} items per residue, {secs:.0f} s.\n\n"
               + "\n".join(rows))
    return {"section": section, "verdict": verdict, "seconds": secs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-per-residue", type=int, default=1000, help="items per residue for S = 4 models")
    ap.add_argument("--n-per-residue-large-stride", type=int, default=400,
                    help="items per residue for S = 6, 8 (their S shifted copies cost S forwards per item)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--cache", default=str(ROOT / "runs" / "repair_docs"))
    args = ap.parse_args()
    cache = ResultCache(args.cache)
    sections, verdicts, total = [], [], 0.0
    for name in [n for n in RECIPES if n in list_models()]:
        model = phaselens.load(f"zoo:{name}")
        fp = cache_fingerprint(model, name, args)
        done = cache.get(name, fp)
        if done is None:
            done = model_section(name, model, args)
            cache.put(name, fp, done)
            print(f"{name}: {done['seconds']:.0f} s", flush=True)
        sections.append(done["section"])
        verdicts.append(done["verdict"])
        total += done["seconds"]
    text = f"""# Phase repair

*Generated by `scripts/gen_repair_docs.py --n-per-residue {args.n_per_residue} --n-per-residue-large-stride
{args.n_per_residue_large_stride}` ({total:.0f} s in all); do not edit by hand.*

`phaselens.phase_ensemble(model, shifts, combine)` runs shifted copies of every input: copy k inserts k
single-token pads right after BOS, which moves the needle from phase p to (p + k) mod S without changing
content (it also moves the query and the distractors). The copies run in one batched forward and their
answers are combined:

- `max_conf`: the copy whose top answer is most probable;
- `vote`: the majority of the copies' top answers (ties by mean probability);
- `mean_logprob` / `mean_prob`: the average of the copies' log-probabilities / probabilities.

`shifts="all"` covers every phase (S x the forward cost), `"opposite"` uses {{0, S/2}} (2x). "Any copy right"
is the share of items that at least one copy answers correctly: an upper bound for any combining rule.
The battery runs on the repaired counts (`p (chi2)`, detected `period`). Items: the zoo task, residues mod
24, the same items for every row of a table. The control is folded by S = {COMPARE_STRIDE}.

## Verdicts
{chr(10).join(verdicts)}

## Tables
{chr(10).join(sections)}

## Use
```python
fixed = phaselens.phase_ensemble(phaselens.load("zoo:w4s4"), shifts="all", combine="max_conf")
phaselens.evaluate(fixed)                       # evaluate, ablate and the report accept the wrapper unchanged
phaselens.repair_table(phaselens.load("zoo:w4s4"), n_per_residue=256)
```
On DeepSeek-V4 through the adapter the API is the same; pads go after BOS so the phase origin (slot 0)
stays put. Choose a pad unit that encodes to exactly one token in context (`pad_unit=" .", tokenizer=tok`;
a unit that is not one token raises `PaddingError`), and mind the context: inputs may be at most
`n_ctx - max(shifts)` tokens (`ContextLengthError` names the limit).
"""
    atomic_write_text(ROOT / "docs" / "repair.md", text)
    print("wrote docs/repair.md")


if __name__ == "__main__":
    main()
