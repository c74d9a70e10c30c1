"""Phase geometry of a chunked KV compressor: ``PhaseSpec``.

A chunked compressor writes one cache **entry** every ``stride`` (S) slots; each entry pools the
``window`` (W, a multiple of S) slots that end at its stride boundary. Positions are cache slots
``t``; the **origin** is the slot where compression block 0 begins. With ``u = t - origin``::

    entry j covers   origin + [j*S + S - W, j*S + S - 1]   (clipped at origin)
    query t sees j   iff  j < (u + 1) // S                 (its window is complete)
    phase(t)       = u mod S
    residue(t, M)  = u mod M                               (M a multiple of S)

Every method is vectorised: it takes a Python int, a NumPy array or a torch tensor of positions and
returns the same kind of object (ints stay ints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from phaselens.errors import PhaseGeometryError

Positions = Any  # int | np.ndarray | torch.Tensor; kept loose because the methods preserve the input kind.


class TokenRange(NamedTuple):
    """A half-open range of cache slots ``[start, stop)``."""

    start: Any
    stop: Any


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _as_array(t: Positions) -> tuple[Any, str]:
    """Return ``t`` as an integer array/tensor plus a tag that says how to give it back."""
    if isinstance(t, torch.Tensor):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise PhaseGeometryError(f"positions must be integers, got a {t.dtype} tensor; cast with .long().")
        return t, "torch"
    if _is_int(t):
        return np.asarray(int(t), dtype=np.int64), "int"
    arr = np.asarray(t)
    if arr.dtype.kind not in "iu":
        raise PhaseGeometryError(
            f"positions must be integers, got dtype {arr.dtype}; pass ints or an integer array."
        )
    return arr.astype(np.int64, copy=False), "numpy"


def _back(x: Any, kind: str) -> Any:
    if kind == "int":
        return int(x) if np.ndim(x) == 0 else x
    return x


@dataclass(frozen=True)
class PhaseSpec:
    """Where cache entries start and end for one compressed layer.

    Args:
        stride: S, slots between consecutive entries (>= 1).
        window: W, slots pooled by one entry; defaults to ``stride`` and must be a positive multiple of it.
            ``W = 2S`` is DeepSeek-V4's overlapping CSA layout.
        origin: the cache slot where compression block 0 begins (>= 0). It is 0 unless a prefix was cached
            uncompressed; BOS and chat-template tokens count as slots.

    Example:
        >>> spec = PhaseSpec(4, 8)
        >>> spec.phase(13), spec.visible_entries(13), spec.entries_containing(13)
        (1, 3, [3, 4])
    """

    stride: int
    window: int | None = None
    origin: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.stride) or self.stride < 1:
            raise PhaseGeometryError(f"stride must be an integer >= 1, got {self.stride!r}; e.g. PhaseSpec(4).")
        if self.window is None:
            object.__setattr__(self, "window", int(self.stride))
        if not _is_int(self.window) or self.window < 1 or self.window % self.stride:
            raise PhaseGeometryError(
                f"window must be a positive multiple of the stride {self.stride}, got {self.window!r}; "
                f"use window={self.stride} (no overlap) or window={2 * self.stride} (DeepSeek-V4 CSA)."
            )
        if not _is_int(self.origin) or self.origin < 0:
            raise PhaseGeometryError(
                f"origin must be an integer >= 0 (the slot where block 0 begins), got {self.origin!r}."
            )
        object.__setattr__(self, "stride", int(self.stride))
        object.__setattr__(self, "window", int(self.window))
        object.__setattr__(self, "origin", int(self.origin))

    # ---- derived constants -------------------------------------------------------------------------
    @property
    def blocks_per_window(self) -> int:
        """k = W / S: how many entries contain each token."""
        return self.window // self.stride

    @property
    def boundary_phase(self) -> int:
        """S - 1: the last slot of a stride block; the next slot starts a new entry."""
        return self.stride - 1

    @property
    def overlapping(self) -> bool:
        return self.window > self.stride

    # ---- per-position quantities -------------------------------------------------------------------
    def _u(self, t: Positions) -> tuple[Any, str]:
        arr, kind = _as_array(t)
        u = arr - self.origin
        if (u < 0).any():
            bad = int(arr.min())
            raise PhaseGeometryError(
                f"position {bad} is before the origin {self.origin}; positions are cache slots >= origin "
                f"(use PhaseSpec(..., origin={bad}) if compression starts earlier)."
            )
        return u, kind

    def phase(self, t: Positions) -> Positions:
        """(t - origin) mod S."""
        u, kind = self._u(t)
        return _back(u % self.stride, kind)

    def residue(self, t: Positions, modulus: int) -> Positions:
        """(t - origin) mod M, for M a positive multiple of the stride."""
        if not _is_int(modulus) or modulus < 1 or modulus % self.stride:
            raise PhaseGeometryError(
                f"modulus must be a positive multiple of the stride {self.stride}, got {modulus!r}; "
                f"e.g. modulus={2 * self.stride}."
            )
        u, kind = self._u(t)
        return _back(u % modulus, kind)

    def is_boundary(self, t: Positions) -> Positions:
        """True where t sits at the boundary phase S - 1."""
        u, kind = self._u(t)
        out = (u % self.stride) == self.boundary_phase
        return bool(out) if kind == "int" else out

    def visible_entries(self, t: Positions) -> Positions:
        """How many entries a query at t sees: (u + 1) // S (entries 0 .. that - 1)."""
        u, kind = self._u(t)
        return _back((u + 1) // self.stride, kind)

    def entries_containing(self, t: Positions) -> Positions:
        """Indices of the W/S entries whose window contains t, ascending. Shape ``[..., W/S]``.

        For an int input, a list of ints.
        """
        u, kind = self._u(t)
        k = self.blocks_per_window
        first = u // self.stride
        if kind == "torch":
            out = first.unsqueeze(-1) + torch.arange(k, device=first.device)
        else:
            out = first[..., None] + np.arange(k)
        return out.tolist() if kind == "int" else out

    def offsets(self, t: Positions) -> Positions:
        """The slot of t inside each entry of :meth:`entries_containing`, in ``[0, W)``. Shape ``[..., W/S]``.

        Offsets count from the unclipped window start, so a slot before the origin keeps its index (and is
        simply empty), as in DeepSeek-V4 where entry 0's previous-block slots get weight 0.
        """
        u, kind = self._u(t)
        k = self.blocks_per_window
        p = u % self.stride
        if kind == "torch":
            m = torch.arange(k, device=p.device)
            out = (k - 1 - m) * self.stride + p.unsqueeze(-1)
        else:
            out = (k - 1 - np.arange(k)) * self.stride + p[..., None]
        return out.tolist() if kind == "int" else out

    # ---- per-entry quantities ----------------------------------------------------------------------
    def _j(self, j: Positions) -> tuple[Any, str]:
        arr, kind = _as_array(j)
        if (arr < 0).any():
            raise PhaseGeometryError(f"entry indices are >= 0, got {int(arr.min())}.")
        return arr, kind

    def window_of(self, j: Positions) -> TokenRange:
        """Slots pooled by entry j, as a half-open ``TokenRange(start, stop)`` clipped at the origin."""
        arr, kind = self._j(j)
        raw = arr * self.stride + self.stride - self.window
        start = raw.clamp(min=0) if kind == "torch" else np.maximum(raw, 0)
        stop = arr * self.stride + self.stride
        return TokenRange(_back(start + self.origin, kind), _back(stop + self.origin, kind))

    def completes_at(self, j: Positions) -> Positions:
        """The slot at which entry j becomes visible: its last slot, origin + jS + S - 1."""
        arr, kind = self._j(j)
        return _back(self.origin + arr * self.stride + self.stride - 1, kind)

    def rope_position(self, j: Positions) -> Positions:
        """The position an entry is rotated at: the first slot of its own stride block, origin + jS."""
        arr, kind = self._j(j)
        return _back(self.origin + arr * self.stride, kind)

    def with_origin(self, origin: int) -> PhaseSpec:
        return PhaseSpec(self.stride, self.window, origin)

    def __str__(self) -> str:
        extra = f", origin={self.origin}" if self.origin else ""
        kind = "overlapping" if self.overlapping else "disjoint"
        return f"PhaseSpec(stride={self.stride}, window={self.window}{extra}; {kind}, boundary phase {self.boundary_phase})"
