"""Layer x head x phase maps: ``specialization_map`` (exact knockouts) and its ``PhaseMap`` result."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Unpack

import numpy as np
import pandas as pd

from phaselens.analyses.knockout_runs import engine_metrics, full_metrics
from phaselens.analyses.knockouts import Calibration, Knockout, calibrate, calibration_items, check_method
from phaselens.analyses.runner import Analysis, Common, ResamplingOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import items_from_logits, score_items
from phaselens.analyses.units import Units
from phaselens.contract.protocol import PhaseModel, choose_engine
from phaselens.core.checks import as_int, as_names
from phaselens.core.margins import cell_margins
from phaselens.results.phase_map import KINDS, PhaseMap
from phaselens.stats.effects import Effects, relative_effects


def map_cells(cfg: Any, kinds: tuple[str, ...] = KINDS) -> pd.DataFrame:
    """The cells of a map: one row per knockout (``label``, ``kind``, ``layer``, ``heads``).

    A KV head's cell knocks out the query heads that share it. Without GQA sharing (``n_key_value_heads ==
    n_heads``) KV head k is query head k alone: its cells (``L0KV0``, ...) are then made only when ``kinds``
    asks for KV heads without heads, as they would repeat the head cells."""
    kinds = as_names("kinds", kinds, KINDS)
    L, H = int(cfg.n_layers), int(cfg.n_heads)
    Hkv = int(getattr(cfg, "n_key_value_heads", None) or H)
    G = H // Hkv
    rows = []
    for layer in range(L):
        if "head" in kinds:
            rows += [dict(label=f"L{layer}H{h}", kind="head", layer=layer, index=h, heads=(h,)) for h in range(H)]
        if "kv_head" in kinds and (Hkv < H or "head" not in kinds):
            rows += [dict(label=f"L{layer}KV{k}", kind="kv_head", layer=layer, index=k,
                          heads=tuple(range(k * G, (k + 1) * G))) for k in range(Hkv)]
        if "layer" in kinds:
            rows.append(dict(label=f"L{layer}", kind="layer", layer=layer, index=0, heads=tuple(range(H))))
    return pd.DataFrame(rows)




@dataclass(frozen=True)
class MapState:
    """What every cell of a map shares: the calibration, one knockout per cell, the clean outcomes and the
    query-suffix engine (``None`` with full forwards)."""

    calibration: Calibration | None
    knockouts: list[Knockout]
    clean: pd.DataFrame
    engine: Any = None


@dataclass(frozen=True, eq=False)
class Map(Analysis[MapState]):
    """A clean pass, then one unit per cell (a head, KV head or layer knocked out), batched by the engine.
    Checked, ``engine`` is the engine used and ``cells`` the cells of the model's map."""

    name = "specialization_map"
    stage = "map"
    unit = "cell"
    bar_unit = "cell"
    leave = True

    method: str = "mean"
    kinds: Any = KINDS
    calibration: Any = None
    rows_per_pass: int = 4096
    engine: str = "auto"
    cells: pd.DataFrame | None = None

    def check(self, model: PhaseModel, options: Common) -> Map:
        method = check_method(self.method)
        kinds = as_names("kinds", self.kinds, KINDS)
        rows_per_pass = as_int("rows_per_pass", self.rows_per_pass, minimum=1)
        return replace(self, method=method, kinds=kinds, rows_per_pass=rows_per_pass,
                       engine=choose_engine(model, self.engine), cells=map_cells(model.dims, tuple(kinds)))

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """The calibration (mean and resample: ``batch_size`` items per forward), then the clean pass and one
        pass per cell (``"full"``), or the query-suffix engine over every item: the clean query step, then each
        cell's query rows from its layer up, ``rows_per_pass // N`` cells per engine call."""
        cells = self.cells if self.cells is not None else map_cells(model.dims, tuple(self.kinds))
        kinds = {str(k): int(v) for k, v in cells["kind"].value_counts(sort=False).items()}
        suffix = self.engine == "suffix"
        return Units(engine=self.engine, item_passes=0 if suffix else 1, cells=kinds,
                     cell_layers=tuple(int(x) for x in cells["layer"]), rows_per_pass=self.rows_per_pass,
                     cells_per_call=max(1, self.rows_per_pass // max(int(items.n), 1)),
                     calibration_items=calibration_items(self.method, self.calibration, int(items.modulus)),
                     calibration_batch=options.batch_size, unit="cell")

    def prepare(self, run: Run) -> MapState:
        model, batch, o, cells = run.model, run.batch, run.options, self._cells
        layers = sorted(set(cells["layer"]))
        cal = None if self.method == "zero" else calibrate(model, self.calibration, layers, task=run.task,
                                                            batch_size=o.batch_size)
        kos = [Knockout(model, tuple(_heads(row)), self.method, "last", cal, o.seed + i) for i, row in cells.iterrows()]
        if self.engine == "suffix":
            eng = model.query_engine(batch.tokens, batch.query_pos, rows_per_pass=self.rows_per_pass,
                                     batch_size=o.batch_size)
            return MapState(cal, kos, items_from_logits(batch, eng.clean_logits), eng)
        return MapState(cal, kos, score_items(model, batch, batch_size=o.batch_size, desc="clean"))

    @property
    def _cells(self) -> pd.DataFrame:
        assert self.cells is not None, "check() sets the cells"
        return self.cells

    def labels(self, run: Run, state: MapState) -> list[str]:
        return list(self._cells["label"])

    def fields(self, run: Run) -> tuple[str, ...]:
        return ("correct", "logit_diff", "fragile")

    def fingerprint(self, run: Run, state: MapState) -> dict[str, Any]:
        cal = state.calibration
        return dict(task=getattr(run.batch, "task", ""), calibration=None if cal is None else cal.z,
                    method=self.method, seed=run.options.seed, cells=list(self._cells["label"]), stride=run.stride)

    def per_call(self, run: Run, state: MapState) -> int:
        return max(1, self.rows_per_pass // len(run.batch)) if self.engine == "suffix" else 1

    def compute(self, run: Run, state: MapState, idx: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        batch = run.batch
        unmeasured = np.full(len(batch), np.nan)  # fragile: 1.0 / 0.0 where the engine measured it, else NaN
        if state.engine is not None:
            got: list[dict[str, np.ndarray]] = []
            engine_metrics(state.engine, batch, [state.knockouts[i] for i in idx], per_pass=len(idx),
                           on_chunk=lambda _i, m: got.extend(m))
            return [(m["correct"], m["logit_diff"], m["fragile"].astype(float) if "fragile" in m else unmeasured)
                    for m in got]
        return [(m["correct"], m["logit_diff"], unmeasured) for m in
                (full_metrics(run.model, batch, state.knockouts[i], batch_size=run.options.batch_size) for i in idx)]

    def result(self, run: Run, state: MapState, parts: list[tuple[np.ndarray, np.ndarray]]) -> PhaseMap:
        ko_correct = np.stack([d[0] for d in parts]).astype(bool)
        ko_ld = np.stack([d[1] for d in parts])
        clean = state.clean
        clean_correct = clean["correct"].to_numpy().astype(bool)
        residue = clean["residue"].to_numpy()
        o = run.options

        def effects(groups: np.ndarray, n_groups: int) -> Effects:
            return relative_effects(clean_correct, ko_correct, groups, n_groups, clean_ld=clean["logit_diff"].to_numpy(),
                                    ko_ld=ko_ld, n_bootstrap=o.n_bootstrap, seed=o.seed)

        cal = state.calibration
        fragile = cell_margins(np.stack([d[2] for d in parts]), run.model.dims.dtype)
        return PhaseMap(self._cells, effects(residue, run.modulus), effects(residue % run.stride, run.stride),
                        clean_correct, ko_correct, clean["logit_diff"].to_numpy(), ko_ld, residue,
                        run.stride, run.modulus, self.method, run.model.dims.n_layers, run.model.dims.n_heads,
                        run.metadata(engine=self.engine, calibration=None if cal is None else cal.source,
                                     rounding_margins=fragile))



@public
def specialization_map(
    model: PhaseModel,
    task: Any = None,
    *,
    method: str = "mean",
    kinds: tuple[str, ...] = KINDS,
    calibration: Any = None,
    rows_per_pass: int = 4096,
    engine: str = "auto",
    **options: Unpack[ResamplingOptions],
) -> PhaseMap:
    """Knock out every head (and KV head, and layer) at each item's query position; effects per residue.

    Args:
        model: a phaselens model (our model, the DeepSeek-V4 adapter, or a phase ensemble).
        task, phase, n_per_residue, residues, seed, batch_size, stride, progress, journal, n_bootstrap: the common
            options (docs/api.md). A journal holds finished cells (one safetensors file, its manifest in the
            header); its fingerprint covers every parameter of the model, its ``analysis_metadata``, the items,
            the calibration and every setting that changes the numbers, so a journal of another map is
            refused.
        method: ``"mean"``, ``"zero"`` or ``"resample"`` replacement of ``z``.
        kinds: which cells to map (drawn from ``("head", "kv_head", "layer")``).
        calibration: the calibration items for ``mean``/``resample`` (default: the task's own, another seed).
        rows_per_pass: query rows per batched engine pass.
        engine: ``"auto"`` (the fastest exact engine the model offers), ``"suffix"`` (the query-suffix engine:
            the clean prefix once, then only the query rows per cell) or ``"full"`` (one full forward per cell,
            the reference way); ``metadata["engine"]`` names the one used.

    ``phaselens.plan(model, "specialization_map", task, ...)`` prices the same call (cells, forwards, token passes,
    memory) without running it.

    Example:
        >>> pm = phaselens.specialization_map(phaselens.load("zoo:w4s4"), n_per_residue=32)  # doctest: +SKIP
        >>> pm.specialization_index().head()  # doctest: +SKIP
    """
    arguments = arguments_of(specialization_map, locals())
    return run(Map.from_arguments(arguments), model, task, arguments)


def _heads(row: pd.Series) -> list[Any]:
    from phaselens.core.heads import Head

    return [Head(int(row.layer), int(h)) for h in row.heads]
