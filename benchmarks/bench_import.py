"""Start-up time: ``import phaselens``, ``phaselens --help`` and ``phaselens zoo list`` against a bare ``import torch``.

    .venv/bin/python -m benchmarks.bench_import [--repeats 7]

Each command runs in a fresh interpreter (``python -X importtime`` is not used: it slows imports down), in
turns (torch, phaselens, --help, zoo list, torch, ...) so that a load change on a shared machine hits every
side alike; the best turn of each is kept. Goal: each phaselens command within 0.5 s of ``import torch``.
The JSON also lists the heavy modules that ``import phaselens`` leaves unloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = "from phaselens.presentation.cli import app; app(prog_name='phaselens')"  # what the `phaselens` console script runs
COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import phaselens": ["-c", "import phaselens"],
    "phaselens --help": ["-c", CLI, "--help"],
    "phaselens zoo list": ["-c", CLI, "zoo", "list"],
}
HEAVY = ("torch", "transformer_lens", "transformers", "nnsight", "plotly", "scipy", "pandas", "numpy")


def run(args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7, help="turns of each command; the best of each is kept")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "80"}
    for cmd in COMMANDS.values():  # warm the file cache once
        run(cmd, env)
    times: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            times[name].append(run(cmd, env))
    best = {k: min(v) for k, v in times.items()}
    torch_s = best["import torch"]
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, phaselens; print(' '.join(sorted(m for m in "
         f"{HEAVY!r} if m in sys.modules)))"], env=env, check=True, capture_output=True, text=True).stdout.split()
    import torch

    print(json.dumps({
        "benchmark": "bench_import", "torch": torch.__version__, "machine": platform.machine(),
        "python": platform.python_version(), "repeats": args.repeats,
        "seconds_best": {k: round(v, 3) for k, v in best.items()},
        "seconds_all": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "minus_import_torch_s": {k: round(v - torch_s, 3) for k, v in best.items() if k != "import torch"},
        "goal_within_s": 0.5,
        "meets_goal": all(v - torch_s <= 0.5 for k, v in best.items() if k != "import torch"),
        "heavy_modules_loaded_by_import_phaselens": loaded,
    }, indent=2))


if __name__ == "__main__":
    main()
