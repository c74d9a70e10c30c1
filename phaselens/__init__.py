"""phaselens: phase sensitivity and phase specialization in chunk-compressed KV caches.

The public API (``__all__``) is re-exported here from the layers that define it; see ``docs/api.md`` and
``docs/architecture.md``. Names resolve on first use (PEP 562), so ``import phaselens`` and ``phaselens --help``
do not pay for torch, transformers, scipy, pandas or plotly (``benchmarks/bench_import.py``).
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util as _importlib_util
from typing import TYPE_CHECKING

from phaselens.contract.adapting import register_adapter as _register_adapter
from phaselens.contract.adapting import register_run_loader as _register_run_loader
from phaselens.core.version import __version__  # noqa: F401  (phaselens.__version__, not in __all__)
from phaselens.errors import PhaseLensError

# the module that defines each public name: what a notebook user types (at most 30 names,
# tests/test_architecture.py); everything else lives in its subpackage (phaselens.errors, phaselens.models, ...)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "phaselens.models.sources": ("load",),
    "phaselens.models.objects": ("from_hf",),
    "phaselens.analyses.evaluation": ("evaluate",),
    "phaselens.analyses.maps": ("specialization_map",),
    "phaselens.analyses.ablation": ("ablate",),
    "phaselens.analyses.patching": ("patch",),
    "phaselens.analyses.knockout_evaluation": ("knockout",),
    "phaselens.analyses.recording": ("record",),
    "phaselens.analyses.attribution": ("attribution_map",),
    "phaselens.analyses.cycling": ("gate_cycling_test",),
    "phaselens.repair.table": ("repair_table",),
    "phaselens.repair.ensemble": ("phase_ensemble",),
    "phaselens.presentation.reporting": ("report",),
    "phaselens.planning.plans": ("plan",),
    "phaselens.planning.run_plan": ("Plan",),
    "phaselens.core.geometry": ("PhaseSpec",),
    "phaselens.results.phase_eval": ("PhaseEval",),
    "phaselens.results.phase_map": ("PhaseMap",),
    "phaselens.results.ablation_effects": ("PhaseAblation",),
    "phaselens.results.patch_recovery": ("PhasePatch",),
    "phaselens.results.entry_reads_writes": ("PhaseRecording",),
    "phaselens.results.attribution_estimate": ("PhaseAttribution",),
    "phaselens.results.gate_cycling": ("PhaseGateCycling",),
    "phaselens.results.repair_rules": ("PhaseRepairTable",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
# Model objects phaselens did not build (a transformers model, an nnsight envoy, a TransformerLens bridge) are
# adapted by every analysis: the composition root wires the models layer's adapter into the contract (by import
# path, resolved on first use; analyses never import model kinds).
_register_adapter("phaselens.models.objects:adapt_object")
# phaselens.load(run or step folder) loads a training step; training sits above models, so it is wired here.
_register_run_loader("phaselens.train.family.checkpoints:load_checkpoint")
# subpackages that are part of the API (phaselens.stats.wilson_ci, phaselens.plots.gate_profiles,
# phaselens.results.load, ...)
_SUBPACKAGES = ("plots", "results", "stats", "tasks")

if TYPE_CHECKING:  # what static tools and IDEs see; at run time names resolve in __getattr__
    from phaselens import plots, results, stats, tasks  # noqa: F401
    from phaselens.analyses.ablation import ablate
    from phaselens.analyses.attribution import attribution_map
    from phaselens.analyses.cycling import gate_cycling_test
    from phaselens.analyses.evaluation import evaluate
    from phaselens.analyses.knockout_evaluation import knockout
    from phaselens.analyses.maps import specialization_map
    from phaselens.analyses.patching import patch
    from phaselens.analyses.recording import record
    from phaselens.core.geometry import PhaseSpec
    from phaselens.models.objects import from_hf
    from phaselens.models.sources import load
    from phaselens.planning.plans import plan
    from phaselens.planning.run_plan import Plan
    from phaselens.presentation.reporting import report
    from phaselens.repair.ensemble import phase_ensemble
    from phaselens.repair.table import repair_table
    from phaselens.results.ablation_effects import PhaseAblation
    from phaselens.results.attribution_estimate import PhaseAttribution
    from phaselens.results.entry_reads_writes import PhaseRecording
    from phaselens.results.gate_cycling import PhaseGateCycling
    from phaselens.results.patch_recovery import PhasePatch
    from phaselens.results.phase_eval import PhaseEval
    from phaselens.results.phase_map import PhaseMap
    from phaselens.results.repair_rules import PhaseRepairTable


# names a notebook does not type, by home: asked for at the top level, the error says where they live
_ELSEWHERE = {
    "phaselens.models": ("CompressedConfig", "CompressedKVCache", "CompressedTransformer", "Compressor",
                         "CompressorSpec", "RopeSpec", "YarnSpec"),
    "phaselens.models.causal_lm": ("CausalLMAdapter",),
    "phaselens.models.deepseek_v4": ("DeepSeekV4Adapter",),
    "phaselens.contract.protocol": ("CAPABILITIES", "HookContext", "PhaseModel", "call_state", "capability"),
    "phaselens.contract.hooknames": ("combined_pattern",),
    "phaselens.core.heads": ("Head", "parse_heads"),
    "phaselens.core.labelled": ("Labelled",),
    "phaselens.repair.ensemble": ("PhaseEnsemble",),
    "phaselens.analyses.cycling": ("cycle_gates",),
    "phaselens.analyses": ("Knockout", "knocked_out"),
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(_importlib.import_module(_WHERE[name]), name)
    elif name in _SUBPACKAGES or (name.isidentifier() and not name.startswith("_")
                                     and _importlib_util.find_spec(f"phaselens.{name}")):
        value = _importlib.import_module(f"phaselens.{name}")  # phaselens.errors, phaselens.models, ...
    else:
        from phaselens import errors

        home = "phaselens.errors" if name in errors.__all__ else next(
            (m for m, names in _ELSEWHERE.items() if name in names), None)
        where = f"; it lives in {home} (from {home} import {name})" if home else ""
        raise AttributeError(f"module 'phaselens' has no attribute {name!r}{where}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "load",
    "from_hf",
    "evaluate",
    "specialization_map",
    "ablate",
    "patch",
    "knockout",
    "record",
    "attribution_map",
    "gate_cycling_test",
    "repair_table",
    "phase_ensemble",
    "report",
    "plan",
    "Plan",
    "PhaseSpec",
    "PhaseEval",
    "PhaseMap",
    "PhaseAblation",
    "PhasePatch",
    "PhaseRecording",
    "PhaseAttribution",
    "PhaseGateCycling",
    "PhaseRepairTable",
    "plots",
    "results",
    "stats",
    "tasks",
    "PhaseLensError",
]
