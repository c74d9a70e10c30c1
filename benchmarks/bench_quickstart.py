"""docs/quickstart.md's calls timed at the small sizes the page writes and at their default sizes, side by side.

    .venv/bin/python -m benchmarks.bench_quickstart [--calls evaluate,record,...] [--sizes small,default]

CPU seconds (``time.process_time``) as well as wall seconds: on a shared machine the load inflates the wall
time, not the CPU time; with one thread the two agree on an idle machine. The page's table quotes this.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import phaselens
from benchmarks.common import emit

# call -> (small keyword arguments as the page writes them, default-size keyword arguments)
CALLS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "evaluate": ({"n_per_residue": 32}, {}),
    "evaluate_control": ({"n_per_residue": 32}, {}),
    "record": ({"n_per_residue": 8}, {}),
    "specialization_map": ({"n_per_residue": 16}, {}),
    "ablate": ({"n_per_residue": 32}, {}),
    "evaluate_phase_ensemble": ({"n_per_residue": 8}, {}),
    "report": ({}, {}),
}


def timed(fn: Callable[[], Any]) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", default=",".join(c for c in CALLS if c != "report"))
    ap.add_argument("--sizes", default="small,default")
    args = ap.parse_args()
    model, control = phaselens.load("zoo:w8s4"), phaselens.load("zoo:full")
    fixed = phaselens.phase_ensemble(model)
    run = {
        "evaluate": lambda kw: phaselens.evaluate(model, progress=False, **kw),
        "evaluate_control": lambda kw: phaselens.evaluate(control, stride=4, progress=False, **kw),
        "record": lambda kw: phaselens.record(model, progress=False, **kw),
        "specialization_map": lambda kw: phaselens.specialization_map(model, progress=False, **kw),
        "ablate": lambda kw: phaselens.ablate(model, "L0H3", phase=3, progress=False, **kw),
        "evaluate_phase_ensemble": lambda kw: phaselens.evaluate(fixed, progress=False, **kw),
        "report": lambda kw: phaselens.report(["w8s4", "full"], out=tempfile.mkdtemp(), **kw),
    }
    sizes = args.sizes.split(",")
    rows = {}
    for call in args.calls.split(","):
        small, default = CALLS[call]
        fn = run[call]
        rows[call] = {size: timed(lambda kw=(small if size == "small" else default), fn=fn: fn(kw)) for size in sizes}
        if {"small", "default"} <= set(rows[call]):
            rows[call]["default_over_small_cpu"] = round(rows[call]["default"]["cpu_s"]
                                                         / max(rows[call]["small"]["cpu_s"], 1e-9), 1)
        print(call, rows[call], file=sys.stderr, flush=True)
    emit("quickstart", {"calls": rows})


if __name__ == "__main__":
    main()
