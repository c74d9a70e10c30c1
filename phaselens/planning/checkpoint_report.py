"""The result of ``phaselens plan``: :class:`ModelPlan` (its fields, JSON and text), and GPU sizes.

:func:`phaselens.planning.checkpoint_plan.plan_model` computes it; the memory model is documented there, the
time model in :mod:`phaselens.planning.gpu_time`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from phaselens.errors import InputError

GiB = 2**30
GPU_TYPES = {"H100": 80.0, "H200": 141.0, "B200": 192.0}  # GB (1e9 bytes) as sold
USABLE = 0.9


@dataclass(frozen=True)
class ModelPlan:
    """A checkpoint's memory at a context length, the GPUs it needs, and the time of a forward and of a map."""

    source: str
    model_type: str
    config_only: bool
    weights_stored_bytes: int
    engram_stored_bytes: int
    files_bytes: int | None
    weights_bytes: int  # as loaded (GPUs and host memory)
    weights_dequantized_bytes: int
    context: int
    batch: int
    chunk: int | None
    cache_bytes: int
    attention_bytes: int  # one score tensor; four are budgeted
    activation_bytes: int
    logits_bytes: int
    peak_bytes: int  # everything of one forward on one device
    gpu_memory_bytes: int
    gpus: int | None  # GPUs of gpu_memory for the forward above (None: more than 64)
    per_gpu_bytes: int | None  # the fullest GPU's need with that many GPUs
    map_context: int
    map_node_gpus: int | None  # smallest node for a per-head map at map_context (None: no node of <= 8)
    map_node_chunk: int | None
    notes: list[str] = field(default_factory=list)
    engram_placement: str | None = None  # "host": device maps keep Engram's tables in host memory
    engram_host_bytes: int = 0  # host memory the tables take as loaded
    engram_bytes_per_token: int = 0  # host -> GPU, every Engram layer
    engram_map_context_bytes: int = 0  # host -> GPU for one prefix pass at map_context
    time: dict[str, Any] | None = None  # gpu_time.plan_time (None: not priced for this model type)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        g = lambda b: f"{b / GiB:,.1f} GiB"  # noqa: E731
        gb = self.gpu_memory_bytes / 1e9
        host = (f"; on GPUs {g(self.weights_bytes - self.engram_host_bytes)}, Engram's tables "
                f"{g(self.engram_host_bytes)} in host memory" if self.engram_host_bytes else "")
        lines = [f"{Path(self.source).name or self.source} ({self.model_type}"
                 + (", config.json only)" if self.config_only else ")"),
                 f"  weights as stored   {g(self.weights_stored_bytes)}"
                 + (f" (Engram tables {g(self.engram_stored_bytes)})" if self.engram_stored_bytes else "")
                 + (f" (files: {g(self.files_bytes)})" if self.files_bytes else ""),
                 f"  weights as loaded   {g(self.weights_bytes)} (dequantized: {g(self.weights_dequantized_bytes)})"
                 + host,
                 f"  at {self.context:,} tokens, batch {self.batch}, "
                 + (f"chunk {self.chunk}" if self.chunk else "one call")
                 + f": cache {g(self.cache_bytes)}, attention 4 x {g(self.attention_bytes)}, other activations "
                 f"{g(self.activation_bytes)}, logits {g(self.logits_bytes)}",
                 f"  GPUs of {gb:g} GB ({USABLE:.0%} usable): "
                 + (f"{self.gpus} (fullest GPU {g(self.per_gpu_bytes or 0)})" if self.gpus else "more than 64"),
                 f"  per-head map at {self.map_context:,} tokens: "
                 + (f"{self.map_node_gpus} x {gb:g} GB, chunk {self.map_node_chunk}" if self.map_node_gpus
                    else f"no node of up to 8 x {gb:g} GB")]
        if self.engram_placement == "host":
            t = self.time or {}
            link = t.get("host_link_gbps")
            lines.append(
                f"  Engram: tables in host memory ({g(self.engram_host_bytes)}), rows gathered on the host and sent "
                f"to their layer's GPU: {self.engram_bytes_per_token:,} B per token; "
                f"{self.engram_map_context_bytes / GiB:,.2f} GiB per {self.map_context:,}-token pass"
                + (f" ({self.engram_map_context_bytes / (link * 1e9):.2f} s at {link:g} GB/s)" if link else ""))
        if self.time:
            lines += time_lines(self.time, gb)
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _hours(seconds: float, gpus: int | None, gb: float) -> str:
    if gpus is None:
        return f"{seconds / 3600:,.1f} h of compute (no node fits it)"
    return f"{seconds / 3600:,.1f} h on {gpus} x {gb:g} GB = {seconds * gpus / 3600:,.1f} GPU-hours"


def time_lines(t: dict[str, Any], gb: float) -> list[str]:
    """The text lines of :func:`phaselens.planning.gpu_time.plan_time`'s dict."""
    f, m = t["forward"], t["map"]
    peak = (f"{t['gpu']}: {t['bf16_tflops']:g} bf16 / {t['fp32_tflops']:g} fp32 TFLOPS, {t['hbm_tbps']:g} TB/s; "
            f"{t['mfu']:.0%} of peak")
    fwd = (f"  time ({peak}): a forward at {f['context']:,} tokens"
           + (f" (chunk {f['chunk']})" if f["chunk"] else "") + f": {f['total_flops'] / 1e15:,.1f} PFLOP "
           f"({f['flops_fp32'] / 1e15:,.1f} in fp32), {f['bytes'] / 1e12:,.1f} TB moved: "
           + _hours(f["seconds"], f["gpus"], gb))
    mp = (f"  time of a per-head map at {m['context']:,} tokens ({m['items']:,} items in batches of "
          f"{m['item_batch']:,}, {m['cells']:,} cells, query-suffix engine, chunk {m['chunk']}): {m['prefix_passes']:,} prefix + "
          f"{m['query_passes']:,} query-row passes = {m['forward_equivalents']:,.2f} forward-equivalents, "
          f"{m['total_flops'] / 1e18:,.2f} EFLOP, {m['bytes'] / 1e15:,.2f} PB moved: "
          + _hours(m["seconds"], m["gpus"], gb))
    return [fwd, mp]


def gpu_bytes(text: str | float) -> int:
    """``"141"``, ``141``, ``"141GB"``, ``"80GiB"`` or a type (``"H200"``) -> bytes."""
    s = str(text).strip()
    if s.upper() in GPU_TYPES:
        return int(GPU_TYPES[s.upper()] * 1e9)
    for unit, scale in (("GIB", GiB), ("GB", 1e9)):
        if s.upper().endswith(unit):
            s, mult = s[: -len(unit)], scale
            break
    else:
        mult = 1e9
    try:
        value = float(s)
    except ValueError:
        raise InputError(f"--gpu-memory {text!r}: give GB (141), '80GiB', or a type ({', '.join(GPU_TYPES)}).") from None
    if not 0 < value < float("inf"):  # NaN too
        raise InputError(f"--gpu-memory must be a finite positive size, got {text!r}.")
    return int(value * mult)


def gpu_type(text: str | float) -> str | None:
    """The GPU type ``--gpu-memory`` names or whose size it gives (``"141"`` -> ``"H200"``), else ``None``."""
    s = str(text).strip().upper()
    if s in GPU_TYPES:
        return s
    size = gpu_bytes(text)
    return next((k for k, v in GPU_TYPES.items() if int(v * 1e9) == size), None)
