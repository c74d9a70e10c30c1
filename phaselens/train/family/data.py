"""Training data of the family: the paper's task generated on the fly, optionally mixed with a user's own
pretraining tokens read from memory-mapped files. Nothing is downloaded.

A batch is a pure function of ``(batch_size, seed)`` (:func:`phaselens.train`'s ``batch_fn`` convention), so a
run resumes bit-identically and every rank of a distributed run can build the same global batch and take its
rows. Of the ``B`` rows, ``round(ratio * B)`` are windows of the user's tokens (every position trained on the
next token) and the rest are task items split evenly over the task variants (only the answer and the
demonstrations' values are trained); the rows are then shuffled so that every rank gets a share of each.
Every row has the task's length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phaselens.errors import InputError
from phaselens.tasks import KVRecall

DTYPES = ("uint16", "uint32", "int32", "int64")


@dataclass(frozen=True)
class TokenFiles:
    """A user's pretraining tokens: flat files of token ids, read through ``numpy`` memory maps.

    Args:
        paths: ``.npy`` files (their dtype is read from the header; ``allow_pickle`` stays off) or raw binary
            files of ``dtype`` ids (e.g. nanoGPT's ``train.bin``, ``uint16``).
        dtype: the id type of raw files.

    Windows never cross a file boundary. Each file must hold more ids than one window.
    """

    paths: tuple[str, ...]
    dtype: str = "uint16"

    def __post_init__(self) -> None:
        if isinstance(self.paths, str | os.PathLike):
            object.__setattr__(self, "paths", (self.paths,))
        object.__setattr__(self, "paths", tuple(str(Path(p).expanduser()) for p in self.paths))
        if not self.paths:
            raise InputError("TokenFiles needs at least one file of token ids.")
        if self.dtype not in DTYPES:
            raise InputError(f"token file dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        for p in self.paths:
            if not Path(p).is_file():
                raise InputError(f"token file {p} does not exist; pass files of token ids (.npy or raw {self.dtype}).")

    def arrays(self) -> list[np.ndarray]:
        """One read-only memory map per file, 1-D."""
        out = []
        for p in self.paths:
            try:
                arr = np.load(p, mmap_mode="r", allow_pickle=False) if p.endswith(".npy") else \
                    np.memmap(p, dtype=self.dtype, mode="r")
            except (ValueError, OSError) as err:
                raise InputError(f"token file {p} cannot be read as ids ({err}); write a 1-D .npy of integers or "
                                 f"a raw file of {self.dtype}.") from None
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise InputError(f"token file {p} holds a {arr.ndim}-D {arr.dtype} array; it must be 1-D integer ids.")
            out.append(arr)
        return out

    def describe(self) -> dict[str, object]:
        """What identifies the data (for a run's fingerprint): each file's name, size and a digest of its ends."""
        out = []
        for p, arr in zip(self.paths, self.arrays()):
            h = hashlib.sha256(np.ascontiguousarray(arr[:4096]).tobytes())
            h.update(np.ascontiguousarray(arr[-4096:]).tobytes())
            out.append({"name": Path(p).name, "n": int(arr.size), "dtype": str(arr.dtype), "ends": h.hexdigest()[:16]})
        return {"files": out}

    def windows(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``[n, length]`` int64 windows at uniformly random starts (every valid start equally likely)."""
        arrays = self.arrays()
        valid = np.array([max(0, a.size - length + 1) for a in arrays], dtype=np.int64)
        if valid.sum() == 0:
            raise InputError(f"the token files hold no window of {length} ids (sizes "
                             f"{[int(a.size) for a in arrays]}); supply longer files.")
        flat = rng.integers(0, int(valid.sum()), n)
        ends = np.cumsum(valid)
        which = np.searchsorted(ends, flat, side="right")
        starts = flat - (ends[which] - valid[which])
        out = np.empty((n, length), dtype=np.int64)
        for f in np.unique(which):  # one gather per file (files are few)
            rows = np.flatnonzero(which == f)
            out[rows] = arrays[f][starts[rows, None] + np.arange(length)]
        return out


@dataclass(frozen=True)
class FamilyData:
    """The family's ``batch_fn``: a mixture of task variants of one length, plus ``ratio`` of user tokens, after
    an optional warm-up on shorter items.

    Args:
        tasks: the task variants (:func:`~phaselens.train.family.recipes.training_tasks`), all of one sequence
            length; each batch takes an equal share of its task rows from each (the first ones take the remainder).
        pretraining: the user's token files, or None.
        ratio: the fraction of each batch's rows (and so of its tokens) taken from ``pretraining``.
        d_vocab: the model's vocabulary; a user token at or above it is an :class:`InputError`.
        warmup: task variants of one (shorter) length used instead of ``tasks`` for the first ``warmup_steps``
            steps (a sequence-length warm-up; user rows are cut to that length too); KVRecall or
            :class:`~phaselens.tasks.induction.RepeatedSegments`.
        warmup_steps: how many steps use ``warmup``.

    Called as ``data(batch_size, seed, step)`` (``uses_step``: :func:`phaselens.train.loop.train`'s convention).
    """

    tasks: tuple[Any, ...]
    pretraining: TokenFiles | None = None
    ratio: float = 0.0
    d_vocab: int | None = None
    warmup: tuple[Any, ...] = ()
    warmup_steps: int = 0

    uses_step = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        object.__setattr__(self, "warmup", tuple(self.warmup))
        if not self.tasks:
            raise InputError("FamilyData needs at least one task.")
        if not (isinstance(self.ratio, int | float) and 0.0 <= self.ratio < 1.0):
            raise InputError(f"the pretraining ratio must lie in [0, 1), got {self.ratio!r}: at least some rows are "
                             "the task's.")
        if self.ratio > 0 and self.pretraining is None:
            raise InputError("a pretraining ratio > 0 needs token files (--pretrain FILE).")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0 or (self.warmup_steps and not self.warmup):
            raise InputError(f"warmup_steps must be an int >= 0, with warm-up tasks when > 0; got {self.warmup_steps!r}.")
        for group in (self.tasks, self.warmup):
            if len({_length(t) for t in group}) > 1:
                raise InputError(f"task variants used together must give items of one length, got "
                                 f"{[_length(t) for t in group]}.")

    @property
    def seq_len(self) -> int:
        """The length of every row after the warm-up."""
        return _length(self.tasks[0])

    def seq_len_at(self, step: int) -> int:
        return _length(self.warmup[0]) if step < self.warmup_steps else self.seq_len

    def tokens_until(self, steps: int, batch_size: int) -> int:
        """Tokens processed by ``steps`` steps of ``batch_size`` rows."""
        warm = min(steps, self.warmup_steps)
        return batch_size * (warm * (self.seq_len_at(0) if warm else 0) + (steps - warm) * self.seq_len)

    def describe(self) -> dict[str, object]:
        return {"tasks": [_describe(t) for t in self.tasks], "ratio": self.ratio,
                "warmup": [_describe(t) for t in self.warmup], "warmup_steps": self.warmup_steps,
                "pretraining": self.pretraining.describe() if self.pretraining is not None else None}

    def __call__(self, batch_size: int, seed: int, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, T], targets [B, T])`` of the batch drawn with ``seed`` at ``step`` (None: after warm-up)."""
        rng = np.random.default_rng(seed)
        tasks = self.warmup if step is not None and step < self.warmup_steps else self.tasks
        length = _length(tasks[0])
        n_pre = int(round(self.ratio * batch_size)) if self.pretraining is not None else 0
        share, extra = divmod(batch_size - n_pre, len(tasks))
        parts_t, parts_g = [], []
        for i, task in enumerate(tasks):
            n = share + (i < extra)
            if n:
                # KVRecall draws from the NumPy generator; RepeatedSegments takes an int seed drawn from it
                tokens, targets = task.sample_training_batch(
                    n, rng if isinstance(task, KVRecall) else int(rng.integers(2**62)))
                parts_t.append(tokens)
                parts_g.append(targets)
        if n_pre:
            assert self.pretraining is not None
            win = self.pretraining.windows(rng, n_pre, length + 1)
            if self.d_vocab is not None and int(win.max()) >= self.d_vocab:
                raise InputError(f"a pretraining token id ({int(win.max())}) is outside the model's vocabulary "
                                 f"0..{self.d_vocab - 1}; train a size with a larger vocabulary (--vocab N).")
            parts_t.append(torch.from_numpy(win[:, :-1].copy()))
            parts_g.append(torch.from_numpy(win[:, 1:].copy()))
        tokens, targets = torch.cat(parts_t), torch.cat(parts_g)
        order = torch.from_numpy(rng.permutation(batch_size))
        return tokens[order], targets[order]


def _length(task: Any) -> int:
    """Tokens per row of a task (KVRecall's ``seq_len()``, RepeatedSegments' ``seq_len``)."""
    return task.seq_len() if callable(task.seq_len) else int(task.seq_len)


def _describe(task: Any) -> dict[str, Any]:
    return task.to_dict() if hasattr(task, "to_dict") else {"kind": type(task).__name__, **dataclasses.asdict(task)}
