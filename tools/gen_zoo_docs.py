"""Generate docs/zoo.md from the shipped cards (``make zoo`` runs it after training).

    .venv/bin/python -m tools.gen_zoo_docs
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from phaselens.models.zoo import entry, list_models
from phaselens.stats import holm
from phaselens.train.zoo_recipes import (
    COMPARE_STRIDE,
    CONTROL_WARMUP,
    EVAL_PER_RESIDUE,
    RECIPES,
    SEED_SUFFIX,
    WARMUP_DATA,
    ZOO_EVAL_TASK,
    ZOO_SETTINGS,
    ZOO_TASK,
)

ROOT = Path(__file__).resolve().parents[1]

# The control's previous recipe (zoo task only, 6,000 steps), as its card recorded it before the warm-up
# (`git show e27aad1:phaselens/zoo/full/card.json`).
OLD_CONTROL = ("6,000 steps on the zoo task alone: mean 8.3%, flat (G p = 0.74), i.e. chance among 12 values; "
               "card at commit e27aad1")
LLAMA = ROOT / "docs" / "data" / "control_vs_llama.json"  # written by experiments/control_vs_llama.py
SEEDS = ROOT / "docs" / "data" / "seeds.json"  # written by tools/zoo_seeds.py
CYCLING = ROOT / "docs" / "data" / "gate_cycling.json"  # written by experiments/gate_cycling_zoo.py
COVERAGE = ROOT / "docs" / "data" / "cycling_ci_coverage.json"  # written by experiments/sim_cycling_ci.py


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


LAYOUTS_TRIED = [
    ("training layout", dict(n_records=12, block_filler=8, padding="in_sequence")),
    ("packed block", dict(n_records=12, block_filler=0, padding="prefix")),
    ("block, 12 filler", dict(n_records=12, block_filler=12, padding="prefix")),
    ("block, 40 filler", dict(n_records=12, block_filler=40, padding="prefix")),
    ("block, 40 filler, 2 cycles (chosen)", dict(n_records=12, block_filler=40, padding="prefix", n_cycles=2)),
]


def pval(p: float) -> str:
    return "< 1e-300" if p == 0 else f"{p:.2g}"


def train_time(card: dict) -> str:
    s = card["training"].get("seconds")
    return "n/a" if s is None else f"{s:.0f}"


def layouts_table(names: list[str], n_per_residue: int = 48) -> str:
    """Mean accuracy of every model on each evaluation layout considered (seed 11, fresh items)."""
    import phaselens
    from phaselens.tasks import KVRecall

    head = "| model | " + " | ".join(label for label, _ in LAYOUTS_TRIED) + " |"
    rows = [head, "|---|" + "---|" * len(LAYOUTS_TRIED)]
    for n in names:
        model = phaselens.load(f"zoo:{n}")
        stride = None if RECIPES[n].config.compression else COMPARE_STRIDE
        cells = []
        for _, kw in LAYOUTS_TRIED:
            ev = phaselens.evaluate(model, KVRecall(modulus=24, **kw), n_per_residue=n_per_residue, seed=11,
                                    progress=False, stride=stride, n_permutations=1, n_bootstrap=0, batch_size=256)
            cells.append(pct(ev.mean))
        rows.append(f"| `{n}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _phases(xs: list[int]) -> str:
    return ", ".join(map(str, xs)) if xs else "none"


def _spread(d: dict, scale: float = 100.0, digits: int = 1) -> str:
    sd = "" if d["sd"] is None else f" ± {scale * d['sd']:.{digits}f}"
    return f"{scale * d['mean']:.{digits}f}{sd} ({scale * d['min']:.{digits}f}-{scale * d['max']:.{digits}f})"


def seeds_section() -> str:
    """The "Seeds" section from docs/data/seeds.json."""
    if not SEEDS.exists():
        return "## Seeds\nRun `python -m tools.zoo_seeds` to write docs/data/seeds.json."
    data = json.loads(SEEDS.read_text())
    rows, per_seed, notes = [], [], []
    for base, c in data["configs"].items():
        S = c["stride"]
        period = ("no period in every seed" if c["no_period_in_every_seed"] else "a period in some seed") \
            if not c["compressed"] else ("yes" if c["period_equals_stride_in_every_seed"] else "**no**")
        weak = "; ".join(f"{k}: {_phases(r['weak_phases'])}" for k, r in c["seeds"].items())
        rows.append(f"| `{base}` | {S} | {c['n_seeds']} | {period} | {_spread(c['mean'])} | {_spread(c['gap'])} | "
                    f"{_spread(c['boundary'])} | {_spread(c['boundary_rank'], 1, 1)} | {weak} | "
                    f"{_phases(c['recurring_weak_phases'])} |")
        for k, r in c["seeds"].items():
            per = (r["period"] if r["period_status"] == "identified" else
                   f"none ({r['period_status']}{': ' + _phases(r['period_candidates']) if r['period_candidates'] else ''})")
            per_seed.append(f"| `{r['model']}` | {k} | {pct(r['mean'])} | {pct(r['gap'])} [{pct(r['gap_ci'][0])}, {pct(r['gap_ci'][1])}] | "
                            f"{pct(r['boundary'])} ({r['boundary_rank']} of {S}) | {per} | "
                            + " ".join(pct(a) for a in r["phase_accuracy"]) + f" | {_phases(r['weak_phases'])} |")
        if c["compressed"]:
            counts = c["weak_phase_count"]
            some = [int(p) for p, n in counts.items() if 0 < n < c["n_seeds"]]
            notes.append(
                f"- `{base}`: period {S} in {'every' if c['period_equals_stride_in_every_seed'] else 'not every'} seed; "
                f"the boundary phase {S - 1} is weak in {counts[str(S - 1)]} of {c['n_seeds']} seeds "
                f"(rank {', '.join(str(r['boundary_rank']) for r in c['seeds'].values())} from the worst); "
                f"weak in every seed: {_phases(c['recurring_weak_phases'])}; weak in some seeds only: {_phases(some)}; "
                f"mean {pct(c['mean']['min'])}-{pct(c['mean']['max'])}%, gap {pct(c['gap']['min'])}-{pct(c['gap']['max'])} pp."
            )
    shipped = "; ".join(f"`{b}`: seeds {', '.join(c['seeds'])}" for b, c in data["configs"].items())
    missing = [f"`{b}{SEED_SUFFIX}{k}`" for b in data["configs"] for k in (1, 2)
               if str(k) not in data["configs"][b]["seeds"]]
    absent = ""
    if missing:
        took = "; ".join(f"`{r['model']}` {entry(r['model']).card['training']['seconds']:,.0f} s"
                         for c in data["configs"].values() for k, r in c["seeds"].items()
                         if k != "0" and not c["compressed"])
        absent = (f" Not shipped: {', '.join(missing)}, so that row has fewer seeds. Training the control is the "
                  f"slowest ({took} on one CPU thread by its card). `full-seed2` was trained once here "
                  "(`python -m tools.train_zoo full --seed 2`: 3,000 steps, 1,236 s): its training loss ended at "
                  "0.00037 like the shipped controls' (0.00016-0.00019), yet its card's evaluation gave a mean of "
                  "26.8% (gap 1.4 pp, no period), against 99.5% for seeds 0 and 1. It solves the training layout "
                  "(100% on 8 items per residue of `ZOO_TASK`) but not the evaluation layout (22.4% on "
                  "`ZOO_EVAL_TASK`: the 12 records in one block with 40 filler tokens, prefix padding): this seed "
                  "of the control did not generalise from the training layout, which seeds 0 and 1 did. As a "
                  "control it would compare nothing, so it is not shipped.")
    return f"""## Seeds
Shipped seeds (0 is the base model): {shipped}.{absent}

The paper found the boundary phase weak in every run and the other weak phases seed-specific, and retraining
`w4s4` here moved its mean and gap by several points. So every configuration above was trained with more seeds:
seed 0 is the model above, seed K is `NAME-seedK` (other initial weights and other training data, the same
recipe; `python -m tools.train_zoo NAME --seed K`), each shipped with its card and evaluated exactly as the cards
(1,000 items per residue, seed 1). Numbers from `docs/data/seeds.json` (`{data['command']}`): phases fold the 24
residues mod S (the control by S = {COMPARE_STRIDE}); the gap is the folded max - min (per seed with its 95% interval,
`gap_ci`); *boundary rank* is the boundary phase's place counted from the worst (1 = the worst phase); the period
is `detect_period` on the 24 residue counts (closed testing over the divisors of 24; a period counts only when the
detector identifies it, and "none" gives its status and the periods it could not tell apart); a phase is *weak*
when it lies at least {data['weak_rule_pp']:.0f} pp below the model's best phase. Spreads are mean ± SD across seeds
(min-max).

| config | S | seeds | period = S in every seed | mean % | gap pp | boundary % | boundary rank | weak phases by seed | weak in every seed |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{chr(10).join(notes)}

Per seed (accuracy by phase in %, phase 0 first):

| model | seed | mean % | gap pp [95% CI] | boundary % (rank) | period | accuracy by phase | weak phases |
|---|---|---|---|---|---|---|---|
{chr(10).join(per_seed)}"""


def _by_config(name: str) -> tuple[int, int]:
    """Sort key: a model's base recipe in recipe order, then its seed (seed replicates beside their base)."""
    base, sep, seed = name.rpartition(SEED_SUFFIX)
    base, seed = (base, int(seed)) if sep and seed.isdigit() else (name, 0)
    return list(RECIPES).index(base), seed


def _ci(x: float, ci: list[float]) -> str:
    return f"{x:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def cycling_section() -> str:
    """The "Gate cycling" section from docs/data/gate_cycling.json and docs/data/cycling_ci_coverage.json."""
    if not CYCLING.exists():
        return "## Gate cycling\nRun `python -m experiments.gate_cycling_zoo` to write docs/data/gate_cycling.json."
    data = json.loads(CYCLING.read_text())
    rows = []
    for name, r in sorted(data["models"].items(), key=lambda kv: _by_config(kv[0])):
        comp = RECIPES[name].config.compression
        layout = f"W={comp.window}, S={comp.stride}" + (", overlap split" if comp.overlap_split else "")
        b = list(r["boundary"].values())
        rows.append(f"| `{name}` | {layout} | {_ci(r['r2'], r['r2_ci'])} | {_ci(r['r2_all'], r['r2_all_ci'])} | "
                    f"{pct(r['base'][-1])} | {pct(min(b))}-{pct(max(b))} |")
    ov = data["overlap_diagnosis"]
    w8, ex = data["models"]["w8s4"], data["w8s4_extras"]
    S = w8["stride"]

    def seam(name: str) -> dict:
        r, d = data["models"][name], ov[name]
        ca, cb = d["bias_mean_by_slot"]["layer0"][:S], d["bias_mean_by_slot"]["layer0"][S:]
        cyc = {int(k): v for k, v in r["observed"].items()}
        return {"ca": ca, "cb": cb, "base": r["base"], "deph": d["dephased"], "cyc": cyc,
                "bnd": [cyc[k][S - 1] for k in cyc], "moved": [cyc[k][(k - 1) % S] for k in cyc],
                "peak": ca[S - 1] == max(ca) and cb[0] == max(cb),
                "layer1": max(abs(x) for k, v in d["bias_mean_by_slot"].items() if k != "layer0" for x in v)}

    seams = {n: seam(n) for n in sorted(ov, key=_by_config)}
    z = seams["w8s4"]
    ca0, cb0, base, deph, cyc, bnd, moved = z["ca"], z["cb"], z["base"], z["deph"], z["cyc"], z["bnd"], z["moved"]
    rope = {int(k): v for k, v in ex["cycled_with_rope_anchor_shift"].items()}
    rope_diff = max(abs(a - b) for k in rope for a, b in zip(rope[k], cyc[k]))
    pl = ex["planted"]
    pl_obs = {int(k): v for k, v in pl["observed"].items()}
    dips = {k: [p for p, a in enumerate(v) if a < 0.15] for k, v in pl_obs.items()}
    planted_dips = [p for p, a in enumerate(pl["base"]) if a < 0.15]
    # Every seed: does the gate repair the boundary (de-phased boundary below the unmodified one), and does
    # cycling take the repair away (boundary and phase delta - 1 below the unmodified boundary)?
    repairs = {n: z2["deph"][S - 1] < z2["base"][S - 1] - 0.1 and max(z2["bnd"]) < z2["base"][S - 1]
               and max(z2["moved"]) < z2["base"][S - 1] for n, z2 in seams.items()}
    seed_rows = [
        f"| `{n}` | {' '.join(f'{x:+.2f}' for x in z2['ca'])} &#124; {' '.join(f'{x:+.2f}' for x in z2['cb'])} | "
        f"{' '.join(pct(a) for a in z2['base'])} | {' '.join(pct(a) for a in z2['deph'])} | "
        f"{pct(z2['base'][S - 1] - z2['deph'][S - 1])} | "
        f"{pct(min(z2['bnd']))}-{pct(max(z2['bnd']))} | {pct(min(z2['moved']))}-{pct(max(z2['moved']))} | "
        f"{_ci(data['models'][n]['r2'], data['models'][n]['r2_ci'])} |" for n, z2 in seams.items()]
    # The prose below states these facts; regenerate the text by hand if a retrained w8s4 breaks one.
    facts = {
        "the learned biases peak at the seam": z["peak"],
        "without them the boundary is the weak phase": deph[S - 1] == min(deph) and deph[S - 1] < base[S - 1] - 0.3,
        "cycling drops the boundary for every delta": max(bnd) < base[S - 1] - 0.3,
        "the planted dips move with delta": planted_dips == [0, 1]
        and all(dips[k] == sorted({k % S, (k + 1) % S}) for k in dips),
    }
    bad = [k for k, v in facts.items() if not v]
    if bad:
        raise SystemExit(f"docs/zoo.md's gate-cycling prose no longer matches the data: {bad}")
    every = [n for n in seams if seams[n]["peak"] and repairs[n]]
    others = [n for n in seams if n not in every]
    seeds_text = (f"The same holds in {'every `w8s4` seed' if not others else 'these `w8s4` seeds'} "
                  f"({', '.join(f'`{n}`' for n in every)}): layer 0's bias peaks at the seam, removing the "
                  "phase-specific biases lowers the boundary, and cycling lowers both the boundary and phase "
                  "delta - 1 below the unmodified boundary" + (f"; not in {', '.join(f'`{n}`' for n in others)}"
                                                                if others else "") + ".")
    repair = {n: z2["base"][S - 1] - z2["deph"][S - 1] for n, z2 in seams.items()}
    by_repair = sorted(seams, key=lambda n: repair[n])
    r2s = [data["models"][n]["r2"] for n in by_repair]
    if len(seams) > 1 and all(a > b for a, b in zip(r2s, r2s[1:])):
        seeds_text += (" How far R^2 falls follows how much the gates repair the boundary (its accuracy with the "
                       "learned biases minus without them): " + ", ".join(
                           f"`{n}` {pct(repair[n])} pp, R^2 {data['models'][n]['r2']:.2f}" for n in by_repair)
                       + ". The more of the profile is a repair tied to the seam, the less of it a gate roll can move.")
    cov = ""
    if COVERAGE.exists():
        cv = json.loads(COVERAGE.read_text())
        crow = [f"| {r['scenario']} | {r['n_per_residue']} | {r['true_r2']:.2f} | {r['mean_estimate']:.2f} | "
                f"{100 * r['coverage_basic']:.1f} | {100 * r['coverage_percentile']:.1f} | {r['mean_width_basic']:.2f} |"
                for r in cv["rows"]]
        reps = cv["rows"][0]["reps"]
        low = min(cv["rows"], key=lambda r: r["coverage_basic"])
        cov = f"""
### How far the interval can be trusted
Coverage of the 95% interval of R^2 (boundary excluded), by simulation (`{cv['command']}`,
`docs/data/cycling_ci_coverage.json`): {cv['residues']} residues, S = {cv['stride']}, deltas {cv['deltas']}, every
item answered by the unmodified model and each cycled copy, item difficulty varying with SD {cv['item_sd_logit']}
logits shared across models; {reps} simulated experiments per row, {cv['rows'][0]['n_bootstrap']} replicates each
(Monte-Carlo SE of a coverage near 95%: {100 * (0.95 * 0.05 / reps) ** 0.5:.1f} points). The profiles are the ones
measured on `w4s4` and `w8s4` and a made-up profile that follows the prediction up to a few points. R^2 is biased
low (noise in the observed and the predicted profile adds to the residuals): the percentile interval, which
inherits that bias twice, misses a true R^2 near 1; the basic interval does not. Its lowest coverage,
{100 * low['coverage_basic']:.1f}%, is for the {low['scenario']} profile at {low['n_per_residue']} items per residue;
at the {data['settings']['n_per_residue']} items per residue used above it is
{', '.join(f"{100 * r['coverage_basic']:.1f}%" for r in cv['rows'] if r['n_per_residue'] == data['settings']['n_per_residue'])}.

| true profile | items per residue | true R^2 | mean estimate | basic % | percentile % | basic width |
|---|---|---|---|---|---|---|
{chr(10).join(crow)}
"""
    return f"""## Gate cycling
`phaselens.gate_cycling_test` rolls every offset-specific gate parameter (per-offset gate maps and the
position bias) by delta and compares the accuracy by phase A_delta(p) with the prediction A_0((p - delta) mod S):
R^2 against the identity line, pooled over the shifts delta = 1..S-1 (each once), without and with the boundary
phase. Settings: the zoo's evaluation task, {data['settings']['n_per_residue']} items per residue, seed 0
(`{data['command']}`, `docs/data/gate_cycling.json`). The 95% intervals are basic bootstrap intervals over
items: items are resampled with replacement inside their residue, and one resample serves the unmodified model
and every cycled copy, which answer the same items; {data['settings']['n_bootstrap']:,} replicates. The paper
reports R^2 0.94-0.97 without the boundary for its W12/S12 runs. Not cycled, having no offset-specific gate
parameters: {', '.join(f'`{n}`' for n in sorted(set(list_models()) - set(data['models']), key=_by_config))}.

| model | layout | R^2 without boundary [95% CI] | R^2 with boundary [95% CI] | boundary % unmodified | boundary % cycled (range over delta) |
|---|---|---|---|---|---|
{chr(10).join(rows)}

### The overlap layout, and why `w8s4` does not follow the prediction
In DeepSeek's overlap split (W = 2S) a token of phase p sits in two entries: slot p of the Ca half of the next
entry and slot p of the Cb half of its own. `cycle_gates` rolls the S bias rows of each half within that half,
so after a roll by delta phase p carries, in both of its slots, the parameters that phase p - delta had, and the
Ca and Cb channel groups never exchange parameters; it is the only roll periodic in delta mod S (a roll of the
2S slots as one sequence would move Ca rows into Cb slots, and delta = S would swap the halves). The entry's RoPE
position (slot jS, the first token of its own block) is not a gate parameter and stays.

A planted model checks the operation (`tests/analyses/test_cycling.py`): `w8s4` with every phase-specific gate parameter
removed (each half's bias replaced by its mean over phases) and tokens of phase 1 given a gate bias of -8 in
both halves of layer 0. Its weak phases, {_phases(planted_dips)}
(accuracy {' '.join(pct(a) for a in pl['base'])}), move with delta exactly: cycled by 1, 2, 3 the phases below 15%
are {'; '.join(_phases(dips[k]) for k in sorted(dips))}. Its R^2 is {_ci(pl['r2'], pl['r2_ci'])} without the boundary; what
keeps it from 1 is the structural weakness of the boundary phase, which no gate roll moves.

`w8s4` is different because its gates do not make weak phases; they repair one. Layer 0's position bias,
averaged over channels, by window slot (Ca slots 0-{S - 1}, then Cb slots 0-{S - 1}):
{' '.join(f'{x:+.2f}' for x in ca0)} | {' '.join(f'{x:+.2f}' for x in cb0)}. It peaks at the seam, on the
last token of the previous block and the first of the entry's own block (layer 1's biases are below
{z['layer1']:.2f}). A record whose key is the boundary token (phase
{S - 1}) has its value in the next block, so the two share only the entry that spans that seam, and the seam is
where the gate looks. With the phase-specific biases removed the profile is {' '.join(pct(a) for a in deph)}:
the boundary is the weak phase, as in every W = S model; with them it is {' '.join(pct(a) for a in base)}.
Cycling moves the repair away from the structure it repairs. For every delta the boundary falls back to
{pct(min(bnd))}-{pct(max(bnd))}% (near its level without phase-specific biases), and phase delta - 1, which
inherits the boundary's biases, drops to {pct(min(moved))}-{pct(max(moved))}%, although the prediction gives it
the unmodified boundary's {pct(base[S - 1])}%. The prediction errors are larger than the spread of the observed
accuracies themselves, hence R^2 below zero (the report's -3.16 is the same measurement at 48 items per residue,
with each shift counted twice). Moving the entry's RoPE position along with the gates (rotating at jS + delta) changes no
phase by more than {100 * rope_diff:.1f} points, so the RoPE position is not what breaks. The operation is right;
the model's phase profile is not gate-driven in the sense the prediction assumes: its gates compensate a
structural weakness of the block grid, and a compensation cannot be moved without the structure.

{seeds_text} By seed (layer-0 bias by slot, Ca then Cb; accuracy by phase in %, phase 0 first; 64 items per
residue):

| model | layer-0 bias by slot | unmodified | without phase-specific biases | repair of the boundary (pp) | boundary, cycled | phase delta - 1, cycled | R^2 [95% CI] |
|---|---|---|---|---|---|---|---|
{chr(10).join(seed_rows)}
{cov}"""


def main() -> None:
    llama = json.loads(LLAMA.read_text())
    names = sorted((n for n in RECIPES if n in list_models()), key=_by_config)
    cards = {n: entry(n).card for n in names}
    compressed = [n for n in names if RECIPES[n].config.compression is not None]
    p = np.array([cards[n]["battery"]["p_g"] for n in names])
    p_holm = dict(zip(names, holm(p)))
    rows, checks = [], []
    for n in names:
        b, c = cards[n]["battery"], cards[n]
        stride = RECIPES[n].config.compression.stride if RECIPES[n].config.compression else None
        rows.append(
            f"| `{n}` | {c['description']} | {pct(b['mean'])} | {pct(b['worst'])} (phase {b['worst_phase']}) | "
            f"{pct(b['boundary'])} | {pct(b['gap'])} [{pct(b['gap_ci'][0])}, {pct(b['gap_ci'][1])}] | "
            f"{b['period']} | {pval(b['p_g'])} | {pval(p_holm[n])} | {b['p_nested']:.2g} | {b['harmonic_fraction']:.3f} | "
            f"{pval(b['nll_kruskal_p'])} | "
            f"{train_time(c)} |"
        )
        ok_range = 0.40 <= b["mean"] <= 0.95
        if stride is None:
            flat = p_holm[n] >= 0.01 and b["gap_ci"][1] < 0.03
            checks.append(f"- `{n}` (control, folded by S={COMPARE_STRIDE}): no significant phase dependence "
                          f"(Holm p = {p_holm[n]:.2g}) and the upper 95% bound of its folded gap "
                          f"{pct(b['gap_ci'][1])} pp {'<' if b['gap_ci'][1] < 0.03 else '>='} 3 pp: "
                          f"**{'holds' if flat else 'does not hold'}**; mean {pct(b['mean'])}% "
                          f"{'inside' if ok_range else 'OUTSIDE'} 40-95%.")
        else:
            sig = p_holm[n] < 0.01
            per = b["period"] == stride
            checks.append(f"- `{n}`: phase dependence significant after Holm (p {pval(p_holm[n]) if p_holm[n] == 0 else '= ' + pval(p_holm[n])}): "
                          f"**{'yes' if sig else 'no'}**; detected period {b['period']} against stride {stride}: "
                          f"**{'matches' if per else 'does not match'}**; mean {pct(b['mean'])}% "
                          f"{'inside' if ok_range else 'OUTSIDE'} 40-95%.")
    with_code = [n for n in names if (cards[n].get("code") or {}).get("commit")]
    provenance = ("each records its commit (" + ", ".join(f"`{n}` {cards[n]['code']['commit'][:10]}" for n in with_code)
                  + ")" if len(with_code) == len(names) else
                  f"{len(names) - len(with_code)} of {len(names)} were written before cards recorded the code "
                  "commit, so theirs is unknown" + (f" (with a commit: {', '.join(with_code)})" if with_code else ""))
    text = f"""# The zoo

Tiny models trained here on CPU and shipped inside the package (`phaselens.load("zoo:NAME")`), with a
full-attention control of identical dimensions. They are the embedded default for the report, the
notebooks and most tests, and a small-scale replication of the paper's controlled experiments.

*This page is generated by `tools/gen_zoo_docs.py` from the models' cards; do not edit it by hand.*

## Setting (one for the whole zoo)
- Model: 2 layers, d_model 64, 4 heads (4 KV heads) of 16, MLP 256, local window 8 raw tokens, a learned
  sink, {sum(p.numel() for p in __import__('phaselens').load('zoo:' + names[0]).parameters()):,} parameters
  (`{names[0]}`).
- Training task: `{ZOO_TASK!r}` ({ZOO_TASK.seq_len()} tokens): 12 key-value records spread through filler
  (in-sequence padding), demonstrations, then the query. The target's value lies at least
  {ZOO_TASK.min_distance} slots before the query, beyond the local window, so compressed models reach it
  only through entries. Residues mod {ZOO_TASK.modulus} cover strides 4, 6 and 8.
- Training: {ZOO_SETTINGS.steps} AdamW steps, batch {ZOO_SETTINGS.batch_size}, lr {ZOO_SETTINGS.lr}
  (warm-up {ZOO_SETTINGS.warmup}, cosine to 10%), weight decay {ZOO_SETTINGS.weight_decay}, one thread,
  deterministic per seed (`NAME-seedK`, e.g. `w4s4-seed1`, changes both the initial weights and the data;
  `python -m tools.train_zoo w4s4 --seed 2` trains `w4s4-seed2`; see "Seeds"). The full-attention
  control first warms up for {CONTROL_WARMUP:,} steps on `{WARMUP_DATA!r}` (generic induction data), then
  trains the same {ZOO_SETTINGS.steps:,} steps on the zoo task; see "The control" below.
- Evaluation (the cards, and every model's `default_task`): `{ZOO_EVAL_TASK!r}` ({ZOO_EVAL_TASK.seq_len()}
  tokens): the same 12 records in one rigid block with 40 filler tokens among them, shifted as a whole
  (the paper's prefix padding), so the records' relative placement is the same at every residue. One
  setting for every model, chosen for difficulty only (below). {EVAL_PER_RESIDUE} items per residue ({EVAL_PER_RESIDUE * ZOO_EVAL_TASK.modulus:,} per model), seed 1, the
  full phaselens battery. The control is folded by S = {COMPARE_STRIDE}.

## Choosing the evaluation difficulty
Mean accuracy (%) of each model on the layouts considered ({48} items per residue, seed 11; generated with
this page; seed replicates are under "Seeds"). The training layout saturates `w8s4`; packing the records more tightly pushes the weakest models
(mean pooling, S = 8) below 40%. The last column is the one setting used for every card.

{layouts_table([n for n in names if SEED_SUFFIX not in n])}

## Results
Accuracies in %, gaps in percentage points (folded over phases, 95% item-bootstrap CI). `p (G)` is the
omnibus G test on the 2 x 24 table; `Holm` adjusts it across the zoo; `nested` tests mod 24 against mod S
(a large p means nothing beyond period S); `harmonic` is the share of non-DC DFT power at period S;
`NLL p` is the Kruskal-Wallis test of the answer's NLL across phases (a continuous metric, no ceiling).

| model | what it is | mean | worst | boundary | folded gap [95% CI] | period | p (G) | Holm | nested p | harmonic | NLL p | train s |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

## What the zoo shows (checked against the issue's claims)
{chr(10).join(checks)}

{seeds_section()}

{cycling_section()}

## The control
A full-attention model must learn a two-layer induction circuit to retrieve a value: a previous-token head
that writes each key into its value's position, and a head at the query that matches it. A compressed
model needs one hop, because an entry pools a key with its value. With answer-only supervision (five
positions per sequence) the control sat on the "copy some value from the context" plateau: its previous
recipe ({OLD_CONTROL}). `experiments/control_vs_llama.py` showed that a transformers `LlamaForCausalLM` of the
same size learns the task equally slowly (mean loss over steps {(llama['steps'] - 50)}-{llama['steps']} on a 4-record version: ours
{llama['phaselens_full_loss_every_50'][-1]}, Llama {llama['llama_loss_every_50'][-1]}; copying a random context value scores
{llama['copy_a_context_value_loss']}; `docs/data/control_vs_llama.json`), so the plateau is the task at this size, not
our implementation.

The control now warms up on `RepeatedSegments` (`phaselens/tasks/induction.py`): random tokens in which
a 24-token segment recurs at a random distance, every token of the repeat trained. Because the distance
varies, only a content-based induction head solves it (in an exploratory run, not shipped, a fixed repeat
distance let the model learn a positional shortcut instead, which did not transfer to the zoo task). The circuit forms within the warm-up, and the zoo task then
trains in the same {ZOO_SETTINGS.steps:,} steps as the compressed models. Its headline: mean
{pct(cards['full']['battery']['mean'])}% ({'inside' if 0.40 <= cards['full']['battery']['mean'] <= 0.95 else 'OUTSIDE'} 40-95%), folded gap
{pct(cards['full']['battery']['gap'])} pp with upper 95% bound {pct(cards['full']['battery']['gap_ci'][1])} pp, G p = {pval(cards['full']['battery']['p_g'])}.
It is the only model with a warm-up; the compressed models never needed one, and the evaluation setting is
the same for all.

The control is near ceiling, so its accuracy counts have little room to move and the 40-95% criterion is
not met for it (`tests/models/test_zoo.py` asserts that range for the compressed models only). Two things keep
its flatness informative. The folded-gap bound is an equivalence margin: the gap's upper 95% bound is
{pct(cards['full']['battery']['gap_ci'][1])} pp, against gaps of {pct(min(cards[n]['battery']['gap'] for n in compressed))}-{pct(max(cards[n]['battery']['gap'] for n in compressed))} pp in the compressed models. And the
continuous metric has no ceiling: the answer's NLL by phase is flat for the control (Kruskal-Wallis
p = {pval(cards['full']['battery']['nll_kruskal_p'])}; phase means {', '.join(f'{x:.3f}' for x in cards['full']['battery']['nll_by_phase'])}) and strongly
phase-dependent in every compressed model (largest p = {pval(max(cards[n]['battery']['nll_kruskal_p'] for n in compressed))}). Stopping the control
early could have put its accuracy inside the range; we ship it trained on the same schedule as the others
rather than choosing a step to hit a number.

## Reproduce
```bash
make zoo                                    # retrain every model from scratch (about 2 x 15 minutes per pair on 2 cores)
.venv/bin/python -m tools.train_zoo w8s4  # or one model
.venv/bin/python -m tools.train_zoo w8s4 --seed 3   # another seed of a recipe (w8s4-seed3)
.venv/bin/python -m tools.zoo_seeds       # docs/data/seeds.json ("Seeds")
.venv/bin/python -m experiments.gate_cycling_zoo   # docs/data/gate_cycling.json ("Gate cycling"; about an hour)
.venv/bin/python -m experiments.sim_cycling_ci  # docs/data/cycling_ci_coverage.json (the interval's coverage)
.venv/bin/phaselens zoo list                # the cards' headline numbers
.venv/bin/python -m tools.gen_zoo_docs    # this page
```
Each card (`phaselens/zoo/NAME/card.json`) holds the training settings and loss curve, the task spec (the
loaded model's `default_task`), the per-residue counts, the battery and the sha256 of the weights;
`eval_batch.safetensors` is a small fixed batch whose per-item correctness the card records, so the card
can be re-checked even if the task generator changes (`tests/models/test_zoo.py` does).

## What is bit-reproducible, and how many runs each number is
- **Each model is one training run** (one seed) and each card number is one evaluation of it (1000 items
  per residue, seed 1). `w4s4-seed1` is a second run of the `w4s4` recipe with another seed (weights and
  data): the spread between `w4s4` and `w4s4-seed1` above is the only seed-to-seed comparison shipped.
- **Bit-identical** (every weight and loss equal): a rerun or an interrupted-and-resumed run with the same
  code, the same torch build and the same thread count on the same kind of CPU. Training draws every batch
  from `(seed, step)` and saves the optimiser state, so a run killed at any step resumes bit-identically
  (`tests/train/test_loop.py` kills one with SIGKILL and compares).
- **Not bit-identical**: another torch version, thread count or CPU (float sums are reduced in another
  order, or by other vector kernels) or another commit of the code. The losses then differ in the last
  digits at first; training amplifies such differences, above all around the phase transition where the
  models learn to read the entries, so a retrain elsewhere gives a model of the same kind whose card
  numbers (mean, gap) can differ by more than the cards' confidence intervals, which cover the evaluation
  items only, not training. Compare retrains with the seed-to-seed spread above, not with a card's CI.
- **What each card records** to tell them apart: `torch` (the build), `training.threads`, `machine`, and,
  for cards written since `code` was added, `code.commit` (the git commit that wrote the card; `dirty`
  when the tree had uncommitted changes) with `training.resumed_from` (the step this run started at: equal
  to `steps` when the weights came from an earlier run). Cards of the models shipped now: {provenance}.
"""
    (ROOT / "docs" / "zoo.md").write_text(text)
    print(f"wrote docs/zoo.md ({len(names)} models)")


if __name__ == "__main__":
    main()
