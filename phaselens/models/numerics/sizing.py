"""Bytes, for memory estimates: of what a module holds (one element of a dtype is ``dtype.itemsize``); and
building a model from a config whose sizes are too large for torch to address."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from phaselens.errors import CheckpointError


def held_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` as held (packed bytes as bytes; a meta-device module
    counts the same as a materialised one)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@contextlib.contextmanager
def addressable(where: str) -> Iterator[None]:
    """Build a model from the config at ``where``: torch's "Storage size calculation overflowed" (sizes, each
    within bounds, whose product exceeds the 2^63 bytes torch can address) becomes a :class:`CheckpointError`
    naming the config, before anything is allocated (the build is on the meta device)."""
    try:
        yield
    except RuntimeError as err:
        if "overflow" not in str(err).lower():
            raise
        raise CheckpointError(f"{where}: its sizes multiply to a tensor of more than 2^63 bytes, which torch cannot "
                              f"address ({err}); restore it from the checkpoint's source (or fix the field that is "
                              "out of proportion).") from None
