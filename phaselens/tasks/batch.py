"""``TaskBatch``: the tensors and per-item table that every task's ``build`` returns.

Sequences are **right-padded** with ``pad_id`` when items differ in length. Left padding is never used,
because it would move every token to a different cache slot and so change its phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import BatchIndexError, ContextLengthError, TaskError

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True, eq=False, repr=False)
class TaskBatch:
    """N phase-annotated items, ready for a forward pass.

    Attributes:
        tokens: ``[N, T]`` int64 token ids, right-padded with ``pad_id``.
        lengths: ``[N]`` int64 number of real tokens per item.
        query_pos: ``[N]`` int64 position whose next-token logits are scored (usually ``lengths - 1``).
        answer: ``[N]`` int64 correct next token.
        wrong: ``[N]`` int64 distractor token, for logit differences ``logit[answer] - logit[wrong]``.
        corrupted: ``[N, T]`` int64 twin of ``tokens`` with the target's value replaced by ``wrong``: in the
            twin the right answer is ``wrong``. Same lengths and query positions.
        frame: one row per item; at least ``item_id, residue, phase, t_K, t_V, key_entries, value_entries,
            boundary, shared_entry, query_phase`` (see ``docs/tasks.md``).
        spec: the PhaseSpec the items were placed for.
        modulus: M; ``frame.residue`` is ``(t_K - spec.origin) mod M``.
        pad_id: the id used for right padding.
        task: short name of the task that built the batch (for the repr).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    query_pos: torch.Tensor
    answer: torch.Tensor
    wrong: torch.Tensor
    corrupted: torch.Tensor
    frame: pd.DataFrame
    spec: PhaseSpec
    modulus: int
    pad_id: int = 0
    task: str = ""

    def __post_init__(self) -> None:
        n, t = self.tokens.shape if self.tokens.ndim == 2 else (-1, -1)
        if n < 0:
            raise TaskError(f"tokens must be [N, T], got shape {tuple(self.tokens.shape)}.")
        for name in ("lengths", "query_pos", "answer", "wrong"):
            x = getattr(self, name)
            if tuple(x.shape) != (n,):
                raise TaskError(f"{name} must have shape [{n}], got {tuple(x.shape)}.")
        if tuple(self.corrupted.shape) != (n, t):
            raise TaskError(
                f"corrupted must match tokens' shape {(n, t)}, got {tuple(self.corrupted.shape)}."
            )
        for name in ("tokens", "lengths", "query_pos", "answer", "wrong", "corrupted"):
            if getattr(self, name).dtype != torch.long:
                raise TaskError(f"{name} must be int64 (LongTensor), got {getattr(self, name).dtype}.")
        if len(self.frame) != n:
            raise TaskError(f"frame has {len(self.frame)} rows for {n} items; keep one row per item.")
        if n and (bool((self.query_pos >= self.lengths).any()) or int(self.lengths.max()) > t):
            raise TaskError("query_pos must lie inside each item (query_pos < lengths <= T).")

    # ---- container protocol ------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """T, the padded length."""
        return int(self.tokens.shape[1])

    def _rows(self, idx: Index) -> torch.Tensor:
        n = len(self)
        kinds = "index with an int, a slice, a 1-D integer sequence/tensor or a boolean mask"
        if isinstance(idx, bool | np.bool_):
            raise BatchIndexError(f"{kinds}, not the bool {idx!r}.")
        if isinstance(idx, int | np.integer):
            i = int(idx)
            if not -n <= i < n:
                raise BatchIndexError(f"item {i} out of range for a batch of {n} (valid: {-n}..{n - 1}).")
            return torch.tensor([i % n], dtype=torch.long)
        if isinstance(idx, slice):  # any step, reversed too: the rows a list of n items would give
            try:
                picked = range(n)[idx]
            except (TypeError, ValueError) as err:  # a zero step, a non-integer bound
                raise BatchIndexError(f"{kinds}; the slice {idx!r} is not one ({err}).") from None
            return torch.tensor(list(picked), dtype=torch.long)
        try:
            rows = torch.as_tensor(np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx))
        except (TypeError, ValueError, RuntimeError):
            raise BatchIndexError(f"{kinds}; got {type(idx).__name__} {idx!r:.60}.") from None
        if rows.ndim == 1 and rows.numel() == 0:
            return rows.long()  # [] is read as float by numpy; it selects nothing either way
        if rows.dtype == torch.bool:
            if rows.shape != (n,):
                raise BatchIndexError(f"a boolean mask must have shape [{n}], got {tuple(rows.shape)}.")
            return rows.nonzero().flatten()
        if rows.ndim != 1 or rows.is_floating_point() or rows.is_complex():
            raise BatchIndexError(f"{kinds}; got {type(idx).__name__} {idx!r:.60}.")
        rows = rows.long()
        if rows.numel() and (int(rows.min()) < -n or int(rows.max()) >= n):
            raise BatchIndexError(f"index out of range for a batch of {n} items (valid: {-n}..{n - 1}).")
        return rows % max(n, 1)

    def subset(self, idx: Index) -> TaskBatch:
        """The items at ``idx`` (int, slice, integer sequence/array/tensor or boolean mask) as a new batch.

        The padded length is trimmed to the longest selected item; positions are unchanged.
        """
        rows = self._rows(idx)
        lengths = self.lengths[rows.to(self.lengths.device)]
        t = int(lengths.max()) if rows.numel() else 0
        dev_rows = rows.to(self.tokens.device)
        return replace(
            self,
            tokens=self.tokens[dev_rows, :t],
            lengths=lengths,
            query_pos=self.query_pos[dev_rows],
            answer=self.answer[dev_rows],
            wrong=self.wrong[dev_rows],
            corrupted=self.corrupted[dev_rows, :t],
            frame=self.frame.iloc[rows.cpu().numpy()].reset_index(drop=True),
        )

    def __getitem__(self, idx: Index) -> TaskBatch:
        return self.subset(idx)

    def to(self, device: str | torch.device) -> TaskBatch:
        """A copy with every tensor on ``device`` (the frame stays in host memory)."""
        moved = {
            k: getattr(self, k).to(device)
            for k in ("tokens", "lengths", "query_pos", "answer", "wrong", "corrupted")
        }
        return replace(self, **moved)

    # ---- combining ---------------------------------------------------------------------------------
    @staticmethod
    def concat(batches: Sequence[TaskBatch]) -> TaskBatch:
        """Stack batches built for the same spec and modulus, right-padding to the longest item.

        ``item_id`` values are kept as they are; offset them yourself if the batches come from different
        builds and you need ids to stay unique.
        """
        if not batches:
            raise TaskError("concat needs at least one batch.")
        first = batches[0]
        for b in batches[1:]:
            if b.spec != first.spec or b.modulus != first.modulus:
                raise TaskError(
                    f"cannot concatenate batches built for {b.spec} mod {b.modulus} and {first.spec} mod "
                    f"{first.modulus}; residues and phases would not be comparable."
                )
        t = max(b.seq_len for b in batches)

        def pad(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, t - x.shape[1]), value=first.pad_id)

        names = {b.task for b in batches}
        return TaskBatch(
            tokens=torch.cat([pad(b.tokens) for b in batches]),
            lengths=torch.cat([b.lengths for b in batches]),
            query_pos=torch.cat([b.query_pos for b in batches]),
            answer=torch.cat([b.answer for b in batches]),
            wrong=torch.cat([b.wrong for b in batches]),
            corrupted=torch.cat([pad(b.corrupted) for b in batches]),
            frame=pd.concat([b.frame for b in batches], ignore_index=True),
            spec=first.spec,
            modulus=first.modulus,
            pad_id=first.pad_id,
            task=first.task if len(names) == 1 else "+".join(sorted(names)),
        )

    # ---- display -----------------------------------------------------------------------------------
    def __repr__(self) -> str:
        n = len(self)
        name = self.task or "task"
        if n == 0:
            return f"TaskBatch({name}: empty, {self.spec}, M={self.modulus})"
        res = self.frame["residue"] if "residue" in self.frame else pd.Series(dtype=int)
        counts = res.value_counts()
        per = (
            f"{counts.iloc[0]} per residue"
            if counts.nunique() == 1
            else f"{counts.min()}..{counts.max()} per residue"
        )
        lens = self.lengths
        length = (
            f"T={self.seq_len}" if int(lens.min()) == self.seq_len else f"T<={self.seq_len} (right-padded)"
        )
        return (
            f"TaskBatch({name}: {n} items, {length}, residues {sorted(res.unique().tolist())[:3]}"
            f"{'...' if res.nunique() > 3 else ''} of M={self.modulus} ({per}), {self.spec}, "
            f"device={self.tokens.device})"
        )


def as_long(x: Any) -> torch.Tensor:
    """``x`` (array-like) as a CPU int64 tensor."""
    return torch.as_tensor(np.asarray(x, dtype=np.int64))


def require_context(task: Any, n_ctx: int, spec: PhaseSpec | None = None) -> int:
    """Return ``task.seq_len(spec)``; ContextLengthError if it exceeds a model's context ``n_ctx``."""
    need = int(task.seq_len(spec))
    if need > n_ctx:
        name = getattr(task, "kind", type(task).__name__)
        raise ContextLengthError(
            f"{name} needs sequences of {need} tokens but the model's context is at most {n_ctx}; "
            "use fewer records, less filler or a smaller min_distance/n_cycles."
        )
    return need
