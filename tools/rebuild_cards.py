"""Re-run the evaluation and card of trained zoo models (training resumes at its last step, so only the
evaluation runs), one after another.

    .venv/bin/python -m tools.rebuild_cards w8s4 w4s4 ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from phaselens.train.zoo_training import build_zoo_model

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:]:
        card = build_zoo_model(name, ROOT / "phaselens" / "zoo", run_dir=ROOT / "runs" / "zoo", progress=False)
        b = card["battery"]
        print(f"{name}: mean {100 * b['mean']:.1f}%, worst {100 * b['worst']:.1f}%, gap {100 * b['gap']:.1f} pp, "
              f"period {b['period']}", flush=True)
