"""One rank of a test run across processes (gloo on loopback), started by ``tests/runtime/test_distributed.py``.

``python tests/support/dist_worker.py SCENARIO OUT_DIR`` with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). Each rank writes ``OUT_DIR/rank{R}.npz`` (the :func:`digest` of its
results, plain arrays, no pickle) and ``OUT_DIR/rank{R}.json`` (metadata and any error it raised).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

SMALL = dict(n_per_residue=2, batch_size=16)


def digest(result: Any, prefix: str) -> dict[str, np.ndarray]:
    """The numbers of a result that a distributed run must reproduce, as flat named arrays."""
    import phaselens

    out: dict[str, np.ndarray] = {}

    def put(name: str, value: Any) -> None:
        out[f"{prefix}/{name}"] = np.asarray(value)

    if isinstance(result, phaselens.PhaseEval):
        for col in ("residue", "correct", "p_correct", "p_wrong", "logit_diff", "nll", "rank"):
            put(col, result.items[col].to_numpy())
        put("summary", [result.mean, result.worst, result.boundary, *result.gap_ci, result.tests.omnibus.pvalue])
    elif isinstance(result, phaselens.PhaseMap):
        put("clean_correct", result.correct)
        put("ko_correct", result.correct_ko)
        put("ko_logit_diff", result.logit_diff_ko)
        for f in ("ko_acc", "rel_change", "ci_low", "ci_high", "pvalue", "delta_logit_diff"):
            put(f, getattr(result.effects, f))
    elif isinstance(result, phaselens.PhaseRecording):
        for q, lab in result.read.items():
            put(f"read_{q}", lab.values)
        for name in ("gate_key", "gate_value", "gate_profile", "concentration"):
            lab = getattr(result, name)
            if lab is not None:
                put(name, lab.values)
    elif isinstance(result, phaselens.PhaseAblation):
        for col in ("correct", "correct_ko", "logit_diff", "logit_diff_ko"):
            put(col, result.items[col].to_numpy())
        put("rel_change", result.effects.rel_change)
    elif isinstance(result, phaselens.PhasePatch):
        put("item_patched", result.logit_diff_patched)
        put("recovery", result.recovery.values)
        put("ci_low", result.recovery.ci_low)
    elif isinstance(result, phaselens.PhaseAttribution):
        put("values", result.values)
        put("estimate", result.estimate.values)
    elif isinstance(result, phaselens.PhaseRepairTable):
        put("rows", result.rows[["mean", "worst", "gap", "any_copy_right"]].to_numpy(float))
        for (shifts, rule), ev in result.evals.items():
            put(f"{shifts}-{rule}-correct", ev.items["correct"].to_numpy())
    else:
        raise TypeError(type(result))
    return out


def analyses(model: Any, which: tuple[str, ...], journal: str | None = None) -> dict[str, Any]:
    """Run the named analyses with small, fixed settings (the same in one process and across ranks)."""
    import phaselens

    run = {
        "evaluate": lambda: phaselens.evaluate(model, n_per_residue=2, batch_size=14, n_permutations=50,
                                               n_bootstrap=50, progress=False),
        "map": lambda: phaselens.specialization_map(model, **SMALL, n_bootstrap=20, progress=False,
                                                    rows_per_pass=48, journal=journal),
        "map_layers": lambda: phaselens.specialization_map(model, **SMALL, n_bootstrap=20, progress=False,
                                                           kinds=("layer",), engine="full"),
        "record": lambda: phaselens.record(model, **SMALL, progress=False),
        "ablate": lambda: phaselens.ablate(model, "L0H1", **SMALL, n_bootstrap=20, progress=False),
        "patch": lambda: phaselens.patch(model, **SMALL, n_bootstrap=20),
        "attribution": lambda: phaselens.attribution_map(model, **SMALL),
        "repair": lambda: phaselens.repair_table(model, **SMALL, n_permutations=50, n_bootstrap=50, progress=False,
                                                 combines=("max_conf",), shift_sets=("all",)),
    }
    return {name: run[name]() for name in which}


SCENARIOS = {
    "equal": ("evaluate", "map", "record"),
    "more": ("ablate", "patch", "attribution", "repair"),
    "uneven": ("evaluate", "map_layers"),
}


def _kill_on_call(rank: int, call: int) -> None:
    """SIGKILL this process when the query engine is asked for its ``call``-th batch of cells."""
    from phaselens.models.parts.suffix_engine import QueryEngine

    run = QueryEngine.run
    calls = {"n": 0}

    def dying(self: Any, cells: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signal.SIGKILL)
        return run(self, cells)

    QueryEngine.run = dying  # type: ignore[method-assign]


def _fail_in_share() -> None:
    """Make this rank's share of a map raise (the error must reach every rank)."""
    from phaselens.errors import InputError
    from phaselens.models.parts.suffix_engine import QueryEngine

    def failing(self: Any, cells: Any) -> Any:
        raise InputError("planted failure in this rank's cells")

    QueryEngine.run = failing  # type: ignore[method-assign]


def run_rank(scenario: str, out: str, rank: int, world_size: int, port: int) -> None:
    """Entry point of a rank started by the tests (torchrun's environment, then :func:`main`)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    main(scenario, Path(out))


def main(scenario: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    import phaselens

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = phaselens.load("zoo:w4s4")
    info: dict[str, Any] = {"rank": rank, "world_size": dist.get_world_size()}
    arrays: dict[str, np.ndarray] = {}
    try:
        if scenario == "kill":
            if rank == 1:
                _kill_on_call(rank, 3)
            results = analyses(model, ("map",), journal=str(out / "map.journal"))
        else:
            results = analyses(model, SCENARIOS[scenario])
        for name, res in results.items():
            arrays.update(digest(res, name))
            info[name] = {k: res.metadata[k] for k in ("world_size", "shards")}
        if scenario == "uneven":  # then a share that fails on rank 1: every rank must hear of it
            if rank == 1:
                _fail_in_share()
            try:
                analyses(model, ("map",))
            except Exception as err:
                info["fail"] = _error(err)
    except Exception as err:
        info["error"] = _error(err)
    np.savez(out / f"rank{rank}.npz", **arrays)
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    if "error" not in info:
        dist.destroy_process_group()


def _error(err: Exception) -> dict[str, Any]:
    return {"type": type(err).__name__, "message": str(err), "origin": getattr(err, "phaselens_rank", None)}


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
