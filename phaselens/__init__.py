"""phaselens: phase sensitivity and phase specialization in chunk-compressed KV caches.

The public API lives here; see ``docs/api.md``.

Everything but the error types is imported on first use (PEP 562 ``__getattr__``), so ``import phaselens``
and ``phaselens --help`` do not pay for torch, transformer_lens, transformers, scipy, pandas or plotly
(``benchmarks/bench_import.py`` measures it). ``phaselens.evaluate`` and friends behave exactly as if
they had been imported eagerly.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from phaselens.errors import *  # noqa: F403
from phaselens.errors import __all__ as _error_names

__version__ = "0.1.0"

# public name -> the module it lives in (the same pairs as the eager imports under TYPE_CHECKING below)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "phaselens.adapters.deepseek_v4": ("DeepSeekV4Adapter", "from_hf"),
    "phaselens.attribution": ("AttributionMap", "attribution_map"),
    "phaselens.evaluate": ("PhaseEval", "evaluate"),
    "phaselens.geometry": ("PhaseSpec",),
    "phaselens.heads": ("Head", "parse_heads"),
    "phaselens.hooknames": ("combined_pattern",),
    "phaselens.interventions": ("AblationResult", "GateCyclingResult", "Knockout", "PatchResult", "ablate",
                                "cycle_gates", "gate_cycling_test", "knockout", "patch"),
    "phaselens.labelled": ("Labelled",),
    "phaselens.loading": ("load",),
    "phaselens.maps": ("PhaseMap", "specialization_map"),
    "phaselens.plan": ("MapPlan",),
    "phaselens.models": ("CompressedConfig", "CompressedKVCache", "CompressedTransformer", "Compressor",
                         "CompressorSpec", "RopeSpec", "YarnSpec"),
    "phaselens.protocol": ("CAPABILITIES", "HookContext", "PhaseModel", "call_state", "capability"),
    "phaselens.record": ("Recording", "record"),
    "phaselens.repair": ("PhaseEnsemble", "RepairTable", "phase_ensemble", "repair_table"),
    "phaselens.reporting": ("report",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
# subpackages reachable as attributes (phaselens.stats.wilson_ci, phaselens.plots.gate_profiles, ...)
_SUBMODULES = ("stats", "tasks", "plots")

if TYPE_CHECKING:  # what static tools and IDEs see; at run time these resolve lazily in __getattr__
    from phaselens import plots, stats, tasks  # noqa: F401
    from phaselens.adapters.deepseek_v4 import DeepSeekV4Adapter, from_hf
    from phaselens.attribution import AttributionMap, attribution_map
    from phaselens.evaluate import PhaseEval, evaluate
    from phaselens.geometry import PhaseSpec
    from phaselens.heads import Head, parse_heads
    from phaselens.hooknames import combined_pattern
    from phaselens.interventions import (
        AblationResult,
        GateCyclingResult,
        Knockout,
        PatchResult,
        ablate,
        cycle_gates,
        gate_cycling_test,
        knockout,
        patch,
    )
    from phaselens.labelled import Labelled
    from phaselens.loading import load
    from phaselens.maps import PhaseMap, specialization_map
    from phaselens.models import (
        CompressedConfig,
        CompressedKVCache,
        CompressedTransformer,
        Compressor,
        CompressorSpec,
        RopeSpec,
        YarnSpec,
    )
    from phaselens.plan import MapPlan
    from phaselens.protocol import CAPABILITIES, HookContext, PhaseModel, call_state, capability
    from phaselens.record import Recording, record
    from phaselens.repair import PhaseEnsemble, RepairTable, phase_ensemble, repair_table
    from phaselens.reporting import report


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"phaselens.{name}")
    else:
        raise AttributeError(f"module 'phaselens' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _PhaselensModule(types.ModuleType):
    """Keeps ``phaselens.evaluate`` / ``phaselens.record`` the functions.

    Importing a submodule ``phaselens.X`` sets the attribute ``X`` on the package to that module; where an
    API function has the same name as its module, that would replace the function once anything imports
    the module. The submodule stays reachable through ``sys.modules`` and ``from phaselens.X import ...``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _WHERE:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _PhaselensModule

__all__ = [
    "AblationResult",
    "AttributionMap",
    "CompressedConfig",
    "CompressedKVCache",
    "CompressedTransformer",
    "Compressor",
    "CompressorSpec",
    "DeepSeekV4Adapter",
    "GateCyclingResult",
    "CAPABILITIES",
    "Head",
    "HookContext",
    "Knockout",
    "Labelled",
    "MapPlan",
    "PatchResult",
    "PhaseEval",
    "PhaseMap",
    "PhaseEnsemble",
    "PhaseModel",
    "PhaseSpec",
    "Recording",
    "RepairTable",
    "RopeSpec",
    "YarnSpec",
    "__version__",
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
    "record",
    "repair_table",
    "report",
    "specialization_map",
    "stats",
    "tasks",
    *_error_names,
]
