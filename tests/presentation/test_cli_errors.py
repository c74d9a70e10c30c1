"""Whatever a command meets becomes one line that says what happened (round 4: out-of-memory errors that
the CLI did not recognise were "internal error")."""

from __future__ import annotations

import errno

import pytest
import torch

import phaselens
from phaselens.presentation.cli.common import as_phaselens_error


def _cpu_allocator_failure() -> RuntimeError:
    try:  # the CPU allocator's own refusal, provoked for real (no memory is touched: the size is refused first)
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("torch allocated 4 EiB")


@pytest.mark.parametrize("make", [
    lambda: MemoryError(),
    _cpu_allocator_failure,
    lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    lambda: RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
])
def test_every_out_of_memory_is_a_resource_error_that_names_the_fix(make):
    err = as_phaselens_error(make())
    assert isinstance(err, phaselens.errors.ResourceError)
    assert "ran out of memory" in str(err) and "smaller" in str(err)


@pytest.mark.parametrize("code, cls, said", [
    (errno.EACCES, phaselens.errors.OutputError, "permission denied"),
    (errno.EROFS, phaselens.errors.OutputError, "read-only"),
    (errno.ENOSPC, phaselens.errors.OutputError, "disk is full"),
])
def test_the_os_refusals_are_output_errors_in_words(code, cls, said):
    err = as_phaselens_error(OSError(code, "x", "/some/where"))
    assert isinstance(err, cls) and said in str(err).lower()


def test_an_unknown_error_is_an_internal_error_to_report():
    err = as_phaselens_error(ZeroDivisionError("division by zero"))
    assert "internal error" in str(err) and "--debug" in str(err)


def _rank(rank: int, port: int, queue) -> None:
    """One of two gloo ranks: rank 1 dies after the first all-reduce, rank 0 reports what its next one raised."""
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    t = torch.ones(2)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(1)  # a crash: no clean-up, no message
    try:
        dist.all_reduce(t)
        queue.put(None)
    except Exception as err:  # noqa: BLE001 (the test classifies it)
        queue.put(err)


def test_a_dead_peer_is_named_as_such_not_an_internal_error(monkeypatch):
    """Round 2 of the cluster issue: when one rank died, the other printed 'internal error ... please report it'.
    The error is the one gloo really raises on the surviving rank."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    raised = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    assert raised is not None, "the all-reduce with a dead peer did not fail"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = as_phaselens_error(raised)
    assert isinstance(err, phaselens.errors.DistributedError), (type(raised), str(raised)[:200])
    assert "rank 0 of 2: another rank died or lost contact" in str(err) and "resumes" in str(err)
