"""Writing the report: files into a temporary directory, put into place at the end (atomic; see
:mod:`phaselens.storage.writing`). A directory holding files that are not a previous report's (by its manifest)
is refused unless ``overwrite=True``, which replaces only the report's own files, in ``figures/`` too."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phaselens.presentation.reporting.compute import ModelResults
from phaselens.presentation.reporting.render import Section, headline_rows
from phaselens.storage.reading import peek_json_object
from phaselens.storage.writing import DirKind, atomic_write_dir

# Columns that count or index things. A column with missing cells (a recording's ``head`` is empty on
# gate rows) comes out of pandas as float; written as such it reads "0.0". These become nullable integers.
INTEGER_COLUMNS = frozenset({"layer", "head", "kv_head", "index", "residue", "phase", "offset", "period", "worst_phase",
                             "best_phase", "delta", "n", "correct", "stride", "modulus", "cost", "entry", "step"})


def integer_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every float column in :data:`INTEGER_COLUMNS` whose values are whole as ``Int64``."""
    out = frame.copy()
    for col in out.columns:
        if col in INTEGER_COLUMNS and pd.api.types.is_float_dtype(out[col]):
            vals = out[col].dropna()
            if np.isfinite(vals).all() and (vals == np.round(vals)).all():
                out[col] = out[col].round().astype("Int64")
    return out


def tables(results: list[ModelResults]) -> dict[str, pd.DataFrame]:
    """Every number the figures show, as tidy tables keyed by file stem (integer columns as integers)."""
    out: dict[str, pd.DataFrame] = {"headline": pd.DataFrame(headline_rows(results))}
    for r in results:
        out[f"{r.name}_per_residue"] = r.eval.per_residue()
        out[f"{r.name}_per_phase"] = r.eval.per_phase()
        out[f"{r.name}_battery"] = r.eval.tests.to_frame()
        if r.map is not None:
            out[f"{r.name}_map"] = r.map.to_frame()
            out[f"{r.name}_specialization"] = r.map.specialization_index()
        if r.recording is not None:
            out[f"{r.name}_recording"] = r.recording.to_frame("residue")
            out[f"{r.name}_gates"] = r.recording.to_frame("model")
        if r.cycling is not None:
            out[f"{r.name}_cycling"] = r.cycling.frame
        if r.repair is not None:
            out[f"{r.name}_repair"] = r.repair.to_frame("rule")
    return {k: integer_columns(v) for k, v in out.items()}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def export_static(secs: list[Section], folder: Path) -> str:
    """PNG of each figure through kaleido when a Chrome/Chromium is present; returns a note for the page."""
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chrome is None:
        return "skipped: no Chrome or Chromium on this machine (install Debian's chromium to get PNGs)."
    try:
        import warnings

        import kaleido

        folder.mkdir(exist_ok=True)
        warnings.filterwarnings("ignore", message="The kopts argument is ignored", category=UserWarning)
        kaleido.start_sync_server(silence_warnings=True)
        try:
            for s in secs:
                s.figure.write_image(folder / f"{s.key}.png", width=1000, height=max(450, s.figure.layout.height or 450))
        finally:
            kaleido.stop_sync_server(silence_warnings=True)
        return f"PNG of every figure in {folder.name}/ (kaleido, {Path(chrome).name})."
    except Exception as err:  # a broken browser must not lose the report
        return f"skipped: kaleido could not render ({type(err).__name__}: {err})."


def _legacy_owned(folder: Path) -> frozenset[str]:
    """A report written before manifests: the files its ``results.json`` lists (none if it has none). Never
    ``figures/``: a folder's files are the report's only where a manifest proves it (one PNG of yours there
    must not be taken for the report's)."""
    try:
        data = peek_json_object(folder / "results.json")
        tables = list(data["tables"])
        data["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()
    return frozenset({"index.html", "results.json", *(f"{k}.csv" for k in tables)})


REPORT = DirKind("report", _legacy_owned)


def write_report(out: Path, page_html: str, results: list[ModelResults], secs: list[Section], meta: dict[str, Any],
                 *, static: bool, static_note_fn: Any, overwrite: bool = False) -> Path:
    tabs = tables(results)

    def write(tmp: Path) -> None:
        note = static_note_fn(secs, tmp / "figures") if static else "skipped (static=False)."
        (tmp / "index.html").write_text(page_html.replace("__STATIC_NOTE__", note))
        for key, frame in tabs.items():
            frame.to_csv(tmp / f"{key}.csv", index=False)
        payload = {"meta": meta, "static_images": note,
                   "tables": {k: json.loads(v.to_json(orient="records")) for k, v in tabs.items()}}
        (tmp / "results.json").write_text(json.dumps(_jsonable(payload), indent=1))

    atomic_write_dir(out, write, kind=REPORT, overwrite=overwrite)
    return out
