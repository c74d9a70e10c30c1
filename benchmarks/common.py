"""Shared helpers for the benchmarks: timing (best of several runs) and JSON output."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch


def best_time(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Minimum wall time of ``repeats`` calls (seconds): the least disturbed run on a shared machine."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def interleaved_times(fns: dict[str, Callable[[], Any]], repeats: int = 5) -> dict[str, float]:
    """Best wall time of each function, run in turns (a, b, a, b, ...) so that a load change on a shared
    machine hits both sides of a ratio alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def emit(name: str, payload: dict[str, Any]) -> None:
    print(json.dumps({"benchmark": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "machine": platform.machine(), **payload}, indent=2, default=float))
