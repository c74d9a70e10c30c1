"""What the report computes: evaluation, recordings, maps and gate cycling per model. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phaselens.errors import NotApplicableError


@dataclass(frozen=True)
class ReportSettings:
    """Sizes of the report's analyses (the defaults keep ``make report`` under 3 minutes on 2 cores)."""

    n_eval: int = 100  # items per residue for evaluation
    n_record: int = 16
    n_map: int = 24
    n_cycle: int = 48
    deltas: tuple[int, ...] = (-3, -2, -1, 1, 2, 3)
    seed: int = 0
    repair: bool = True
    n_repair: int = 48


@dataclass
class ModelResults:
    """Every result the report shows for one model."""

    name: str
    model: Any
    description: str
    is_control: bool
    eval: Any = None
    recording: Any = None
    map: Any = None
    cycling: Any = None
    cycling_note: str | None = None
    repair: Any = None
    training: dict[str, list[Any]] | None = None  # the loss curve the model was trained with, where its card has it
    notes: list[str] = field(default_factory=list)


def training_curve(metadata: Any, every: int = 10) -> dict[str, list[Any]] | None:
    """The training loss curve from a model card's ``training`` record, as a log that
    :func:`phaselens.plots.loss_curve` plots with ``x="step"``: ``step`` (the last step of each block of
    ``every``), ``loss`` (the block's mean) and ``val`` (``[step, accuracy]`` pairs, where the card has them).
    None for a model without one (the DeepSeek models, a model built in code)."""
    training = metadata.get("training") if isinstance(metadata, dict) else None
    curve = training.get("loss_curve_every_10") if isinstance(training, dict) else None
    if not curve:
        return None
    steps = int(training.get("steps") or every * len(curve))
    return {"step": [min(every * (i + 1), steps) for i in range(len(curve))], "loss": [float(x) for x in curve],
            "val": [list(v) for v in training.get("val") or []]}


def compute_model(name: str, model: Any, settings: ReportSettings, *, stride: int | None, progress: bool,
                  description: str = "", is_control: bool = False) -> ModelResults:
    """Run the report's analyses on one model."""
    from phaselens.analyses.cycling import gate_cycling_test
    from phaselens.analyses.evaluation import evaluate
    from phaselens.analyses.maps import specialization_map
    from phaselens.analyses.recording import record

    out = ModelResults(name, model, description, is_control)
    out.training = training_curve(getattr(model, "metadata", None))
    s = settings
    out.eval = evaluate(model, n_per_residue=s.n_eval, seed=s.seed, progress=progress, stride=stride,
                        n_permutations=2000, n_bootstrap=500, batch_size=128)
    out.eval.metadata["model"] = name
    try:  # a served model has no heads to knock out
        out.map = specialization_map(model, n_per_residue=s.n_map, seed=s.seed, progress=progress, stride=stride,
                                     n_bootstrap=300)
    except NotApplicableError as err:
        out.notes.append(f"Knockout maps: {err}")
    if not is_control:
        try:
            out.recording = record(model, n_per_residue=s.n_record, seed=s.seed, progress=progress)
        except NotApplicableError as err:
            out.notes.append(f"Recording: {err}")
        try:
            out.cycling = gate_cycling_test(model, deltas=s.deltas, n_per_residue=s.n_cycle, seed=s.seed,
                                            progress=progress, batch_size=128)
        except NotApplicableError as err:
            out.cycling_note = str(err)
            out.notes.append(f"Gate cycling: {err}")
        if s.repair:
            from phaselens.contract.protocol import is_black_box
            from phaselens.repair.table import repair_table

            rule = "vote" if is_black_box(model) else "max_conf"  # a server may report no confidences
            try:
                out.repair = repair_table(model, n_per_residue=s.n_repair, seed=s.seed, progress=progress,
                                          combines=(rule,), shift_sets=("all",))
            except NotApplicableError as err:
                out.notes.append(f"Phase repair: {err}")
    return out
