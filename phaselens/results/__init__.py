"""Every result type, its shared base (:class:`~phaselens.results.base.Result`: declared frames, plot,
save/load, metadata, repr) and storage.

One module per result: :mod:`~phaselens.results.phase_eval` (``PhaseEval``), :mod:`~phaselens.results.phase_map`
(``PhaseMap``), :mod:`~phaselens.results.ablation_effects` (``PhaseAblation``),
:mod:`~phaselens.results.patch_recovery` (``PhasePatch``), :mod:`~phaselens.results.attribution_estimate`
(``PhaseAttribution``), :mod:`~phaselens.results.entry_reads_writes` (``PhaseRecording``),
:mod:`~phaselens.results.gate_cycling` (``PhaseGateCycling``), :mod:`~phaselens.results.repair_rules`
(``PhaseRepairTable``). Analyses compute them; plots draw them (a layer above: a result's ``plot`` finds its figure
function by name); neither is imported here."""

from phaselens.results.base import VOCABULARY, Result


def load(path):
    """Any saved phaselens result (the type is read from the file)."""
    from phaselens.results.storage import load_result

    return load_result(path)


__all__ = ["Result", "VOCABULARY", "load"]
