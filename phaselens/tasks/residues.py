"""Residue bookkeeping shared by every task: argument checks and the per-item geometry columns."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import ResidueError, TaskError


def check_modulus(spec: PhaseSpec, modulus: int | None) -> int:
    """The modulus M to use with ``spec``: ``None`` means 2S; otherwise M must be a positive multiple of S."""
    if not isinstance(spec, PhaseSpec):
        raise TaskError(f"build needs the PhaseSpec to place items for, got {spec!r}; pass model.analysis_spec or "
                        "e.g. phaselens.PhaseSpec(4).")
    if modulus is None:
        return 2 * spec.stride
    if not isinstance(modulus, int | np.integer) or isinstance(modulus, bool) or modulus < 1:
        raise ResidueError(f"modulus must be a positive integer, got {modulus!r}.")
    if modulus % spec.stride:
        raise ResidueError(
            f"modulus {modulus} is not a multiple of the stride {spec.stride}; residues mod {modulus} would not "
            f"determine the phase. Use e.g. modulus={spec.stride * max(1, round(modulus / spec.stride))} "
            f"or 24 (covers S = 2, 3, 4, 6, 8, 12)."
        )
    return int(modulus)


def check_residues(residues: Sequence[int] | None, modulus: int) -> np.ndarray:
    """Requested residues as a sorted-as-given int64 array ``[n_res]``; all of 0..M-1 when ``None``."""
    if residues is None:
        return np.arange(modulus, dtype=np.int64)
    if isinstance(residues, str | bytes) or not isinstance(residues, Iterable):
        one = f"; for one residue write residues=[{residues!r}]" if isinstance(residues, numbers.Integral) else ""
        raise ResidueError(f"residues must be a list of ints in 0..{modulus - 1} or None (all), got "
                           f"{residues!r}{one}.")
    arr = np.asarray(list(residues))
    if arr.size == 0:
        raise ResidueError("residues is empty; pass None for all of 0..M-1 or a non-empty list.")
    if arr.dtype.kind not in "iu":
        raise ResidueError(f"residues must be integers, got {list(residues)[:5]!r}.")
    arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= modulus)]
    if bad.size:
        raise ResidueError(
            f"residue {int(bad[0])} is outside 0..{modulus - 1} (modulus {modulus}); "
            "residues are (t_K - origin) mod M."
        )
    if np.unique(arr).size != arr.size:
        raise ResidueError(f"residues contain duplicates: {arr.tolist()}; list each residue once.")
    return arr


def check_seed(seed: Any) -> int:
    """A build's seed as a Python int >= 0 (numpy integers accepted)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63:
        raise TaskError(f"seed must be an integer >= 0 and below 2**63, got {seed!r}.")
    return int(seed)


def check_count(n_per_residue: int) -> int:
    if (
        not isinstance(n_per_residue, int | np.integer)
        or isinstance(n_per_residue, bool)
        or n_per_residue < 1
    ):
        raise TaskError(f"n_per_residue must be an integer >= 1, got {n_per_residue!r}.")
    return int(n_per_residue)


def check_positive(name: str, value: int, minimum: int = 1) -> int:
    """``value`` as a Python int; TaskError unless it is an integer (numpy ones too) >= ``minimum``."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise TaskError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def set_ints(task: Any, minimums: dict[str, int]) -> None:
    """Check the integer fields of a frozen task and store them as Python ints (so numpy integers are accepted
    and the task still serialises to JSON)."""
    for name, minimum in minimums.items():
        object.__setattr__(task, name, check_positive(name, getattr(task, name), minimum))


def set_flag(task: Any, name: str) -> None:
    """Check a boolean field of a frozen task (numpy bools accepted) and store it as a Python bool."""
    value = getattr(task, name)
    if not isinstance(value, bool | np.bool_):
        raise TaskError(f"{name} must be True or False, got {value!r}.")
    object.__setattr__(task, name, bool(value))


def check_ids(name: str, value: Any) -> tuple[int, ...] | None:
    """``None`` or a sequence of token ids (ints >= 0), as a tuple of Python ints."""
    if value is None:
        return None
    ids = tuple(value) if isinstance(value, Sequence | np.ndarray) and not isinstance(value, str) else None
    if ids is None or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TaskError(f"{name} must be None or a list of token ids (ints >= 0), got {value!r:.80}.")
    return tuple(int(i) for i in ids)


def check_target_records(value: Any) -> tuple[int, int] | None:
    """``None`` or a pair ``(lo, hi)`` of record indices, as Python ints (the range is checked by the layout)."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, Sequence | np.ndarray) and not isinstance(value, str) else ()
    if len(pair) != 2 or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in pair):
        raise TaskError(f"target_records must be None or a pair (lo, hi) of record indices, got {value!r}; e.g. "
                        "target_records=(0, 3) for a target among the first four records.")
    return int(pair[0]), int(pair[1])


def _tuples(arr: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(row) for row in arr.tolist()]


def geometry_frame(
    spec: PhaseSpec,
    modulus: int,
    *,
    item_id: np.ndarray,
    t_key: np.ndarray,
    t_value: np.ndarray,
    query_pos: np.ndarray,
) -> pd.DataFrame:
    """The contract columns for items whose target key sits at ``t_key`` and value at ``t_value`` (all ``[N]``).

    Columns: ``item_id, residue, phase, t_K, t_V, key_entries, value_entries, boundary, shared_entry,
    query_pos, query_phase``. Entry tuples come from :meth:`PhaseSpec.entries_containing` (W/S entries each).
    """
    t_key = np.asarray(t_key, dtype=np.int64)
    t_value = np.asarray(t_value, dtype=np.int64)
    query_pos = np.asarray(query_pos, dtype=np.int64)
    k_ent = spec.entries_containing(t_key)
    v_ent = spec.entries_containing(t_value)
    # Entries are consecutive runs of W/S indices, so two runs intersect iff their ranges overlap.
    shared = (k_ent[:, 0] <= v_ent[:, -1]) & (v_ent[:, 0] <= k_ent[:, -1])
    return pd.DataFrame(
        {
            "item_id": np.asarray(item_id, dtype=np.int64),
            "residue": spec.residue(t_key, modulus),
            "phase": spec.phase(t_key),
            "t_K": t_key,
            "t_V": t_value,
            "key_entries": _tuples(k_ent),
            "value_entries": _tuples(v_ent),
            "boundary": spec.is_boundary(t_key),
            "shared_entry": shared,
            "query_pos": query_pos,
            "query_phase": spec.phase(query_pos),
        }
    )


def expand_items(n_base: int, residues: np.ndarray, paired: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Row layout of a build: ``(base index [N], residue [N], number of base items)``.

    Paired: ``n_base`` base items, each placed at every residue (item-major rows). Unpaired: a fresh base
    item for every row, ``n_base`` rows per residue.
    """
    n_res = residues.size
    if paired:
        return np.repeat(np.arange(n_base), n_res), np.tile(residues, n_base), n_base
    return np.arange(n_base * n_res), np.tile(residues, n_base), n_base * n_res
