"""Retrain the whole zoo from scratch (``make zoo``): two models at a time, one thread each.

    .venv/bin/python -m tools.train_zoo [NAMES...] [--seed K ...] [--jobs 2] [--out phaselens/zoo] [--runs runs/zoo]

``--seed K`` trains each named base recipe with seed K instead (``w4s4 --seed 2`` is the recipe ``w4s4-seed2``:
both the initial weights and the training data change); several seeds may follow one ``--seed``.

Each model trains in its own process (``phaselens train --recipe NAME``); runs resume from their last
checkpoint if interrupted. Afterwards run ``python -m tools.gen_zoo_docs`` to regenerate docs/zoo.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from phaselens.train.zoo_recipes import RECIPES, get_recipe, seeded

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=list(RECIPES))
    parser.add_argument("--seed", type=int, nargs="+", default=None, help="train these seeds of the named recipes")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "phaselens" / "zoo"))
    parser.add_argument("--runs", default=str(ROOT / "runs" / "zoo"))
    args = parser.parse_args()
    queue = list(args.names)
    if args.seed is not None:
        queue = [seeded(get_recipe(n).name, k).name for n in queue for k in args.seed]
    for name in queue:
        get_recipe(name)  # fail before starting anything on a misspelt name
    running: list[tuple[str, subprocess.Popen, float]] = []
    logs = Path(args.runs)
    logs.mkdir(parents=True, exist_ok=True)
    while queue or running:
        while queue and len(running) < args.jobs:
            name = queue.pop(0)
            cmd = [sys.executable, "-m", "phaselens.presentation.cli", "train", "--recipe", name, "--out", args.out,
                   "--runs", args.runs, "--no-progress"]
            log = open(logs / f"{name}.log", "w")
            running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), time.time()))
            print(f"started {name}", flush=True)
        time.sleep(5)
        for item in list(running):
            name, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {logs / name}.log)"
                print(f"{name}: {status} after {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
