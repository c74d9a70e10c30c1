"""Generic induction data: random tokens in which one segment recurs later, at a random distance.

A full-attention model must learn a two-layer induction circuit to solve :class:`KVRecall` (a compressed
model needs only one hop: its entries pool a key with its value). On KVRecall alone the signal is five
answer positions per sequence, and a small full-attention model sits on the "copy some value" plateau for
thousands of steps. On this data every token of the repeat is trained, and the circuit forms in under a
thousand steps (the zoo's control: loss 4.8 -> 0.2 by warm-up step 700, in its card's loss curve); because the distance between the two copies varies, only a content-based (induction) head
solves it, not a fixed positional offset. The zoo's control warms up on it (see ``docs/zoo.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phaselens.errors import TaskError
from phaselens.tasks.lm_batches import IGNORE_INDEX
from phaselens.tasks.residues import check_positive


@dataclass(frozen=True)
class RepeatedSegments:
    """Sequences of ``seq_len`` uniform random tokens; ``segment`` of them recur once, later.

    Args:
        vocab_size: tokens are drawn from ``0..vocab_size-1``.
        seq_len: T.
        segment: length of the repeated segment; the second copy starts anywhere after the first ends.

    Example:
        >>> tokens, targets = RepeatedSegments(50, seq_len=32, segment=8).sample_training_batch(4, seed=0)
        >>> tokens.shape, int((targets != -100).sum(1)[0])
        (torch.Size([4, 32]), 7)
    """

    vocab_size: int
    seq_len: int = 96
    segment: int = 24

    def __post_init__(self) -> None:
        check_positive("vocab_size", self.vocab_size, 2)
        check_positive("segment", self.segment, 2)
        check_positive("seq_len", self.seq_len, 1)
        if self.seq_len < 2 * self.segment + 1:
            raise TaskError(
                f"seq_len={self.seq_len} cannot hold two copies of a {self.segment}-token segment and a "
                f"token before them; use seq_len >= {2 * self.segment + 1} or a shorter segment."
            )

    def sample_training_batch(self, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, T], targets [B, T])``, deterministic in ``seed``.

        ``targets[b, t]`` is the next token at every position of the second copy except its last (where the
        next token is random), and ``-100`` elsewhere: the ``batch_fn`` convention of :func:`phaselens.train.loop`.
        """
        check_positive("batch_size", batch_size, 1)
        g = torch.Generator().manual_seed(int(seed))
        B, T, n = batch_size, self.seq_len, self.segment
        tokens = torch.randint(0, self.vocab_size, (B, T), generator=g)
        src = torch.randint(0, T - 2 * n, (B,), generator=g)  # first copy: src .. src + n - 1
        slack = T - 2 * n - src  # room left after the first copy (>= 1)
        dst = src + n + (torch.rand(B, generator=g) * slack).long()  # second copy ends by T - 1
        rows = torch.arange(B)[:, None]
        offs = torch.arange(n)
        tokens[rows, dst[:, None] + offs] = tokens[rows, src[:, None] + offs]
        targets = torch.full_like(tokens, IGNORE_INDEX)
        targets[rows, dst[:, None] + offs[:-1]] = tokens[rows, dst[:, None] + offs[1:]]
        return tokens, targets
