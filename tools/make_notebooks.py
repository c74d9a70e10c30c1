"""Write the notebooks in notebooks/ (outputs stripped). Edit here, then run this script.

    .venv/bin/python -m tools.make_notebooks

Each notebook reads its sizes from environment variables in its first cell, so the test suite runs it
small (tests/test_notebooks.py) and users run it full.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]

PARAMS = """import os
# Sizes: the tests set PHASELENS_NB_SMALL=1 to run this notebook quickly; unset, it runs at full size.
SMALL = os.environ.get("PHASELENS_NB_SMALL") == "1"
N = 8 if SMALL else 256          # items per residue
PROGRESS = os.environ.get("PHASELENS_NB_PROGRESS", "0" if SMALL else "1") == "1"  # progress bars"""

NOTEBOOKS = {
    "01_quickstart": [
        new_markdown_cell("# phaselens quickstart\n\nLoad a tiny compressed model from the embedded zoo, evaluate it "
                          "with the needle at every phase, and compare the folded accuracy curve with the "
                          "full-attention control."),
        new_code_cell(PARAMS),
        new_code_cell("import phaselens\nmodel = phaselens.load('zoo:w8s4')\ncontrol = phaselens.load('zoo:full')\nmodel"),
        new_code_cell("ev = phaselens.evaluate(model, n_per_residue=N, progress=PROGRESS)\nev"),
        new_code_cell("ev_control = phaselens.evaluate(control, n_per_residue=N, progress=PROGRESS, stride=4)\n"
                      "ev_control"),
        new_markdown_cell("One line per cycle of 4 residues: if the lines coincide, accuracy repeats with the "
                          "stride. The boundary phase (3) is shaded."),
        new_code_cell("fig = ev.plot(control=ev_control)\nfig"),
        new_code_cell("ev.per_phase()"),
        new_code_cell("assert ev.stride == 4 and len(ev.per_phase()) == 4"),
    ],
    "02_phase_specialization": [
        new_markdown_cell("# Phase specialization\n\nWhich heads read the compressed entries, and which heads "
                          "serve which phases? Record, ablate a head at one phase, then map every head."),
        new_code_cell(PARAMS),
        new_code_cell("import phaselens\nmodel = phaselens.load('zoo:w8s4')\n"
                      "rec = phaselens.record(model, n_per_residue=max(4, N // 8), progress=PROGRESS)\nrec"),
        new_code_cell("rec.plot('read')"),
        new_markdown_cell("Knock out `L0H3`, the head whose knockout does the most damage in the map below: on "
                          "`w8s4` it costs about a third of the accuracy at phase 0 and more than half at the boundary phase 3 "
                          "(no layer-1 head costs more than 0.3%)."),
        new_code_cell("res = phaselens.ablate(model, 'L0H3', phase=[0, 3], n_per_residue=N, progress=PROGRESS)\nres"),
        new_code_cell("pm = phaselens.specialization_map(model, n_per_residue=max(4, N // 4), progress=PROGRESS)\npm"),
        new_code_cell("pm.plot()"),
        new_markdown_cell("Ranked by specialization times damage, so a head with negligible damage never heads "
                          "the list (`most_specialized()` keeps the significant ones)."),
        new_code_cell("pm.specialization_index()"),
        new_code_cell("{phase: pm.top_heads(phase, k=3)['label'].tolist() for phase in range(4)}"),
    ],
    "03_gates_and_cycling": [
        new_markdown_cell("# Gates and gate cycling\n\nThe write side: where each compressor's gates put their "
                          "weight inside the window, how concentrated they are, and whether rolling the "
                          "offset-specific gate parameters moves the weak phases with them."),
        new_code_cell(PARAMS),
        new_code_cell("import phaselens\nmodel = phaselens.load('zoo:w4s4')\n"
                      "rec = phaselens.record(model, n_per_residue=max(4, N // 8), progress=PROGRESS)\n"
                      "phaselens.plots.gate_profiles(rec)"),
        new_code_cell("phaselens.plots.gate_concentration(rec)"),
        new_code_cell("cyc = phaselens.gate_cycling_test(model, n_per_residue=max(4, N // 2), progress=PROGRESS)\ncyc"),
        new_code_cell("cyc.plot()"),
        new_code_cell("try:\n    phaselens.analyses.cycling.cycle_gates(phaselens.load('zoo:w4s4-mean'), 1)\n"
                      "except phaselens.errors.NotApplicableError as err:\n    print('as expected:', err)"),
    ],
    "04_paper_statistics": [
        new_markdown_cell("# The paper's statistics, reproduced\n\nThe published per-residue counts of the 128K "
                          "needle test (DeepSeek-V4-Flash-Base and V4.1) and the FP8 probe, through the "
                          "phaselens battery. The data ship inside the package (`phaselens.data.paper_counts()`), "
                          "so this notebook runs from any directory."),
        new_code_cell(PARAMS),
        new_code_cell("import phaselens\nfrom phaselens.data import paper_counts\n"
                      "data = paper_counts()\nlist(data['models'])"),
        new_code_cell("flash = data['models']['DeepSeek-V4-Flash-Base']\n"
                      "b = phaselens.stats.phase_battery(flash['correct'], flash['n_per_residue'], stride=4,\n"
                      "                                  n_permutations=999 if SMALL else 9999)\nb"),
        new_code_cell("lo, hi = b.ci_low[0], b.ci_high[0]\nprint(f'Wilson r=0: [{100*lo:.2f}, {100*hi:.2f}] %  (published [37.81, 49.87])')\n"
                      "print(f'gap {100*b.residue_gap:.2f} pp (published 40.23); chi2 {b.chi2.statistic:.0f}, p={b.chi2.pvalue:.1g}')\n"
                      "assert f'{100*lo:.2f}' == '37.81' and f'{100*hi:.2f}' == '49.87' and f'{100*b.residue_gap:.2f}' == '40.23'"),
        new_code_cell("v41 = data['models']['DeepSeek-V4.1-Flash-0910']\n"
                      "b41 = phaselens.stats.phase_battery(v41['correct'], v41['n_per_residue'], stride=2, n_permutations=999)\n"
                      "print(f'V4.1 (stride 2): detected period {b41.period.period}; '\n"
                      "      f'residue gap {100*b41.residue_gap:.2f} pp (best minus worst residue)')"),
        new_code_cell("fp8 = data['fp8_probe']  # P(8) and P(32) per padding length L; groups by L mod 4\n"
                      "import numpy as np\n"
                      "g = phaselens.stats.group_means(np.stack([fp8['p_correct_8'], fp8['p_wrong_32']], 1), fp8['lengths'], 4,\n"
                      "                                groups=[{2, 3}, {0, 1}], names=['P(8)', 'P(32)'])\ng"),
    ],
    "05_deepseek_v4": [
        new_markdown_cell("# DeepSeek-V4 through transformers\n\nA tiny random `DeepseekV4ForCausalLM` built from a "
                          "config (no download), wrapped by `phaselens.from_hf`. The same calls work on real "
                          "weights: `phaselens.load('hf:/path/to/DeepSeek-V4-Flash', device_map='auto', "
                          "dtype=torch.bfloat16)`."),
        new_code_cell(PARAMS),
        new_code_cell("import torch, transformers, phaselens\n"
                      "cfg = transformers.DeepseekV4Config(\n"
                      "    vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,\n"
                      "    q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,\n"
                      "    moe_intermediate_size=32, sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=64,\n"
                      "    layer_types=['sliding_attention', 'compressed_sparse_attention', 'heavily_compressed_attention',\n"
                      "                 'compressed_sparse_attention'],\n"
                      "    compress_rates={'compressed_sparse_attention': 4, 'heavily_compressed_attention': 16})\n"
                      "cfg._attn_implementation = 'eager'\ntorch.manual_seed(0)\n"
                      "hf = transformers.DeepseekV4ForCausalLM(cfg).eval()\nadapter = phaselens.from_hf(hf)\nadapter.phase_specs"),
        new_code_cell("task = phaselens.tasks.KVRecall(n_records=6, block_filler=4, n_demos=2, min_distance=8, modulus=8,\n"
                      "                                n_keys=48, n_values=48, n_filler=29)\n"
                      "adapter.default_task = task\n"
                      "ev = phaselens.evaluate(adapter, n_per_residue=max(2, N // 32), progress=PROGRESS)\nev"),
        new_markdown_cell("**Why 0.0% everywhere.** This DeepSeek-V4 has random weights: it was never trained on the "
                          "task, so it answers no item correctly and its accuracy is 0.0% at every phase. The "
                          "battery's gap and the knockouts' *relative* accuracy changes are then empty (nothing to "
                          "lose). On real weights the same calls give the paper's numbers. What is defined for any "
                          "model is the **logit difference** (the answer's logit minus the wrong candidate's), so "
                          "below the knockouts are read through its change."),
        new_code_cell("items = ev.items\n"
                      "print(f\"accuracy {100 * items['correct'].mean():.1f}% of {len(items)} items; \"\n"
                      "      f\"mean logit difference {items['logit_diff'].mean():+.3f} (answer minus wrong)\")"),
        new_code_cell("rec = phaselens.record(adapter, n_per_residue=2, progress=PROGRESS)\nrec"),
        new_code_cell("tokens = task.build(adapter.analysis_spec, n_per_residue=1).tokens[:2]\n"
                      "with phaselens.analyses.knocked_out(adapter, 'L1H0', method='zero'):  # at the last position\n"
                      "    out = adapter(tokens)\n"
                      "change = (out - adapter(tokens))[:, -1].abs().max().item()\n"
                      "print(f'zeroing L1H0 moves the last position\\'s logits by up to {change:.3g}')\n"
                      "assert change > 0"),
        new_code_cell("pm = phaselens.specialization_map(adapter, n_per_residue=1, progress=PROGRESS, kinds=('layer',))\n"
                      "pm.metadata['engine']"),
        new_markdown_cell("Whole-layer knockouts, by phase: the relative accuracy change is empty (the clean accuracy "
                          "is 0), the change of the logit difference is not."),
        new_code_cell("pm.per_phase('layer')[['label', 'phase', 'clean_acc', 'rel_change', 'delta_logit_diff']]"),
    ],
}


def main() -> None:
    out = ROOT / "notebooks"
    out.mkdir(exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        for i, cell in enumerate(cells):
            cell["id"] = f"c{i:02d}"  # stable ids: regenerating changes only what was edited
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                 "language": "python"}})
        nbformat.write(nb, out / f"{name}.ipynb")
    print(f"wrote {len(NOTEBOOKS)} notebooks to {out}")


if __name__ == "__main__":
    main()
