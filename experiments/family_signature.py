"""Train tiny members of the paper's family and measure the paper's signature with phaselens's battery.

Reproduces docs/data/family_signature.json (docs/training.md; from the repository root, reusing trained models
in ``--out`` or training them):

    OMP_NUM_THREADS=2 python -m experiments.family_signature --layouts w4s4 w8s8 full --runs runs/family \
        --out zoo-out --n 256 --threads 2 > docs/data/family_signature.json

For each layout: train (or resume, or reuse a finished run) ``paper-LAYOUT`` at size ``tiny`` exactly as
``phaselens train --recipe paper-LAYOUT --size tiny`` does, then evaluate the trained model on the paper's task
with both padding schemes (``--n`` items per residue, 24 residues) and run the battery: the detected period,
the folded phase gap with its CI, the worst and boundary phases. The full-attention control is folded by the
stride of each compressed layout it is compared with. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="+", default=["w4s4", "full"])
    ap.add_argument("--runs", default="runs/family")
    ap.add_argument("--out", default="zoo-out")
    ap.add_argument("--n", type=int, default=256, help="items per residue")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import dataclasses

    import torch

    import phaselens
    from phaselens.train.family.recipes import family_recipe, paper_task
    from phaselens.train.family.run import member_name, run_recipe
    from phaselens.train.zoo_training import battery_summary

    torch.set_num_threads(args.threads)
    out: dict = {"n_per_residue": args.n, "members": {}}
    strides = sorted({int(lay[lay.index("s") + 1:].split("-")[0]) for lay in args.layouts if lay != "full"}) or [4]
    for layout in args.layouts:
        recipe = family_recipe(f"paper-{layout}", "tiny", steps=args.steps)
        recipe = dataclasses.replace(recipe, settings=dataclasses.replace(recipe.settings, threads=args.threads))
        path = Path(args.out) / member_name(recipe)
        if not (path / "model.safetensors").is_file():
            run_recipe(recipe, out=args.out, runs=args.runs, eval_per_residue=0, progress=False)
        model = phaselens.load(path)
        member: dict = {"parameters": sum(p.numel() for p in model.parameters()),
                        "training": {k: model.metadata["training"][k] for k in
                                     ("steps", "batch_size", "tokens", "seconds", "tokens_per_second", "final_loss")},
                        "val": model.metadata["training"]["val"]}
        for padding in ("prefix", "in_sequence"):
            for stride in ([model.analysis_spec.stride] if layout != "full" else strides):
                ev = phaselens.evaluate(model, paper_task(padding), n_per_residue=args.n, seed=1, stride=stride,
                                        n_permutations=2000, n_bootstrap=1000, batch_size=128, progress=False)
                member[f"{padding}/S{stride}"] = battery_summary(ev)
        out["members"][layout] = member
        print(json.dumps({layout: {k: (v if not isinstance(v, dict) or "gap" not in v else
                                       {x: v[x] for x in ("mean", "worst", "boundary", "gap", "gap_ci", "period",
                                                          "p_g", "p_nested")})
                                   for k, v in member.items()}}), file=sys.stderr)
    print(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
