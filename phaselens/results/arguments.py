"""The arguments of result methods, checked at the boundary: one check per kind of argument.

Every public method of a :class:`~phaselens.results.base.Result` subclass is wrapped by :func:`checked`
(``Result.__init_subclass__`` does it), which checks each argument by its parameter's name before the method
runs, so a method added later is checked too. A bad value raises a :class:`~phaselens.errors.PhaseLensError`
that names the argument, the value and the valid range or form; nothing returns an empty or all-True answer:

* ``phase``: an integer in ``0..S-1`` (:class:`~phaselens.errors.ResidueError` when out of range);
  ``residue``: an integer in ``0..M-1``;
* ``k``, ``n``, ``top``: a positive integer (a bool is not one);
* ``alpha``, ``level`` (a significance or confidence level): a finite number strictly between 0 and 1;
* ``n_permutations`` (>= 1) and ``n_bootstrap`` (>= 0): resampling counts, at most a million;
* ``heads``, ``head``: a head specification valid for the result's model (``HeadSpecError``);
* a name from a closed set: the sets are declared in :data:`CHOICES`, per result type (``kind``,
  ``quantity``, ``by``, ...; ``to_frame``'s ``level`` is one of the type's ``LEVELS``).

``None`` passes where it is the parameter's default (``kind=None``: every kind).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from phaselens.core.checks import MAX_RESAMPLES, as_int, as_probability
from phaselens.errors import InputError, PhaseLensError, ResidueError


# ---- one check per kind of argument ----------------------------------------------------------------------
def check_phase(value: Any, stride: int, *, name: str = "phase") -> int:
    """``value`` as an int in ``0..stride-1``: InputError for a non-integer, ResidueError when out of range."""
    return _below(name, value, stride, "A phase", f"phases are residues mod the stride {stride}")


def check_residue(value: Any, modulus: int, *, name: str = "residue") -> int:
    """``value`` as an int in ``0..modulus-1``: InputError for a non-integer, ResidueError when out of range."""
    return _below(name, value, modulus, "A residue", f"residues mod {modulus}")


def _below(name: str, value: Any, bound: int, what: str, why: str) -> int:
    v = as_int(name, value, fix=f"{what} is an integer in 0..{bound - 1}.")
    if not 0 <= v < bound:
        raise ResidueError(f"{name} {v} is outside 0..{bound - 1} ({why}); pass one of 0..{bound - 1}.")
    return v


def check_count(value: Any, *, name: str = "k") -> int:
    """``value`` as a positive int (a bool, a float or a string is refused)."""
    return as_int(name, value, minimum=1, fix=f"{name} is how many rows to return, a positive integer (e.g. {name}=5).")


def check_probability(value: Any, *, name: str = "alpha") -> float:
    """``value`` as a float strictly between 0 and 1 (a bool or a string is refused)."""
    return as_probability(name, value)


def check_choice(value: Any, choices: tuple[Any, ...], *, name: str = "kind") -> Any:
    """``value`` if it is one of ``choices`` (same type and value: ``True`` is not ``1``, ``"1"`` is not ``1``)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise InputError(f"{name} must be one of {choices}, got {value!r}.")
    return value


def check_heads(value: Any, result: Any, *, name: str = "heads") -> Any:
    """``value`` as a tuple of :class:`~phaselens.core.heads.Head` valid for the result's model (its layers and
    heads read from the result): HeadSpecError naming the part that is wrong."""
    from phaselens.core.heads import parse_heads

    return parse_heads(value, _model_dims(result))


def _model_dims(result: Any) -> Any:
    """``n_layers`` and ``n_heads`` of the model a result was computed on (its fields, or a labelled array's
    ``layer`` and ``head`` coordinates)."""
    if hasattr(result, "n_layers") and hasattr(result, "n_heads"):
        return SimpleNamespace(n_layers=int(result.n_layers), n_heads=int(result.n_heads), n_key_value_heads=None)
    for value in vars(result).values():
        coords = getattr(value, "coords", None)
        if isinstance(coords, dict) and "layer" in coords and "head" in coords:
            return SimpleNamespace(n_layers=int(np.max(coords["layer"])) + 1, n_heads=len(coords["head"]),
                                   n_key_value_heads=None)
    raise InputError(f"{type(result).__name__} does not record its model's heads, so it cannot select heads.")


def _count(lo: int) -> Callable[[Any, Any, str], int]:
    def check(result: Any, value: Any, name: str) -> int:
        what = "permutations" if name == "n_permutations" else "resamples (0: none)"
        return as_int(name, value, minimum=lo, maximum=MAX_RESAMPLES,
                      fix=f"It is the number of {what}; a million is more than enough.")
    return check


Rule = Callable[[Any, Any, str], Any]  # (result, value, argument name) -> the value to pass on

#: The check of each argument name (the ``result`` gives the stride, the modulus or the model's heads).
RULES: dict[str, Rule] = {
    "phase": lambda r, v, n: check_phase(v, int(r.stride), name=n),
    "residue": lambda r, v, n: check_residue(v, int(r.modulus), name=n),
    "k": lambda r, v, n: check_count(v, name=n),
    "n": lambda r, v, n: check_count(v, name=n),
    "top": lambda r, v, n: check_count(v, name=n),
    "alpha": lambda r, v, n: check_probability(v, name=n),
    "level": lambda r, v, n: check_probability(v, name=n),
    "n_permutations": _count(1),
    "n_bootstrap": _count(0),
    "heads": lambda r, v, n: check_heads(v, r, name=n),
    "head": lambda r, v, n: check_heads(v, r, name=n),
}

Choices = tuple[Any, ...] | Callable[[Any], tuple[Any, ...]]

#: Closed sets of name-valued arguments, per result type: ``{type name: {"method.argument" or "argument":
#: choices}}``; ``choices`` is a tuple, or a function of the result that gives one. ``"*"`` applies to every
#: type. A choice takes precedence over :data:`RULES` (``to_frame``'s ``level`` is a frame level, not a
#: confidence level).
CHOICES: dict[str, dict[str, Choices]] = {
    "*": {"to_frame.level": lambda r: tuple(r.LEVELS)},
    "PhaseMap": {
        "kind": ("head", "kv_head", "layer"),  # results.phase_map.KINDS (a kind the map lacks is refused by name)
        "quantity": ("rel_change", "ko_acc", "ci_low", "ci_high", "pvalue", "delta_logit_diff", "undefined"),
        "by": ("rel_change", "delta_logit_diff"),
    },
    "PhaseRecording": {"plot.kind": ("read", "write"), "plot.quantity": lambda r: tuple(r.read)},
    "PhaseRepairTable": {"plot.key": lambda r: tuple(r.evals)},
}


def choices_of(result: Any, method: str, name: str) -> tuple[Any, ...] | None:
    """The closed set of argument ``name`` of ``method`` on ``result`` (``None``: not a name from a set)."""
    for table in (CHOICES.get(type(result).__name__, {}), CHOICES["*"]):
        for key in (f"{method}.{name}", name):
            if key in table:
                found = table[key]
                return tuple(found(result) if callable(found) else found)
    return None


def declared(type_name: str, method: str, name: str) -> bool:
    """Whether argument ``name`` of ``method`` on a result type is checked (a rule or a closed set covers it)."""
    tables = (CHOICES.get(type_name, {}), CHOICES["*"])
    return name in RULES or any(key in table for table in tables for key in (f"{method}.{name}", name))


def check_argument(result: Any, method: str, name: str, value: Any) -> Any:
    """``value`` checked as argument ``name`` of ``result.method`` (unchanged when no check covers ``name``);
    the error names the method (``PhaseMap.top_heads: phase 4 is outside 0..3 ...``)."""
    try:
        choices = choices_of(result, method, name)
        if choices is not None:
            return check_choice(value, choices, name=name)
        rule = RULES.get(name)
        return value if rule is None else rule(result, value, name)
    except PhaseLensError as err:
        raise type(err)(f"{type(result).__name__}.{method}: {err}") from None


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a result method) with its arguments checked by name before it runs: :func:`check_argument` for
    each named parameter and each keyword passed through ``**kwargs``; ``None`` passes where it is the default."""
    if getattr(fn, "__phaselens_checked__", False):
        return fn
    sig = inspect.signature(fn)
    params = sig.parameters
    var_kw = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    method = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError:
            return fn(self, *args, **kwargs)  # the call's own error (a missing or unknown argument)
        for name, value in list(bound.arguments.items())[1:]:
            if name == var_kw:
                bound.arguments[name] = {k: check_argument(self, method, k, v) for k, v in value.items()}
            elif not (value is None and params[name].default is None):
                bound.arguments[name] = check_argument(self, method, name, value)
        return fn(*bound.args, **bound.kwargs)

    wrapper.__phaselens_checked__ = True  # type: ignore[attr-defined]
    return wrapper


def check_methods(cls: type) -> None:
    """Wrap every public method ``cls`` defines (not inherited, not a property or classmethod) in :func:`checked`."""
    for name, attr in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(attr):
            setattr(cls, name, checked(attr))
