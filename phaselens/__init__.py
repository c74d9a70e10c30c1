"""phaselens: phase sensitivity and phase specialization in chunk-compressed KV caches.

The public API lives here; see ``docs/api.md``.
"""

from phaselens import stats, tasks
from phaselens.adapters.deepseek_v4 import DeepSeekV4Adapter, from_hf
from phaselens.attribution import AttributionMap, attribution_map
from phaselens.errors import *  # noqa: F403
from phaselens.errors import __all__ as _error_names
from phaselens.evaluate import PhaseEval, evaluate
from phaselens.geometry import PhaseSpec
from phaselens.heads import Head, parse_heads
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
from phaselens.protocol import CAPABILITIES, HookContext, PhaseModel, call_state, capability
from phaselens.record import Recording, record
from phaselens.repair import PhaseEnsemble, RepairTable, phase_ensemble, repair_table
from phaselens.reporting import report

__version__ = "0.1.0"

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
