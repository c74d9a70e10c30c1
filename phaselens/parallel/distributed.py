"""Analyses across ``torch.distributed`` ranks (``torchrun``): one fixed split of the work, shares gathered.

When a process group is initialized (``torchrun`` does it for the CLI; a script calls
``torch.distributed.init_process_group``), every analysis that iterates over *units* of work runs them
through :func:`shard_map`:

=======================  =====================================================  ==========================
analysis                 unit                                                   replicated on every rank
=======================  =====================================================  ==========================
``evaluate``             a block of ``batch_size`` items                        item construction, battery
``record``               a block of ``batch_size`` items                        assembly of the means
``ablate``               a block of ``batch_size`` items                        effects and CIs
``attribution_map``      a block of ``batch_size`` items                        calibration, CIs
``repair_table``         a block of ``batch_size`` items (every shifted copy)   combining rules, batteries
``specialization_map``   a cell (head, KV head or layer knockout)               calibration, clean prefix
``patch``                a head                                                 source ``z``, clean prefix
=======================  =====================================================  ==========================

**Assignment.** The units still to compute (all of them, or those a journal lacks) are listed in the
analysis's own order; unit ``k`` of that list goes to rank ``k % world_size``. It depends only on the work
and the world size, never on timing. Item blocks have the same boundaries as a single-process run, so
every forward sees exactly the batch it would see alone. Ranks work in lockstep rounds of ``per_call``
units each (a rank without units left sends an empty share); after each round every rank has every
finished unit, rank 0 writes the journal and moves the progress bar by the global count.

**Equality.** Every rank returns the same result object as a single-process run: per-unit results are
computed on identical inputs and put back in unit order, so counts, correctness flags and per-item values
are bit-identical when the model is deterministic on its device (CPU is; tests hold it). Reductions over
units are done after the gather in unit order, as a single process does them (``record``'s gate sums
included), so summaries are bit-identical too.

**Errors.** An exception inside a rank's share is sent to every rank with the next gather: the failing rank
re-raises it, the others raise :class:`~phaselens.errors.RankError` naming the rank and its message. A rank
that dies (SIGKILL, OOM) makes the others raise :class:`~phaselens.errors.DistributedError` at their next
gather (torchrun ends the job anyway); with ``journal=`` a rerun at any world size resumes.

Outside a process group :func:`shard_map` is a plain loop and nothing changes. Inside one rank's share
(:func:`local`), nested analyses run on that rank alone.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

from phaselens.errors import DistributedError, RankError
from phaselens.parallel.world import World, is_main_process, local, process_world, world

_LEDGER: ContextVar[list[dict[str, Any]] | None] = ContextVar("phaselens_shard_ledger", default=None)
F = TypeVar("F", bound=Callable[..., Any])


def assignment(n: int, size: int) -> list[list[int]]:
    """The units (positions ``0..n-1`` in the list of units to compute) of each rank: ``k`` -> ``k % size``."""
    if size < 1 or n < 0:
        raise ValueError(f"assignment needs n >= 0 and size >= 1, got n={n}, size={size}.")
    return [list(range(r, n, size)) for r in range(size)]


def item_blocks(n_items: int, batch_size: int) -> list[slice]:
    """The item blocks of ``n_items`` items: ``batch_size`` items each (the last may be shorter)."""
    return [slice(i, min(i + batch_size, n_items)) for i in range(0, n_items, batch_size)]


def block_labels(blocks: Sequence[slice]) -> list[str]:
    """Journal and metadata labels of item blocks: ``"items 0-63"``."""
    return [f"items {b.start}-{b.stop - 1}" for b in blocks]


# ---- the one loop every analysis uses ------------------------------------------------------------------
def shard_map(
    compute: Callable[[list[int]], Sequence[Any]],
    labels: Sequence[str],
    *,
    per_call: int = 1,
    store: Any = None,
    unit: str = "item block",
    progress: bool = False,
    stage: str = "",
    bar_unit: str = "batch",
    leave: bool = False,
    model: Any = None,
) -> list[Any]:
    """Results of every unit, in unit order, on every rank.

    Args:
        compute: ``compute(indices) -> results`` for a list of unit indices (at most ``per_call``), one
            result per index. With ``store``, a result is a tuple of arrays (the store's fields).
        labels: one unique label per unit (journal keys and ``metadata["shards"]``).
        store: a :class:`~phaselens.storage.journal.CellJournal` (open it with :func:`open_journal`):
            units it holds are skipped, finished units are added and flushed after every round.
        unit, stage: what a unit is (``"cell"``, ``"item block"``) and the stage name (progress bar, ledger).
        progress, bar_unit, leave, model: the progress bar (rank 0 only; it counts units of all ranks).
    """
    labels = [str(x) for x in labels]
    n = len(labels)
    held = set(store.done) if store is not None else set()
    todo = [i for i in range(n) if labels[i] not in held]
    w = world()
    results: dict[int, Any] = {}
    bar = None
    if progress and is_main_process():
        from phaselens.parallel.progress import progress_bar

        bar = progress_bar(stage=stage, unit=bar_unit, total=n, initial=n - len(todo), leave=leave, model=model)

    def keep(idx: list[int], out: Sequence[Any]) -> None:
        if len(out) != len(idx):
            raise RuntimeError(f"compute returned {len(out)} results for {len(idx)} units")
        for i, r in zip(idx, out):
            if store is not None:
                store.add(labels[i], *((r,) if isinstance(r, dict) else r))
            else:
                results[i] = r

    try:
        if w.size == 1:
            shares = [todo]
            for j in range(0, len(todo), per_call):
                idx = todo[j : j + per_call]
                keep(idx, compute(idx))
                if store is not None:
                    store.flush()
                if bar is not None:
                    bar.update(len(idx))
        else:
            shares = [[todo[k] for k in share] for share in assignment(len(todo), w.size)]
            _agree(w, stage, labels, todo, per_call)
            mine = shares[w.rank]
            rounds = math.ceil(max(len(s) for s in shares) / per_call)
            for j in range(rounds):
                idx = mine[j * per_call : (j + 1) * per_call]
                payload, err = _attempt(compute, idx)
                gathered = gather(payload, stage=stage)
                _raise_failures(gathered, err, w)
                for part in gathered:
                    keep(part["idx"], part["out"])
                if store is not None:
                    store.flush()
                if bar is not None:
                    bar.update(sum(len(p["idx"]) for p in gathered))
    finally:
        if bar is not None:
            bar.close()
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger.append({"stage": stage, "unit": unit, "units": n, "world_size": w.size,
                       "by_rank": [[labels[i] for i in s] for s in shares],
                       "resumed": [labels[i] for i in range(n) if labels[i] in held]})
    if store is not None:
        return [store.done[label] for label in labels]
    return [results[i] for i in range(n)]


def _attempt(compute: Callable[[list[int]], Sequence[Any]], idx: list[int]) -> tuple[dict[str, Any], Exception | None]:
    """Run this rank's share of a round; an exception becomes a message for the other ranks."""
    if not idx:
        return {"idx": [], "out": [], "error": None}, None
    try:
        with local():
            out = list(compute(idx))
        return {"idx": idx, "out": out, "error": None}, None
    except Exception as err:  # sent to every rank; re-raised here after the gather
        text = " ".join(str(err).split())
        return {"idx": [], "out": [], "error": f"{type(err).__name__}: {text}"}, err


def _raise_failures(gathered: list[dict[str, Any]], own: Exception | None, w: World) -> None:
    failed = [(r, p["error"]) for r, p in enumerate(gathered) if p["error"] is not None]
    if not failed:
        return
    if own is not None:
        own.phaselens_rank = w.rank  # type: ignore[attr-defined]  # the CLI prints errors of this origin
        raise own
    rank, message = failed[0]
    raise RankError(f"rank {rank} of {w.size} failed: {message}", rank=rank)


def _agree(w: World, stage: str, labels: list[str], todo: list[int], per_call: int) -> None:
    """Every rank must split the same work: a rank with other items, settings or journal would deadlock
    or mix results, so a mismatch is an error on every rank."""
    digest = hashlib.sha256(repr((stage, labels, todo, per_call)).encode()).hexdigest()
    seen = gather(digest, stage=stage)
    if len(set(seen)) > 1:
        odd = [r for r, d in enumerate(seen) if d != seen[0]]
        raise DistributedError(
            f"{stage}: the ranks do not agree on the work (ranks {odd} differ from rank 0: another model, task, "
            "seed, setting or journal); launch every rank with the same arguments."
        )


# ---- collectives ------------------------------------------------------------------------------------------
_GLOO: dict[int, Any] = {}


def _object_group() -> Any:
    """A gloo group for pickled objects (CPU), created once per process group when the default is not gloo."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _GLOO:
        _GLOO[key] = dist.new_group(backend="gloo")
    return _GLOO[key]


def gather(obj: Any, *, stage: str = "") -> list[Any]:
    """``obj`` of every rank, by rank (``[obj]`` outside a process group). A lost rank raises DistributedError."""
    w = process_world()
    if w.size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * w.size
    try:
        dist.all_gather_object(out, obj, group=_object_group())
    except RuntimeError as err:  # gloo: "Connection reset by peer", timeouts, ...
        # gloo prefixes its source location ("[.../pair.cc:537] Read error ..."): keep the first sentence
        why = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(err).split())).split(". ")[0][:160]
        raise DistributedError(
            f"{stage or 'gather'}: lost contact with another rank ({why}); a rank was killed or crashed. Every "
            "unit finished before is in the journal (if one was given): rerun, with any number of processes, "
            "to resume."
        ) from None
    return out


def open_journal(path: Any, fingerprint: str, fields: tuple[str, ...] | None) -> Any:
    """A :class:`~phaselens.storage.journal.CellJournal` shared by the ranks.

    Only rank 0 reads and writes ``path``; the others hold its finished units in memory (they need no
    shared file system). A damaged file, or one of another run, raises on rank 0 and a RankError elsewhere.
    """
    from phaselens.storage.journal import CellJournal

    w = world()
    if w.size == 1:
        return CellJournal(path, fingerprint, fields)
    journal, err, payload = None, None, None
    if w.main:
        try:
            journal = CellJournal(path, fingerprint, fields)
            payload = journal.done
        except Exception as e:
            err, payload = e, f"{type(e).__name__}: {' '.join(str(e).split())}"
    seen = gather((fingerprint, payload), stage="journal")
    if len({fp for fp, _ in seen}) > 1:
        raise DistributedError("the ranks computed different fingerprints for this run (another model, items or "
                               "setting on some rank); launch every rank with the same arguments.")
    done = seen[0][1]
    if isinstance(done, str):
        if err is not None:
            err.phaselens_rank = 0  # type: ignore[attr-defined]
            raise err
        raise RankError(f"rank 0 of {w.size} failed: {done}", rank=0)
    if journal is None:
        journal = CellJournal(None, fingerprint, fields)
        journal.done = dict(done)
    return journal


# ---- metadata -----------------------------------------------------------------------------------------------
def sharded(fn: F) -> F:
    """Decorate an analysis: its result's ``metadata`` gets ``world_size`` and ``shards`` (one entry per
    :func:`shard_map` call: ``stage``, ``unit``, ``units``, ``by_rank`` (labels each rank computed) and
    ``resumed`` (labels read from a journal))."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = _LEDGER.set([])
        try:
            result = fn(*args, **kwargs)
            ledger = _LEDGER.get() or []
        finally:
            _LEDGER.reset(token)
        meta = getattr(result, "metadata", None)
        if isinstance(meta, dict):
            meta["world_size"] = world().size
            meta["shards"] = ledger
        return result

    return wrapper  # type: ignore[return-value]


def relayed(err: BaseException) -> bool:
    """Whether ``err`` only relays another rank's failure (that rank reports it; the CLI stays quiet)."""
    return isinstance(err, RankError)



# ---- joining the process group torchrun describes ------------------------------------------------------------
def init_from_env(gpus_per_replica: int = 1) -> World:
    """Join the process group that torchrun's environment describes (``WORLD_SIZE`` > 1), if not joined yet.

    NCCL with this rank's first GPU as the current device when CUDA is available (see
    :func:`phaselens.parallel.replicas.replica_gpus`), gloo otherwise. Without ``WORLD_SIZE`` > 1 nothing happens.
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return process_world()
    import atexit

    import torch
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return process_world()
    backend = "gloo"
    if torch.cuda.is_available():
        from phaselens.parallel.replicas import replica_gpus

        torch.cuda.set_device(replica_gpus(gpus_per_replica)[0])
        backend = "nccl"
    dist.init_process_group(backend)
    atexit.register(_leave)
    return process_world()


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["World", "assignment", "block_labels", "gather", "is_main_process", "item_blocks", "local",
           "init_from_env", "open_journal", "process_world", "relayed", "shard_map", "sharded", "world"]
