"""Training batches for next-token prediction on a task's answer positions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from phaselens.errors import TaskError

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


@dataclass(frozen=True, eq=False)
class TrainingBatch:
    """B training sequences with the positions to train on.

    Attributes:
        tokens: ``[B, T]`` int64 inputs.
        targets: ``[B, T]`` int64; at masked positions the token the model must predict *next* (so
            ``logits[:, t]`` is scored against ``targets[:, t]``), elsewhere ``-100``.
        loss_mask: ``[B, T]`` bool, True where ``targets`` is set.
        residue: ``[B]`` int64 residue of each item's target key.
        t_key: ``[B]`` int64 slot of each item's target key.

    Use ``F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())`` (the -100 entries are ignored)
    or ``F.cross_entropy(logits[batch.loss_mask], batch.targets[batch.loss_mask])``. The batch unpacks as
    ``tokens, targets = batch``, so ``task.sample_training_batch`` can serve as a ``(batch_size, seed)``
    batch function directly.
    """

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    residue: torch.Tensor
    t_key: torch.Tensor

    def to(self, device: str | torch.device) -> TrainingBatch:
        return replace(
            self,
            **{
                k: getattr(self, k).to(device) for k in ("tokens", "targets", "loss_mask", "residue", "t_key")
            },
        )

    def __iter__(self) -> Iterator[torch.Tensor]:
        """Unpack as ``tokens, targets``, the ``batch_fn`` convention of :func:`phaselens.train.loop`."""
        return iter((self.tokens, self.targets))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __repr__(self) -> str:
        b, t = self.tokens.shape
        return f"TrainingBatch(B={b}, T={t}, {int(self.loss_mask.sum())} trained positions)"


def numpy_rng(generator: torch.Generator | np.random.Generator | int | None) -> np.random.Generator:
    """A NumPy Generator from a torch Generator (advanced by one draw), a NumPy Generator, a seed, or None."""
    if generator is None:
        return np.random.default_rng()
    if isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, torch.Generator):
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        return np.random.default_rng(seed)
    if isinstance(generator, int | np.integer) and not isinstance(generator, bool):
        return np.random.default_rng(int(generator))
    raise TaskError(
        f"generator must be a torch/NumPy Generator, an int seed or None, got {type(generator).__name__}."
    )
