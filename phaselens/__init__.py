"""phaselens: phase sensitivity and phase specialization in chunk-compressed KV caches.

The public API (``__all__``) is re-exported here from the layers that define it; see ``docs/api.md`` and
``docs/architecture.md``. Names resolve on first use (PEP 562), so ``import phaselens`` and ``phaselens --help``
do not pay for torch, transformers, scipy, pandas or plotly (``benchmarks/bench_import.py``).
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

from phaselens.contract.adapting import register_adapter as _register_adapter
from phaselens.contract.adapting import register_run_loader as _register_run_loader
from phaselens.core.errors import *  # noqa: F403
from phaselens.core.errors import __all__ as _error_names
from phaselens.core.version import __version__

# the module that defines each public name
_EXPORTS: dict[str, tuple[str, ...]] = {
    "phaselens.analyses.ablation": ("ablate",),
    "phaselens.analyses.attribution": ("attribution_map",),
    "phaselens.analyses.cycling": ("cycle_gates", "gate_cycling_test"),
    "phaselens.analyses.evaluation": ("evaluate",),
    "phaselens.analyses.knockouts": ("Knockout", "knockout"),
    "phaselens.analyses.maps": ("specialization_map",),
    "phaselens.analyses.patching": ("patch",),
    "phaselens.analyses.recording": ("record",),
    "phaselens.repair.table": ("repair_table",),
    "phaselens.contract.hooknames": ("combined_pattern",),
    "phaselens.contract.protocol": ("CAPABILITIES", "HookContext", "PhaseModel", "call_state", "capability"),
    "phaselens.core.geometry": ("PhaseSpec",),
    "phaselens.core.heads": ("Head", "parse_heads"),
    "phaselens.core.labelled": ("Labelled",),
    "phaselens.models": ("CompressedConfig", "CompressedKVCache", "CompressedTransformer", "Compressor",
                         "CompressorSpec", "RopeSpec", "YarnSpec"),
    "phaselens.models.causal_lm": ("CausalLMAdapter",),
    "phaselens.models.deepseek_v4": ("DeepSeekV4Adapter",),
    "phaselens.models.objects": ("from_hf",),
    "phaselens.repair.ensemble": ("PhaseEnsemble", "phase_ensemble"),
    "phaselens.models.sources": ("load",),
    "phaselens.presentation.reporting": ("report",),
    "phaselens.results.ablation_effects": ("AblationResult",),
    "phaselens.results.attribution_estimate": ("AttributionMap",),
    "phaselens.results.entry_reads_writes": ("Recording",),
    "phaselens.results.gate_cycling": ("GateCyclingResult",),
    "phaselens.results.patch_recovery": ("PatchResult",),
    "phaselens.results.phase_eval": ("PhaseEval",),
    "phaselens.results.phase_map": ("PhaseMap",),
    "phaselens.results.repair_rules": ("RepairTable",),
    "phaselens.planning.plans": ("plan",),
    "phaselens.planning.run_plan": ("Plan",),
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
    from phaselens.analyses.cycling import cycle_gates, gate_cycling_test
    from phaselens.analyses.evaluation import evaluate
    from phaselens.analyses.knockouts import Knockout, knockout
    from phaselens.analyses.maps import specialization_map
    from phaselens.analyses.patching import patch
    from phaselens.analyses.recording import record
    from phaselens.contract.hooknames import combined_pattern
    from phaselens.contract.protocol import CAPABILITIES, HookContext, PhaseModel, call_state, capability
    from phaselens.core.geometry import PhaseSpec
    from phaselens.core.heads import Head, parse_heads
    from phaselens.core.labelled import Labelled
    from phaselens.models import (
        CompressedConfig,
        CompressedKVCache,
        CompressedTransformer,
        Compressor,
        CompressorSpec,
        RopeSpec,
        YarnSpec,
    )
    from phaselens.models.causal_lm import CausalLMAdapter
    from phaselens.models.deepseek_v4 import DeepSeekV4Adapter
    from phaselens.models.objects import from_hf
    from phaselens.models.sources import load
    from phaselens.planning.plans import plan
    from phaselens.planning.run_plan import Plan
    from phaselens.presentation.reporting import report
    from phaselens.repair.ensemble import PhaseEnsemble, phase_ensemble
    from phaselens.repair.table import repair_table
    from phaselens.results.ablation_effects import AblationResult
    from phaselens.results.attribution_estimate import AttributionMap
    from phaselens.results.entry_reads_writes import Recording
    from phaselens.results.gate_cycling import GateCyclingResult
    from phaselens.results.patch_recovery import PatchResult
    from phaselens.results.phase_eval import PhaseEval
    from phaselens.results.phase_map import PhaseMap
    from phaselens.results.repair_rules import RepairTable


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(_importlib.import_module(_WHERE[name]), name)
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f"phaselens.{name}")
    else:
        raise AttributeError(f"module 'phaselens' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)



__all__ = [
    "AblationResult",
    "AttributionMap",
    "CAPABILITIES",
    "CausalLMAdapter",
    "CompressedConfig",
    "CompressedKVCache",
    "CompressedTransformer",
    "Compressor",
    "CompressorSpec",
    "DeepSeekV4Adapter",
    "GateCyclingResult",
    "Head",
    "HookContext",
    "Knockout",
    "Labelled",
    "Plan",
    "PatchResult",
    "PhaseEnsemble",
    "PhaseEval",
    "PhaseMap",
    "PhaseModel",
    "PhaseSpec",
    "Recording",
    "RepairTable",
    "RopeSpec",
    "YarnSpec",
    "ablate",
    "attribution_map",
    "call_state",
    "capability",
    "combined_pattern",
    "cycle_gates",
    "evaluate",
    "from_hf",
    "gate_cycling_test",
    "knockout",
    "load",
    "parse_heads",
    "patch",
    "phase_ensemble",
    "plan",
    "record",
    "repair_table",
    "report",
    "specialization_map",
    "plots",
    "results",
    "stats",
    "tasks",
    "__version__",
    *_error_names,
]
