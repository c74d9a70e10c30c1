"""Generate docs/zoo.md from the shipped cards (``make zoo`` runs it after training).

    .venv/bin/python scripts/gen_zoo_docs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from phaselens.stats import holm  # noqa: E402
from phaselens.zoo import entry, list_models  # noqa: E402
from phaselens.zoo.recipes import (  # noqa: E402
    COMPARE_STRIDE,
    CONTROL_WARMUP,
    EVAL_PER_RESIDUE,
    RECIPES,
    WARMUP_DATA,
    ZOO_EVAL_TASK,
    ZOO_SETTINGS,
    ZOO_TASK,
)

# The control's previous recipe (zoo task only, 6,000 steps), as its card recorded it before the warm-up
# (`git show e27aad1:phaselens/zoo/full/card.json`).
OLD_CONTROL = ("6,000 steps on the zoo task alone: mean 8.3%, flat (G p = 0.74), i.e. chance among 12 values; "
               "card at commit e27aad1")
LLAMA = ROOT / "docs" / "data" / "control_vs_llama.json"  # written by scripts/control_vs_llama.py


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


def main() -> None:
    import json

    llama = json.loads(LLAMA.read_text())
    names = [n for n in RECIPES if n in list_models()]
    cards = {n: entry(n).card for n in names}
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

*This page is generated by `scripts/gen_zoo_docs.py` from the models' cards; do not edit it by hand.*

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
  deterministic per seed (`w4s4-seed1` changes both the initial weights and the data). The full-attention
  control first warms up for {CONTROL_WARMUP:,} steps on `{WARMUP_DATA!r}` (generic induction data), then
  trains the same {ZOO_SETTINGS.steps:,} steps on the zoo task; see "The control" below.
- Evaluation (the cards, and every model's `default_task`): `{ZOO_EVAL_TASK!r}` ({ZOO_EVAL_TASK.seq_len()}
  tokens): the same 12 records in one rigid block with 40 filler tokens among them, shifted as a whole
  (the paper's prefix padding), so the records' relative placement is the same at every residue. One
  setting for every model, chosen for difficulty only (below). {EVAL_PER_RESIDUE} items per residue ({EVAL_PER_RESIDUE * ZOO_EVAL_TASK.modulus:,} per model), seed 1, the
  full phaselens battery. The control is folded by S = {COMPARE_STRIDE}.

## Choosing the evaluation difficulty
Mean accuracy (%) of each model on the layouts considered ({48} items per residue, seed 11; generated with
this page). The training layout saturates `w8s4`; packing the records more tightly pushes the weakest models
(mean pooling, S = 8) below 40%. The last column is the one setting used for every card.

{layouts_table(names)}

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

## The control
A full-attention model must learn a two-layer induction circuit to retrieve a value: a previous-token head
that writes each key into its value's position, and a head at the query that matches it. A compressed
model needs one hop, because an entry pools a key with its value. With answer-only supervision (five
positions per sequence) the control sat on the "copy some value from the context" plateau: its previous
recipe ({OLD_CONTROL}). `scripts/control_vs_llama.py` showed that a transformers `LlamaForCausalLM` of the
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
not met for it (`tests/test_zoo.py` asserts that range for the compressed models only). Two things keep
its flatness informative. The folded-gap bound is an equivalence margin: the gap's upper 95% bound is
{pct(cards['full']['battery']['gap_ci'][1])} pp, against gaps of {pct(min(cards[n]['battery']['gap'] for n in names if n != 'full'))}-{pct(max(cards[n]['battery']['gap'] for n in names if n != 'full'))} pp in the compressed models. And the
continuous metric has no ceiling: the answer's NLL by phase is flat for the control (Kruskal-Wallis
p = {pval(cards['full']['battery']['nll_kruskal_p'])}; phase means {', '.join(f'{x:.3f}' for x in cards['full']['battery']['nll_by_phase'])}) and strongly
phase-dependent in every compressed model (largest p = {pval(max(cards[n]['battery']['nll_kruskal_p'] for n in names if n != 'full'))}). Stopping the control
early could have put its accuracy inside the range; we ship it trained on the same schedule as the others
rather than choosing a step to hit a number.

## Reproduce
```bash
make zoo                                    # retrain every model from scratch (about 2 x 15 minutes per pair on 2 cores)
.venv/bin/python scripts/train_zoo.py w8s4  # or one model
.venv/bin/phaselens zoo list                # the cards' headline numbers
.venv/bin/python scripts/gen_zoo_docs.py    # this page
```
Each card (`phaselens/zoo/NAME/card.json`) holds the training settings and loss curve, the task spec (the
loaded model's `default_task`), the per-residue counts, the battery and the sha256 of the weights;
`eval_batch.safetensors` is a small fixed batch whose per-item correctness the card records, so the card
can be re-checked even if the task generator changes (`tests/test_zoo.py` does).

## What is bit-reproducible, and how many runs each number is
- **Each model is one training run** (one seed) and each card number is one evaluation of it (1000 items
  per residue, seed 1). `w4s4-seed1` is a second run of the `w4s4` recipe with another seed (weights and
  data): the spread between `w4s4` and `w4s4-seed1` above is the only seed-to-seed comparison shipped.
- **Bit-identical** (every weight and loss equal): a rerun or an interrupted-and-resumed run with the same
  code, the same torch build and the same thread count on the same kind of CPU. Training draws every batch
  from `(seed, step)` and saves the optimiser state, so a run killed at any step resumes bit-identically
  (`tests/test_train.py` kills one with SIGKILL and compares).
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
