"""Wall time of the default report (``make report``: w8s4 against full, static PNGs included).

    .venv/bin/python -m benchmarks.bench_report
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import phaselens
from benchmarks.common import emit


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = phaselens.report(out=Path(tmp) / "report", progress=False)
        wall = time.perf_counter() - t0
        figures = len(list((out / "figures").glob("*.png"))) if (out / "figures").exists() else 0
    emit("bench_report", {"models": ["w8s4", "full"], "wall_s": wall, "png_figures": figures})


if __name__ == "__main__":
    main()
