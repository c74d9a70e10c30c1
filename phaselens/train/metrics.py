"""What a cluster user watches, on a fixed interval: ``RUN_DIR/metrics.jsonl`` and the progress bar.

Every ``log_every`` steps (and at the run's last step) rank 0 appends one JSON line::

    {"step": 120, "loss": 2.31, "grad_norm": 0.84, "lr": 0.0003, "tokens_per_second": 51234.0,
     "tflops": 140.2, "mfu": 0.142, "peak_memory_gib": 31.7, "memory": "cuda", "seconds": 12.3}

``loss`` is the mean over the interval's steps, ``grad_norm`` the last step's norm before clipping, ``tflops``
the model FLOPs per second (:func:`~phaselens.train.family.costs.flops_per_token` at each step's row length and
trained positions; no recompute), ``mfu`` that over the peak the run was given (null without one), and
``peak_memory_gib`` the CUDA allocator's peak (``memory: "cuda"``) or the process's peak resident memory on a
CPU (``"host"``). The first line is a format stamp, which proves the file is phaselens's (the ownership rule);
a line cut short by a kill is dropped with a warning, and a resumed run first drops the lines after its checkpoint, so each step appears once.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from phaselens.storage.reading import read_jsonl
from phaselens.storage.writing import write_owned_file

METRICS = "metrics.jsonl"
FORMAT = "phaselens.train_metrics/1"
BY = "training run"


def is_metrics(path: Path) -> bool:
    """A metrics file phaselens wrote: its first line is the format stamp."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.readline()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (without the format stamp).

    A last line cut short by a kill mid-write is dropped with a
    :class:`~phaselens.storage.reading.TornLineWarning` (the resume writes that interval again).

    Raises:
        CheckpointError: the file cannot be read, or an earlier line is damaged (not a JSON object).
    """
    from phaselens.errors import CheckpointError

    path = Path(run_dir) / METRICS
    fix = (f"move {path} away to resume (the loss of every step stays in log.json), or restore it from a "
           "backup.")
    records = read_jsonl(path, fix=fix)[1:]
    bad = next((i for i, r in enumerate(records, 2) if not isinstance(r, dict)), None)
    if bad is not None:
        raise CheckpointError(f"{path} is damaged: line {bad} is not a JSON object; {fix}")
    return records


class Meter:
    """Accumulates steps on rank 0 and writes a record every ``every`` steps."""

    def __init__(self, run_dir: Path, cfg: Any, model: Any, start: int, every: int, peak_tflops: float | None,
                 where: torch.device) -> None:
        from phaselens.errors import ConfigError

        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"log_every must be a positive int (steps), got {every!r}.")
        self.path, self.cfg, self.every, self.peak, self.where = run_dir / METRICS, cfg, every, peak_tflops, where
        self.n = sum(p.numel() for p in model.parameters())
        self.emb = model.embed.weight.numel()
        self.last: dict[str, Any] = {}
        kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= start] if is_metrics(self.path) else []
        text = "".join(json.dumps(r) + "\n" for r in [{"format": FORMAT}, *kept])
        run_dir.mkdir(parents=True, exist_ok=True)
        write_owned_file(self.path, lambda tmp: tmp.write_text(text, encoding="utf-8"), by=BY, proves=is_metrics,
                         record=False)
        self._reset()

    def _reset(self) -> None:
        self.t0, self.losses, self.tokens, self.flops = time.perf_counter(), [], 0, 0.0

    def step(self, done: int, loss: float, norm: float, lr: float, tokens: int, seq: int, trained: float, *,
             last: bool) -> dict[str, Any] | None:
        from phaselens.train.family.costs import flops_per_token

        self.losses.append(loss)
        self.tokens += tokens
        self.flops += tokens * flops_per_token(self.cfg, self.n, self.emb, seq=seq, trained=trained).model
        if done % self.every and not last:
            return None
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        finite = [x for x in self.losses if math.isfinite(x)]
        tflops = self.flops / seconds / 1e12
        record = {"step": done, "loss": sum(finite) / len(finite) if finite else None,
                  "grad_norm": norm if math.isfinite(norm) else None, "lr": lr,
                  "tokens_per_second": self.tokens / seconds, "tflops": tflops,
                  "mfu": tflops / self.peak if self.peak else None, **_peak_memory(self.where),
                  "seconds": round(seconds, 3)}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.last = record
        self._reset()
        return record


def _peak_memory(where: torch.device) -> dict[str, Any]:
    if where.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(where) / 2**30, "memory": "cuda"}
    import resource

    return {"peak_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "memory": "host"}


def postfix(record: dict[str, Any], log: dict[str, Any]) -> dict[str, str]:
    """The progress bar's fields: the last record's numbers (and the last validation accuracy)."""
    out = {"loss": f"{log['loss'][-1]:.4f}" if log["loss"] else "-"}
    if record:
        out.update({"gnorm": f"{record['grad_norm']:.3g}" if record["grad_norm"] is not None else "-",
                    "lr": f"{record['lr']:.2e}", "tok/s": f"{record['tokens_per_second']:,.0f}",
                    "mem": f"{record['peak_memory_gib']:.1f}G"})
        if record["mfu"] is not None:
            out["mfu"] = f"{record['mfu']:.1%}"
    if log["val"]:
        out["val_acc"] = f"{log['val'][-1][1]:.3f}"
    return out
