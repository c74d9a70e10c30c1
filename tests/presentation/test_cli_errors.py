"""Whatever a command meets becomes one line that says what happened (round 4: out-of-memory errors that
the CLI did not recognise were "internal error")."""

from __future__ import annotations

import errno

import pytest
import torch

import phaselens
from phaselens.presentation.cli.base import as_phaselens_error


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
    assert isinstance(err, phaselens.ResourceError)
    assert "ran out of memory" in str(err) and "smaller" in str(err)


@pytest.mark.parametrize("code, cls, said", [
    (errno.EACCES, phaselens.OutputError, "permission denied"),
    (errno.EROFS, phaselens.OutputError, "read-only"),
    (errno.ENOSPC, phaselens.OutputError, "disk is full"),
])
def test_the_os_refusals_are_output_errors_in_words(code, cls, said):
    err = as_phaselens_error(OSError(code, "x", "/some/where"))
    assert isinstance(err, cls) and said in str(err).lower()


def test_an_unknown_error_is_an_internal_error_to_report():
    err = as_phaselens_error(ZeroDivisionError("division by zero"))
    assert "internal error" in str(err) and "--debug" in str(err)
