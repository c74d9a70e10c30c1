"""Where this process stands among ``torch.distributed`` ranks: the world analyses split work over.

Outside a process group every process is ``World(0, 1)``. Inside :func:`local`, analyses run on this rank
alone. Progress bars and output writers ask :func:`is_main_process`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

_LOCAL: ContextVar[bool] = ContextVar("phaselens_rank_local", default=False)


@dataclass(frozen=True)
class World:
    """This process's place in the process group: ``rank`` of ``size`` (``World(0, 1)`` outside one)."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def process_world() -> World:
    """The process group's rank and size (``World(0, 1)`` when torch.distributed is not initialized)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size())


def world() -> World:
    """The world analyses split work over: :func:`process_world`, or ``World(0, 1)`` inside :func:`local`."""
    return World() if _LOCAL.get() else process_world()


def is_main_process() -> bool:
    """True outside a process group and on rank 0: the process that writes outputs and shows progress."""
    return process_world().main


def check_world_env(env: Mapping[str, str]) -> None:
    """Refuse a torchrun environment that does not describe a process group: ``WORLD_SIZE`` >= 1, ``RANK``
    in ``0..WORLD_SIZE-1``, ``LOCAL_RANK`` >= 0 (each a whole number when set)."""
    from phaselens.errors import InputError

    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        raw = env.get(name)
        if raw in (None, ""):
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            raise InputError(f"the environment variable {name}={raw!r} is not a whole number; torchrun sets it "
                             "(unset it to run one process).") from None
    size = values.get("WORLD_SIZE", 1)
    if size < 1:
        raise InputError(f"WORLD_SIZE={size}: a process group has at least one process; unset it or launch with "
                         "torchrun --nproc-per-node N.")
    rank = values.get("RANK", 0)
    if not 0 <= rank < size:
        raise InputError(f"RANK={rank} is outside 0..{size - 1} (WORLD_SIZE={size}); launch with torchrun, which "
                         "sets both.")
    if values.get("LOCAL_RANK", 0) < 0:
        raise InputError(f"LOCAL_RANK={values['LOCAL_RANK']} is negative; launch with torchrun.")


@contextmanager
def local() -> Iterator[None]:
    """Run the block on this rank alone: analyses called inside do not split their work (no collectives)."""
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)
