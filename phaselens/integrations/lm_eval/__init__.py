"""Phase-aware evaluation in EleutherAI's lm-evaluation-harness (``lm-eval`` 0.4.13; docs/lm_eval.md).

Four routes, one module each:

* :class:`PhaseLensLM` (:mod:`.phaselens_lm`): any in-process phaselens model as the lm-eval model ``phaselens``
  (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``); :class:`PhaseCompletions`
  (:mod:`.completions`): lm-eval's ``local-completions`` with phaselens' exactness rules, as
  ``phaselens-completions``. :func:`register` adds both names to lm-eval's model registry (lm-eval 0.4.13 has
  no plugin hook: ``phaselens lm-eval run ...`` registers them, then runs lm-eval's own command line).
* :func:`stratify` (:mod:`.stratification`): a phase-stratified variant of any lm-eval task: each document ``M``
  times, its context shifted by ``k = 0..M-1`` filler tokens of prefix padding, token-exact with the model's
  tokenizer, each sample's residue recorded in its document (so ``--log_samples`` carries it).
* :func:`export_task` (:mod:`.export`): phaselens' phase-controlled tasks (the needle, key-value recall, the
  paper's 128K NIAH) as lm-eval YAML tasks over local JSONL data.
* :func:`read_samples` (:mod:`.samples`): lm-eval's ``--log_samples`` output of either kind of task as a
  :class:`~phaselens.PhaseEval` with the whole statistics battery.

``lm_eval`` is imported only when a name here is first used, so ``import phaselens`` works without it.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

_EXPORTS: dict[str, tuple[str, ...]] = {
    "phaselens.integrations.lm_eval.harness": ("MODEL_NAMES", "register", "require_lm_eval", "run_cli"),
    "phaselens.integrations.lm_eval.phaselens_lm": ("PhaseLensLM",),
    "phaselens.integrations.lm_eval.completions": ("PhaseCompletions",),
    "phaselens.integrations.lm_eval.filler": ("Filler", "choose_filler"),
    "phaselens.integrations.lm_eval.stratification": ("PHASE_KEY", "StratifiedTask", "stratify", "write_stratified"),
    "phaselens.integrations.lm_eval.export": ("export_task",),
    "phaselens.integrations.lm_eval.samples": ("read_all", "read_samples", "sample_items"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_NEEDS_LM_EVAL = ("phaselens_lm", "completions")

if TYPE_CHECKING:
    from phaselens.integrations.lm_eval.completions import PhaseCompletions
    from phaselens.integrations.lm_eval.export import export_task
    from phaselens.integrations.lm_eval.filler import Filler, choose_filler
    from phaselens.integrations.lm_eval.harness import MODEL_NAMES, register, require_lm_eval, run_cli
    from phaselens.integrations.lm_eval.phaselens_lm import PhaseLensLM
    from phaselens.integrations.lm_eval.samples import read_all, read_samples, sample_items
    from phaselens.integrations.lm_eval.stratification import (
        PHASE_KEY,
        StratifiedTask,
        stratify,
        write_stratified,
    )


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'phaselens.integrations.lm_eval' has no attribute {name!r}")
    if _WHERE[name].rsplit(".", 1)[-1] in _NEEDS_LM_EVAL:  # subclasses of lm-eval's classes: say what to install
        from phaselens.integrations.lm_eval.harness import require_lm_eval

        require_lm_eval()
    value = getattr(_importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["MODEL_NAMES", "PHASE_KEY", "Filler", "PhaseCompletions", "PhaseLensLM", "StratifiedTask", "choose_filler",
           "export_task", "read_all", "read_samples", "register", "require_lm_eval", "run_cli", "sample_items", "stratify",
           "write_stratified"]
