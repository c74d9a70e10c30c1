"""The generated figure report: ``phaselens.report(models, out=...)`` and ``phaselens report``.

It runs the phase-aware evaluation and battery, read- and write-side recordings, the specialization map,
gate cycling and phase repair, and writes a self-contained ``index.html`` (plotly.js embedded, opens
offline), ``results.json`` and tidy CSVs of every number, plus PNGs when a Chromium is present. The
directory appears atomically: an interrupted run never leaves a half-written report.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

from phaselens.parallel.progress import progress_label
from phaselens.presentation.reporting.compute import ModelResults, ReportSettings, compute_model
from phaselens.presentation.reporting.render import html_page, sections
from phaselens.presentation.reporting.write import REPORT, export_static, write_report
from phaselens.storage.writing import check_output_dir

DEFAULT_MODELS = ("w8s4", "full")


def _resolve(model: Any) -> tuple[str, Any, str]:
    if isinstance(model, str):
        from phaselens.models.sources import load

        m = load(model)
        card = getattr(m, "metadata", {}) or {}
        return model.split(":")[-1], m, card.get("description", "")
    from phaselens.contract.adapting import as_phase_model

    model = as_phase_model(model)  # a transformers model, envoy or bridge: needs phaselens.load(obj, stride=...)
    name = str(model.name).rstrip("/").split("/")[-1] or str(model.name)  # names prefix files: no folders
    return name, model, ""


def _lm_eval_results(sources: Any, seed: int) -> list[ModelResults]:
    """lm-eval output read back, one evaluation-only entry per phaselens task (named ``lm-eval_<task>``)."""
    import re

    if sources is None:
        return []
    from phaselens.integrations.lm_eval.samples import read_all

    out: list[ModelResults] = []
    for source in _as_list(sources):
        for task, ev in read_all(source, seed=seed).items():
            name = "lm-eval_" + re.sub(r"[^A-Za-z0-9_.-]", "_", task)
            out.append(ModelResults(name, None, f"lm-evaluation-harness samples of {task} ({ev.metadata['model']})",
                                    False, eval=ev))
    return out


def _as_list(models: Any) -> list[Any]:
    """``models`` as a list: one name, path or model is a list of one (a string is never read letter by letter)."""
    import os

    if models is None:
        return []
    if isinstance(models, str | bytes | os.PathLike) or not isinstance(models, list | tuple | set | frozenset):
        return [models]
    return list(models)


def _is_control(model: Any) -> bool:
    """A model without compressed layers (a served model's geometry is its stated stride, not its layers)."""
    return not model.dims.black_box and all(s is None for s in model.dims.phase_specs)


def report(
    models: Any = None,
    out: str | Path = "report",
    *,
    settings: ReportSettings | None = None,
    progress: bool = True,
    static: bool = True,
    command: str | None = None,
    overwrite: bool = False,
    lm_eval: Any = None,
) -> Path:
    """Build the report for ``models`` (zoo names, checkpoint paths, or model objects; one of them, or a list)
    into ``out``.

    With no models it runs on the embedded default: the DeepSeek-style zoo model ``w8s4`` beside the
    full-attention control ``full``. A model without compressed layers is treated as the control and
    folded by the smallest stride among the others.

    ``out`` is checked before anything is computed: a file there, or a directory holding files other than a
    previous report, raises :class:`~phaselens.errors.OutputError`; ``overwrite=True`` (``--force``) writes
    into such a directory, replacing only the report's own files and keeping the others.

    ``lm_eval``: lm-evaluation-harness output to include (a ``--output_path`` folder or a samples file, or a list
    of them): every task in it that phaselens exported or stratified is read back
    (:func:`phaselens.integrations.lm_eval.read_all`) and gets the evaluation's sections (accuracy by phase,
    periodicity, the battery's numbers). With ``lm_eval`` and no ``models``, the report holds those alone.

    Example:
        >>> phaselens.report(out="report")  # doctest: +SKIP
    """
    import numpy as np
    import plotly
    import torch

    from phaselens.core.version import __version__

    check_output_dir(out, REPORT, overwrite=overwrite)  # fail now, not after minutes of computing
    settings = settings or ReportSettings()
    t0 = time.time()
    read_back = _lm_eval_results(lm_eval, settings.seed)  # read first: a bad path fails before minutes of work
    resolved = [_resolve(m) for m in (_as_list(models) or (() if read_back else DEFAULT_MODELS))]
    seen: dict[str, int] = {}
    for i, (name, m, desc) in enumerate(resolved):  # unique names: they prefix the CSV files
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            resolved[i] = (f"{name}-{seen[name]}", m, desc)
    strides = [m.dims.analysis_spec.stride for _, m, _ in resolved if not _is_control(m)]
    compare = min(strides) if strides else 4
    results: list[ModelResults] = []
    for name, model, desc in resolved:
        control = _is_control(model)
        with progress_label(name):  # the bars read "w8s4: evaluate", "full: map", ...
            results.append(compute_model(name, model, settings, stride=compare if control else None,
                                         progress=progress, description=desc, is_control=control))
    results += read_back
    secs = sections(results)
    meta = {
        "command": command or "phaselens.report(" + ", ".join(repr(n) for n, _, _ in resolved) + f", out={str(out)!r})",
        "versions": {"phaselens": __version__, "torch": torch.__version__, "plotly": plotly.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "settings": vars(settings) if not hasattr(settings, "__dataclass_fields__") else
        {k: getattr(settings, k) for k in settings.__dataclass_fields__},
        "models": [r.name for r in results],
    }
    meta["seconds"] = time.time() - t0
    from phaselens.parallel.world import is_main_process

    if not is_main_process():  # under torchrun every rank computes (its share); rank 0 writes
        return Path(out)
    page = html_page(results, secs, meta, plotly.offline.get_plotlyjs(), "__STATIC_NOTE__")
    path = write_report(Path(out), page, results, secs, meta, static=static, static_note_fn=export_static,
                        overwrite=overwrite)
    return path


__all__ = ["ModelResults", "ReportSettings", "report"]
