"""Every run priced before it allocates: the items, one batch's forward, against the memory there is.

:func:`price_run` runs in the one preamble every analysis goes through
(:func:`phaselens.analyses.items.build_items`), before any item is built. It estimates

* the items in host memory: ``N x (BUILD_BYTES_PER_TOKEN x T + ITEM_OVERHEAD)`` bytes, the peak while a task
  builds ``N`` items of ``T`` tokens (token ids, their corrupted twin and the builder's int64 scratch copies,
  plus the per-item table). Measured: 43-49 bytes per token (tracemalloc peak of ``task.build`` for two
  ``KVRecall`` layouts) and 44-53 (peak RSS growth at ``N`` = 12k-160k); the command is in docs/scale.md and
  ``tests/runtime/test_budget.py`` checks the bound, so 56 is an upper bound;
* one scored forward of ``min(batch_size, N)`` items (:func:`forward_bytes`: the model's ``estimate_memory``
  capability where it has one), without the weights, which are in memory already;

and raises :class:`~phaselens.errors.ResourceError` when either would not fit in the memory available
now (``MemAvailable`` and the cgroup's limit on the host, free memory on a CUDA device), saying the largest
``n_per_residue`` or ``batch_size`` that fits.

Every other allocation sized by a user's number goes through :func:`check_allocation` first (a model built
from its config, a KV cache of ``batch_size x max_len``, one forward's attention): it prices the bytes exactly
(or from below, never above), and refuses what the memory available now cannot hold, naming what fits.

Also the one check of thread counts (:func:`check_threads`): torch and OpenMP abort the whole process on a
count they cannot create (``--threads 1000000000`` aborted inside libgomp).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from typing import Any

from phaselens.errors import InputError, ResourceError
from phaselens.tasks.placement import BUILD_BYTES_PER_TOKEN

GiB = 2**30
SMALL = 64 * 2**20  # allocations below this are never priced (no memory probe on every small forward)
ITEM_OVERHEAD = 512  # the per-item table row and the per-item results of an analysis


def _gib(n: float) -> str:
    if n < 1000 * GiB:
        return f"{n / GiB:,.3g} GiB"
    return f"{n / 2**40:,.1f} TiB" if n < 1e6 * 2**40 else f"{n / 2**40:.2e} TiB"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text in ("", "max") else int(text)
    except (OSError, ValueError):
        return None


def host_available() -> int | None:
    """Bytes of host memory this process may still take: ``MemAvailable``, capped by a cgroup v2 limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        avail = min(avail, max(0, limit - used))
    return avail


def device_available(device: Any) -> int | None:
    """Free bytes on a CUDA ``device`` (``None`` for any other device: its memory is the host's)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.mem_get_info(dev)[0])
    except (RuntimeError, AssertionError):
        return None


def available(device: Any = "cpu") -> tuple[int | None, str]:
    """``(bytes, where)``: what ``device`` can still give. A CUDA device: its free memory plus what torch's
    caching allocator holds unused; any other real device: the host (:func:`host_available`); ``meta``:
    ``None`` (nothing is allocated there). ``None`` bytes: unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "meta":
        return None, "meta"
    if dev.type == "cuda":
        free = device_available(dev)
        if free is not None:
            try:
                free += int(torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))
            except (RuntimeError, AssertionError):
                pass
        return free, str(dev)
    return host_available(), "cpu"


def check_allocation(what: str, need: int, *, device: Any = "cpu", fits: Callable[[int], str],
                     parts: dict[str, int] | None = None) -> None:
    """Raise :class:`ResourceError` before allocating ``need`` bytes on ``device`` when they exceed what it has.

    ``what`` names the allocation (``"a KV cache of batch_size=8 x max_len=10**9"``); ``fits(free)`` says, in
    a sentence, the largest size that fits in ``free`` bytes; ``parts`` breaks ``need`` down. Allocations under
    :data:`SMALL` and those of unknown room pass without a probe.
    """
    if need < SMALL:
        return
    free, where = available(device)
    if free is None or need <= free:
        return
    detail = f" ({', '.join(f'{k} {_gib(v)}' for k, v in parts.items() if v)})" if parts else ""
    raise ResourceError(f"{what} needs about {_gib(need)}{detail} on {where}, but {_gib(free)} is available there; "
                        f"{fits(free)}")


def largest_fitting(cost: Callable[[int], int], free: int, upper: int) -> int:
    """The largest ``x`` in ``1..upper`` with ``cost(x) <= free`` (``cost`` non-decreasing), 0 when none."""
    if cost(1) > free:
        return 0
    lo, hi = 1, max(1, int(upper))
    while lo < hi:  # cost(lo) fits; find the last x that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= free else (lo, mid - 1)
    return lo


def items_bytes(n_items: int, seq_len: int) -> int:
    """Peak host bytes of building ``n_items`` items of ``seq_len`` tokens (see the module docstring)."""
    return int(n_items) * (BUILD_BYTES_PER_TOKEN * int(seq_len) + ITEM_OVERHEAD)


def model_device(model: Any) -> Any:
    from phaselens.contract.protocol import module_of

    module = module_of(model)
    if module is None:
        return "cpu"
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return "cpu"


def forward_bytes(model: Any, T: int, b: int, query_rows: int) -> dict[str, int]:
    """Bytes of one scored forward of ``b`` items of ``T`` tokens (as ``model_logits`` makes it: the query
    rows' logits only): the model's ``estimate_memory`` capability where it has one (weights, cache, a call's
    attention probabilities times four, logits), else an upper bound from sizes (weights, one batch's
    ``[b, H, T, T]`` fp32 attention scores, its logits)."""
    from phaselens.contract.protocol import capability

    estimate = capability(model, "estimate_memory")
    if estimate is not None:
        query_len = None if model.dims.prefill_chunk is None else query_rows  # hooked rows when chunked
        e = estimate(T, batch=b, query_len=query_len, logits="query")
        out = {"weights": e.weights, "cache": e.cache, "attention": 4 * e.attention, "logits": e.logits}
        if e.activations:  # DeepSeek-V4.1 counts its other transients too
            out["activations"] = e.activations
        return out
    from phaselens.contract.protocol import module_of

    module = module_of(model)
    weights = 0 if module is None else sum(t.numel() * t.element_size() for t in [*module.parameters(),
                                                                                  *module.buffers()])
    dims = model.dims
    b *= dims.copies
    return {"weights": weights, "attention": b * int(dims.n_heads) * T * T * 4,
            "logits": b * query_rows * int(dims.d_vocab) * 4}


def price_run(model: Any, *, n_items: int, seq_len: int, per_residue: int | None, n_residues: int,
              batch_size: int | None, query_rows: int | None = None) -> dict[str, int]:
    """Raise :class:`ResourceError` unless ``n_items`` items of ``seq_len`` tokens (``per_residue`` of each of
    ``n_residues`` residues; ``None``: the items exist already) and a forward of ``batch_size`` of them fit in
    the memory available now. Returns the priced bytes (``items``, ``forward``)."""
    need_items = items_bytes(n_items, seq_len) if per_residue is not None else 0
    host = host_available()
    if host is not None and need_items > host:
        per = items_bytes(n_residues, seq_len)
        fits = max(0, host // max(per, 1))
        raise ResourceError(
            f"{n_items:,} items of {seq_len:,} tokens ({per_residue:,} per residue x {n_residues} residues) need "
            f"about {_gib(need_items)} of memory to build, but {_gib(host)} is available; "
            + (f"use n_per_residue={fits:,} or fewer (or fewer residues)." if fits >= 1 else
               "not even one item per residue fits: free memory or shorten the task.")
        )
    forward = 0
    if batch_size is not None and n_items > 0:
        b = min(int(batch_size), int(n_items))
        rows = int(query_rows) if query_rows is not None else 1
        parts = forward_bytes(model, seq_len, b, rows)
        forward = sum(v for k, v in parts.items() if k != "weights")
        dev = model_device(model)
        free = device_available(dev)
        if free is None and host is not None:
            free, dev = host - need_items, "cpu"
        if free is not None and forward > free:
            one = sum(v for k, v in forward_bytes(model, seq_len, 1, rows).items() if k != "weights")
            fits = max(0, free // max(one, 1))
            raise ResourceError(
                f"a forward of batch_size={b} items of {seq_len:,} tokens needs about {_gib(forward)} on {dev} "
                f"({', '.join(f'{k} {_gib(v)}' for k, v in parts.items() if k != 'weights')}), but "
                f"{_gib(free)} is free there; "
                + (f"use batch_size={min(fits, b - 1):,} or fewer." if fits >= 1 else
                   "not even one item fits: use a shorter task, or a larger device.")
            )
    return {"items": need_items, "forward": forward}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_threads() -> int:
    """The most threads phaselens lets torch start: 4 per usable CPU, at least 64 (oversubscription is slow
    but legal; far beyond it OpenMP aborts the process)."""
    return max(64, 4 * usable_cpus())


def check_threads(value: Any, *, name: str = "threads") -> int:
    """``value`` as a thread count in ``1..max_threads()``, else an :class:`InputError` naming the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"{name} must be a whole number of threads, got {value!r}.")
    n, cap = int(value), max_threads()
    if not 1 <= n <= cap:
        raise InputError(f"{name}={n} is outside 1..{cap}: this machine gives the process {usable_cpus()} CPU(s) "
                         f"(at most {cap} threads are allowed); pass {name}={min(usable_cpus(), cap)} or fewer.")
    return n
