"""What every result object shares: declared tidy frames, ``plot``, ``save``/``load``, ``metadata``, a repr.

Every result (``PhaseEval``, ``PhaseRecording``, ``PhaseAblation``, ``PhasePatch``, ``PhaseMap``,
``PhaseAttribution``, ``PhaseGateCycling``, ``PhaseRepairTable``) is a frozen dataclass that offers:

* ``to_frame(level=...)``: one tidy level (``LEVELS``; ``"residue"`` by default, ``"phase"``, and ``"item"``
  or others where they exist). ``COLUMNS[level]`` declares the columns a level always has; they come first,
  in that order, then any the level adds (a task's placement columns, a cell's dims); every declared name
  comes from :data:`VOCABULARY` (one name per quantity across results);
* ``per_residue()``, ``per_phase()`` (and ``per_<level>()``): the same frames by name;
* ``metadata``: the model's name and ``analysis_metadata``, the task, and the exact arguments of the call;
* ``summary()`` and a ``repr`` that never raises; ``plot()`` (a plotly Figure);
* ``save(path)`` and ``type(result).load(path)``: safetensors + JSON (:mod:`phaselens.results.storage`);
* checked arguments: every public method a subclass defines is wrapped so that its arguments are checked by
  name before it runs (a phase in ``0..S-1``, a positive ``k``, an ``alpha`` in (0, 1), a ``kind`` from its
  closed set, ...: :mod:`phaselens.results.arguments`), methods added later included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phaselens.errors import InputError
from phaselens.results.arguments import check_methods

# The shared column vocabulary: one name per quantity, in every result (docs/api.md, "Result columns").
VOCABULARY: dict[str, str] = {
    "residue": "(t_K - origin) mod M",
    "phase": "residue mod S",
    "boundary": "the phase is S - 1",
    "n": "items in the group",
    "acc": "accuracy (fraction correct)",
    "correct": "items answered correctly (a count per group; 0/1 per item)",
    "nll": "mean negative log-likelihood of the answer",
    "clean_acc": "accuracy without the intervention",
    "ko_acc": "accuracy with the knockout",
    "rel_change": "100 (KO - clean) / clean, percent (NaN where undefined: clean < 2%)",
    "delta_logit_diff": "mean change of the answer-minus-wrong logit difference under the intervention",
    "undefined": "the row's main quantity is undefined (see its definition)",
    "ci_low": "lower end of the 95% interval of the row's main quantity",
    "ci_high": "upper end of the 95% interval of the row's main quantity",
    "pvalue": "two-sided p-value of the row's test",
    "label": "a cell's name (L2H3, L2KV0, L2)",
    "kind": "a cell's kind (head, kv_head, layer)",
    "layer": "block index",
    "head": "query head index",
    "index": "a cell's head or KV-head index within its layer",
    "value": "the row's quantity (Labelled frames)",
    "quantity": "which quantity the row holds (Labelled frames)",
    "recovery": "normalized recovery of the logit difference under patching",
    "m_clean": "mean logit difference of the clean items",
    "m_corrupt": "mean logit difference of the corrupted items",
    "m_patched": "mean logit difference with the head patched",
    "delta": "gate-cycling shift",
    "predicted": "accuracy predicted by rolling the unmodified profile by delta",
    "shifts": "a phase-repair shift set",
    "cost": "forward passes per input (a phase-repair shift set's size)",
    "combine": "a phase-repair combining rule",
    "item_id": "the item's index in its batch",
    "t_K": "the target key's slot",
    "p_correct": "probability of the answer",
    "p_wrong": "probability of the wrong answer",
    "logit_diff": "answer-minus-wrong logit difference",
    "rank": "tokens scored strictly above the answer",
    "correct_ko": "answered correctly with the knockout",
    "logit_diff_ko": "logit difference with the knockout",
}


class Result:
    """Base of the frozen result dataclasses; a subclass declares ``LEVELS`` and ``COLUMNS`` and defines
    ``per_<level>`` for each level, ``summary`` and ``plot``."""

    LEVELS: ClassVar[tuple[str, ...]] = ("residue", "phase")
    COLUMNS: ClassVar[dict[str, tuple[str, ...]]] = {}
    metadata: dict[str, Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_methods(cls)  # every public method's arguments checked by name (results/arguments.py)

    def per_residue(self) -> pd.DataFrame:
        raise NotImplementedError

    def per_phase(self) -> pd.DataFrame:
        raise NotImplementedError

    def to_frame(self, level: str = "residue") -> pd.DataFrame:
        """One tidy level (``LEVELS``): ``"residue"`` (default), ``"phase"`` or another the result offers."""
        if level not in self.LEVELS:
            raise InputError(f"{type(self).__name__}.to_frame: level must be one of {self.LEVELS}, got {level!r}.")
        frame = getattr(self, "per_" + level)()
        want = self.COLUMNS.get(level, ())
        missing = [c for c in want if c not in frame.columns]
        if missing:  # a declared column is a promise to the user: never silently absent
            raise AssertionError(f"{type(self).__name__}.to_frame({level!r}) lacks declared columns {missing}")
        return frame[[*want, *(c for c in frame.columns if c not in want)]]  # declared columns first, in order

    def summary(self) -> str:
        return type(self).__name__

    def plot(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _figure(self, name: str, /, **kwargs: Any) -> Any:
        """``phaselens.plots.<name>(self, **kwargs)``: a result's ``plot``. Plots sit a layer above results
        (they read the result types), so the figure function is looked up by its name when a figure is asked
        for, as :mod:`phaselens.results.registry` looks up types; ``tests/plots/test_plot_types.py`` checks
        that every name resolves."""
        import importlib

        return getattr(importlib.import_module("phaselens.plots"), name)(self, **kwargs)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write this result to one file (safetensors + a JSON header; never pickle); read it back with
        ``type(result).load(path)`` or :func:`phaselens.results.load`."""
        from phaselens.results.storage import save_result

        return save_result(self, path, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Any:
        """The result :meth:`save` wrote (refused, with the fix, when it holds another result type)."""
        from phaselens.results.storage import load_result

        out = load_result(path)
        if not isinstance(out, cls):
            raise InputError(f"{path} holds a {type(out).__name__}, not a {cls.__name__}; load it with "
                             f"{type(out).__name__}.load(path) or phaselens.results.load(path).")
        return out

    def __repr__(self) -> str:
        try:
            return self.summary()
        except Exception as exc:  # a repr must never raise (a notebook would show a traceback instead)
            return f"<{type(self).__name__}: summary unavailable ({type(exc).__name__}: {exc})>"


check_methods(Result)  # its own methods too (to_frame's level, for every subclass that inherits it)


