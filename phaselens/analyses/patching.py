"""Per-phase activation patching of per-head ``z`` at the query position, with the tasks' corrupted twins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Literal, Unpack

import numpy as np
import pandas as pd
import torch

from phaselens.analyses.knockouts import capture_z, z_name
from phaselens.analyses.runner import (
    Analysis,
    Common,
    ResamplingOptions,
    Run,
    arguments_of,
    public,
    run,
)
from phaselens.analyses.scoring import (
    answer_metrics,
    model_logits,
    plain_forward,
    query_logits,
    query_metrics,
)
from phaselens.analyses.units import Units
from phaselens.contract.cells import Cell
from phaselens.contract.protocol import HookContext, PhaseModel, choose_engine
from phaselens.core.checks import as_float
from phaselens.core.heads import Head, parse_heads
from phaselens.core.labelled import Labelled
from phaselens.errors import InputError
from phaselens.parallel.world import world
from phaselens.results.patch_recovery import PhasePatch
from phaselens.stats.by_residue import bootstrap_counts, bootstrap_group_means, group_counts, residue_mean

EPS_DENOM = 1e-3




def recovery_frame(heads: Sequence[Head], stats: tuple[np.ndarray, ...], groups: np.ndarray, n_groups: int,
                   level: str, stride: int) -> pd.DataFrame:
    """Tidy rows per (layer, head, group) of :func:`recovery`'s output ``stats`` (``level``: ``"residue"`` or
    ``"phase"``)."""
    rec, lo, hi, und, mc, mx, mp = stats
    K = len(heads)
    g = np.arange(n_groups)
    out = pd.DataFrame({
        "layer": np.repeat([h.layer for h in heads], n_groups),
        "head": np.repeat([h.head for h in heads], n_groups),
        level: np.tile(g, K), "n": np.tile(group_counts(groups, n_groups), K),
        "recovery": rec.ravel(), "ci_low": lo.ravel(), "ci_high": hi.ravel(), "undefined": und.ravel(),
        "m_clean": np.tile(mc, K), "m_corrupt": np.tile(mx, K), "m_patched": mp.ravel(),
    })
    if level == "residue":
        out.insert(3, "phase", out["residue"] % stride)
    else:
        out["boundary"] = out["phase"] == stride - 1
    return out[out["n"] > 0].reset_index(drop=True)


def recovery(item_clean: np.ndarray, item_corrupt: np.ndarray, item_patched: np.ndarray, groups: np.ndarray,
             n_groups: int, direction: str, eps: float, *, n_bootstrap: int = 0, seed: int = 0,
             level: float = 0.95) -> tuple[np.ndarray, ...]:
    """Normalized recovery per head and group from per-item logit differences.

    Args:
        item_clean, item_corrupt: ``[N]``; item_patched: ``[K, N]``; groups: ``[N]`` in ``0..G-1``.

    Returns:
        ``(recovery, ci_low, ci_high, undefined, m_clean, m_corrupt, m_patched)``: ``[K, G]`` except the
        ``[G]`` means; the CI is a percentile bootstrap of the ratio (items resampled within groups).
    """
    def ratio(mc: np.ndarray, mx: np.ndarray, mp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        den = mc - mx
        und = np.abs(den) < eps
        num = mp - mx if direction == "denoise" else mc - mp
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(und | np.isnan(mp), np.nan, num / np.where(und, 1.0, den)), und

    mc, mx = residue_mean(item_clean, groups, n_groups), residue_mean(item_corrupt, groups, n_groups)
    mp = residue_mean(np.atleast_2d(item_patched).T, groups, n_groups)  # [K, G]
    rec, und = ratio(mc[None], mx[None], mp)
    und = np.broadcast_to(und, rec.shape).copy()
    lo = hi = np.full(rec.shape, np.nan)
    if n_bootstrap:
        counts = bootstrap_counts(groups, n_groups, n_bootstrap, np.random.default_rng(seed))
        b = bootstrap_group_means(np.vstack([item_clean, item_corrupt, np.atleast_2d(item_patched)]), counts,
                                  groups, n_groups)  # [2 + K, B, G]
        r_b, _ = ratio(b[0][None], b[1][None], b[2:])  # [K, B, G]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            q = np.nanquantile(r_b, [(1 - level) / 2, (1 + level) / 2], axis=1)
        lo, hi = np.where(np.isnan(rec), np.nan, q[0]), np.where(np.isnan(rec), np.nan, q[1])
    return rec, lo, hi, und, mc, mx, mp


@dataclass(frozen=True)
class PatchState:
    """The run patched into (``base``), the source's query ``z`` per layer ``[N, copies, H, d]``, each item's
    clean and corrupted metric, and the query-suffix engine (``None`` with full forwards)."""

    base: torch.Tensor
    source_z: dict[int, torch.Tensor]
    item_clean: np.ndarray
    item_corrupt: np.ndarray
    engine: Any = None


@dataclass(frozen=True)
class Patching(Analysis[PatchState]):
    """Clean and corrupted answers once, then one unit per head: its query ``z`` patched from the source run.
    Checked, ``engine`` is the engine used and ``heads`` the parsed heads."""

    name = "patch"
    stage = "patch"
    unit = "cell"
    bar_unit = "cell"

    heads: Any = None
    direction: str = "denoise"
    site: str = "z"
    eps: float = EPS_DENOM
    engine: str = "auto"

    def check(self, model: PhaseModel, options: Common) -> Patching:
        if self.site != "z":
            raise InputError(f"site {self.site!r} is not supported; patching works on per-head 'z' (site='z').")
        if self.direction not in ("denoise", "noise"):
            raise InputError(f"direction must be 'denoise' or 'noise', got {self.direction!r}.")
        eps = as_float("eps", self.eps, positive=True, fix="It is the smallest |clean - corrupt| metric gap "
                       f"that counts as defined (default {EPS_DENOM}).")
        engine = choose_engine(model, self.engine)
        cfg = model.dims
        heads = parse_heads(self.heads if self.heads is not None else [f"L{i}" for i in range(cfg.n_layers)], cfg)
        return replace(self, eps=eps, engine=engine, heads=tuple(heads))

    def units(self, model: PhaseModel, items: Any, options: Common) -> Units:
        """The source's ``z`` captured and the clean and corrupted items scored (three forwards of every item),
        then one unit per head: a forward of every item (``"full"``), or one query-row pass of the query-suffix
        engine over the run patched into (``"suffix"``; cells per engine call as :meth:`per_call`)."""
        K = len(self.heads)
        per_call = (max(1, -(-K // world().size)) if options.journal is None else
                    max(1, 4096 // max(1, int(items.n))))
        return Units(self.engine, item_passes=3, cells={"head": K}, cell_layers=tuple(h.layer for h in self.heads),
                     cells_per_call=per_call, unit="cell")

    def prepare(self, run: Run) -> PatchState:
        model, batch, bs = run.model, run.batch, run.options.batch_size
        clean, corrupt = batch.tokens, batch.corrupted
        base, source = (corrupt, clean) if self.direction == "denoise" else (clean, corrupt)
        layers = sorted({h.layer for h in self.heads})
        src_z = capture_z(model, source, batch.query_pos, layers, batch_size=bs)  # {layer: [N, copies, H, d]}

        def metric(tokens: torch.Tensor) -> np.ndarray:  # item blocks split across ranks under torch.distributed
            b = SimpleNamespace(tokens=tokens, query_pos=batch.query_pos, answer=batch.answer, wrong=batch.wrong)
            return query_metrics(plain_forward(model), b, batch_size=bs, desc="patch")["logit_diff"]

        item_clean, item_corrupt = metric(clean), metric(corrupt)
        eng = model.query_engine(base, batch.query_pos, batch_size=bs) if self.engine == "suffix" else None
        return PatchState(base, src_z, item_clean, item_corrupt, eng)

    def labels(self, run: Run, state: PatchState) -> list[str]:
        return [str(h) for h in self.heads]

    def fields(self, run: Run) -> tuple[str, ...]:
        return ("logit_diff",)

    def fingerprint(self, run: Run, state: PatchState) -> dict[str, Any]:
        return dict(corrupted=run.batch.corrupted, heads=[str(h) for h in self.heads], direction=self.direction,
                    site=self.site, seed=run.options.seed, engine=self.engine)

    def per_call(self, run: Run, state: PatchState) -> int:
        if run.options.journal is None:  # each rank's whole share in one call: nothing to write between cells
            return max(1, -(-len(self.heads) // world().size))
        # a round per engine pass (per head with full forwards): the journal is written after each
        return max(1, 4096 // max(1, len(run.batch))) if self.engine == "suffix" else 1

    def compute(self, run: Run, state: PatchState, idx: list[int]) -> list[tuple[np.ndarray]]:
        batch, heads, src = run.batch, self.heads, state.source_z
        if state.engine is not None:
            cells = [Cell(heads[i].layer, [heads[i].head], src[heads[i].layer][:, 0, [heads[i].head]]) for i in idx]
            return [(answer_metrics(lg, batch.answer, batch.wrong)["logit_diff"],) for lg in state.engine.run(cells)]
        return [(answer_metrics(query_logits(_query_patch(run.model, heads[i], src[heads[i].layer]), state.base,
                                             batch.query_pos, batch_size=run.options.batch_size),
                                batch.answer, batch.wrong)["logit_diff"],) for i in idx]

    def result(self, run: Run, state: PatchState, parts: list[tuple[np.ndarray]]) -> PhasePatch:
        patched = np.stack([p[0] for p in parts])  # [heads, N]
        res = run.batch.frame["residue"].to_numpy()
        M, o = run.modulus, run.options
        L, H = run.model.dims.n_layers, run.model.dims.n_heads
        heads = self.heads

        def stats(groups: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
            return recovery(state.item_clean, state.item_corrupt, patched, groups, n, self.direction, self.eps,
                            n_bootstrap=o.n_bootstrap, seed=o.seed)

        by_residue, by_phase = stats(res, M), stats(res % run.stride, run.stride)
        rec, lo, hi, und_k, mc, mx, mp_k = by_residue
        li = np.array([h.layer for h in heads], dtype=int)
        hi_ = np.array([h.head for h in heads], dtype=int)

        def grid(values: np.ndarray, fill: Any = np.nan) -> np.ndarray:
            out = np.full((L, H, M), fill, dtype=np.asarray(values).dtype if fill is False else float)
            out[li, hi_] = values
            return out

        coords = {"layer": np.arange(L), "head": np.arange(H), "residue": np.arange(M)}
        lab = Labelled(grid(rec), ("layer", "head", "residue"), coords, grid(lo), grid(hi),
                       name=f"{self.direction}_recovery")
        frames = (recovery_frame(heads, by_residue, res, M, "residue", run.stride),
                  recovery_frame(heads, by_phase, res % run.stride, run.stride, "phase", run.stride))
        return PhasePatch(lab, grid(und_k, False), mc, mx, grid(mp_k), heads, self.direction, run.stride, M,
                           state.item_clean, state.item_corrupt, patched, res, *frames,
                           run.metadata(engine=self.engine))


@public
def patch(
    model: PhaseModel,
    heads: Any = None,
    task: Any = None,
    *,
    direction: Literal["denoise", "noise"] = "denoise",
    site: str = "z",
    eps: float = EPS_DENOM,
    engine: str = "auto",
    **options: Unpack[ResamplingOptions],
) -> PhasePatch:
    """Patch each head's query-position ``z`` between clean items and their corrupted twins.

    Args:
        heads: which heads (default: all); any head spec ``parse_heads`` accepts.
        task, phase, n_per_residue, residues, seed, batch_size, stride, progress, journal, n_bootstrap: the common
            options (docs/api.md). A journal holds finished cells (heads); its fingerprint covers the model,
            the clean and corrupted items, the heads, direction, site, seed, batch size and engine, so a
            journal of another run is refused.
        direction: ``"denoise"`` patches clean ``z`` into the corrupted run; ``"noise"`` the reverse.
        site: only ``"z"`` (the per-head input of the output projection) is supported.
        eps: the smallest ``|M_clean - M_corrupt|`` for which recovery is defined.
        engine: ``"auto"``, ``"suffix"`` (query rows over a cached prefix) or ``"full"``.
    """
    arguments = arguments_of(patch, locals())
    return run(Patching.from_arguments(arguments), model, task, arguments)


def _query_patch(model: Any, head: Head, source: torch.Tensor):
    """A ``Forward`` that writes ``head``'s source ``z`` ``[N, copies, H, d]`` at each row's query slot (copy k's
    rows from copy k of the source)."""

    def run(tokens: torch.Tensor, query_pos: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        def hook(z: torch.Tensor, hook: HookContext) -> torch.Tensor:
            z = z.clone()
            src = source[items, :, head.head].transpose(0, 1).flatten(0, 1)  # copy-major rows [copies * b, d]
            at = hook.rows(query_pos, z.shape[1]).to(z.device)
            z[torch.arange(z.shape[0], device=z.device), at, head.head] = src.to(device=z.device, dtype=z.dtype)
            return z

        return model_logits(model, tokens, query_pos, [(z_name(head.layer), hook)])

    return run
