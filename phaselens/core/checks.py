"""Argument checks shared by every layer: a clear :class:`~phaselens.errors.InputError` for a bad value.

Numpy integers are integers; bool, float and str are refused where an integer is meant.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from phaselens.errors import InputError


def as_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None, fix: str = "") -> int:
    """``value`` as a Python int (numpy integers accepted) in ``minimum..maximum``; bool, float and str are
    refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).{fix and ' ' + fix}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}.{fix and ' ' + fix}")
    if maximum is not None and value > maximum:
        raise InputError(f"{name} must be <= {maximum:,}, got {value:,}.{fix and ' ' + fix}")
    return value


#: Seeds fit in a signed 64-bit integer (torch's generators take at most 64 bits, and analyses add a cell's
#: index to the seed).
MAX_SEED = 2**63 - 1
#: Model dimensions (widths, heads, experts, vocabularies, table rows): below 2^31, as torch indexes tensors with
#: 32-bit sizes in places, and a config's size times the others must stay within the 2^63 bytes torch sums.
MAX_DIM = 2**31 - 1
#: Resampling counts: beyond a million, a p-value's Monte Carlo error (at most 0.5 / sqrt(n) = 5e-4) is far
#: below anything a decision rests on, while the resamples' arrays grow without bound.
MAX_RESAMPLES = 10**6


def as_float(name: str, value: Any, *, positive: bool = False, fix: str = "") -> float:
    """``value`` as a finite Python float (ints and numpy numbers accepted); bool and str are refused."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not np.isfinite(float(value)) or (positive and float(value) <= 0):
        need = "a finite number > 0" if positive else "a finite number"
        raise InputError(f"{name} must be {need}, got {value!r}.{fix and ' ' + fix}")
    return float(value)


def as_probability(name: str, value: Any, *, error: type[InputError] | type[Exception] = InputError) -> float:
    """``value`` as a float strictly between 0 and 1 (a significance level or a confidence level); bool, str,
    NaN and the end points are refused with ``error``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and bool(np.isfinite(float(value)))
    if not ok or not 0 < float(value) < 1:
        raise error(f"{name} must be a number strictly between 0 and 1, got {value!r}; e.g. "
                         f"{name}={0.95 if name == 'level' else 0.05}.")
    return float(value)


def as_names(name: str, value: Any, allowed: Sequence[str]) -> tuple[str, ...]:
    """A non-empty tuple of names drawn from ``allowed``; a bare string is refused (it would be read letter by
    letter) with the tuple spelled out."""
    if isinstance(value, str):
        raise InputError(f"{name} must be a tuple of names, got the string {value!r}; write {name}=({value!r},).")
    try:
        names = tuple(value)
    except TypeError:
        raise InputError(f"{name} must be a tuple drawn from {tuple(allowed)}, got {value!r}.") from None
    bad = [n for n in names if not isinstance(n, str) or n not in allowed]
    if bad or not names:
        what = f"unknown {bad!r}" if bad else "nothing"
        raise InputError(f"{name} must be a non-empty tuple drawn from {tuple(allowed)}, got {what}; e.g. "
                         f"{name}=({allowed[0]!r},).")
    return tuple(dict.fromkeys(names))
