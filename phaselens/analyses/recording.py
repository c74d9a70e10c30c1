"""Recorders: attention into compressed entries (read side) and compressor gate weights (write side).

``phaselens.record(model, batch_or_task)`` runs the items once with hooks that keep only what is needed
(the query row of each pattern, and gate weights reduced on the fly) and returns a :class:`PhaseRecording`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Unpack

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from phaselens.analyses.runner import Analysis, CommonOptions, Run, arguments_of, public, run
from phaselens.analyses.scoring import model_logits
from phaselens.contract import hooknames
from phaselens.contract.protocol import HookContext, PhaseModel
from phaselens.core.geometry import PhaseSpec
from phaselens.core.labelled import Labelled
from phaselens.errors import NotApplicableError
from phaselens.results.entry_reads_writes import READ_QUANTITIES, PhaseRecording
from phaselens.stats.by_residue import residue_mean_ci


class _Accumulator:
    """Per-item values and per-call gate sums (each reduced over its call's items and entries), in call order.

    One accumulator per block of items; :meth:`merged` joins blocks in item order, so the final sums add the
    same terms in the same order however the blocks were split across ranks."""

    def __init__(self) -> None:
        self.read: dict[tuple[str, int], list[Tensor]] = {}
        self.gate_item: dict[tuple[str, int], list[Tensor]] = {}
        self.profile_sum: dict[tuple[int, str], list[Tensor]] = {}
        self.entropy_sum: dict[tuple[int, str], list[Tensor]] = {}
        self.count: dict[tuple[int, str], int] = {}

    def add(self, store: dict, key: tuple, value: Tensor) -> None:
        store.setdefault(key, []).append(value.detach().float().cpu())

    def to_unit(self) -> dict[str, np.ndarray]:
        """One block's values as named arrays (a journal unit): ``"read/{q}/{layer}/{call}"``, ...

        Every array is C-contiguous, as a journal or another rank gives it back: float32 reductions in
        :func:`_assemble` add in an order that depends on the strides, so a unit must look the same whether
        it stayed in memory or was read back (a strided gate profile made a resumed run differ in the last bit).
        """
        out: dict[str, np.ndarray] = {}
        for name in ("read", "gate_item", "profile_sum", "entropy_sum"):
            for key, values in getattr(self, name).items():
                for i, v in enumerate(values):
                    out["/".join([name, *map(str, key), str(i)])] = np.ascontiguousarray(v.numpy())
        for key, n in self.count.items():
            out["/".join(["count", *map(str, key)])] = np.asarray([n])  # 1-d: safetensors keeps its shape
        return out

    @staticmethod
    def merged(units: list[dict[str, np.ndarray]]) -> _Accumulator:
        """The blocks' units joined in item order (each block's calls in call order)."""
        out = _Accumulator()
        for unit in units:
            calls: dict[tuple[str, tuple], list[tuple[int, Tensor]]] = {}
            for name, value in unit.items():
                store, *key = name.split("/")
                if store == "count":
                    k = (int(key[0]), key[1])
                    out.count[k] = out.count.get(k, 0) + int(np.asarray(value).sum())
                    continue
                *key, call = key
                typed = tuple(int(x) if x.lstrip("-").isdigit() else x for x in key)
                value = np.ascontiguousarray(value)  # one layout, however the unit arrived (see to_unit)
                calls.setdefault((store, typed), []).append((int(call), torch.from_numpy(value)))
            for (store, key), values in calls.items():
                getattr(out, store).setdefault(key, []).extend(v for _, v in sorted(values, key=lambda x: x[0]))
        return out


def _ordered_sum(terms: list[Tensor]) -> Tensor:
    """``terms[0] + terms[1] + ...`` left to right (the order a running sum over the calls would use)."""
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def _target_gate(alpha: Tensor, entries: Tensor, offsets: Tensor, first_entry: int) -> Tensor:
    """Mean gate weight at the target's (entry, offset) pairs: ``[b, Hkv]``.

    ``alpha`` ``[b, E, W, Hkv(, d)]`` (entries counted from ``first_entry``); ``entries`` / ``offsets`` ``[b, k]``.
    """
    b, E = alpha.shape[:2]
    rel = entries - first_entry
    ok = (rel >= 0) & (rel < E)
    rows = torch.arange(b)[:, None].expand_as(rel)
    picked = alpha[rows, rel.clamp(0, max(E - 1, 0)), offsets]  # [b, k, Hkv(, d)]
    if picked.dim() == 4:  # per-channel gates: average the picked weights only, not the whole tensor
        picked = picked.mean(-1)
    picked = torch.where(ok[..., None], picked, torch.nan)
    return picked.nanmean(1)


@dataclass(frozen=True)
class RecordState:
    """The items' frame, indexed 0..N-1 (blocks are read from it by position)."""

    frame: pd.DataFrame


@dataclass(frozen=True)
class Record(Analysis[RecordState]):
    """Hooks keep each item's query row of every pattern and reduce the gates on the fly, one block at a time."""

    name = "record"
    stage = "record"

    def prepare(self, run: Run) -> RecordState:
        return RecordState(run.batch.frame.reset_index(drop=True))

    def fields(self, run: Run) -> None:
        return None  # a block's unit is a dict of named arrays (which layers and paths depends on the model)

    @torch.no_grad()
    def compute(self, run: Run, state: RecordState, idx: list[int]) -> list[dict[str, np.ndarray]]:
        return [_record_block(run, state.frame.iloc[run.blocks[b]], run.blocks[b]).to_unit() for b in idx]

    def result(self, run: Run, state: RecordState, parts: list[dict[str, np.ndarray]]) -> PhaseRecording:
        acc = _Accumulator.merged(parts)
        dims = run.model.dims
        return _assemble(acc, state.frame, list(dims.phase_specs), dims.n_layers, dims.n_heads, dims,
                         run.batch, run.stride, run.metadata())


def _record_block(run: Run, fr: pd.DataFrame, sl: slice) -> _Accumulator:
    """What the hooks keep from one block of items (``fr``: its rows of the frame)."""
    model = run.model
    acc = _Accumulator()
    qp = torch.as_tensor(fr["query_pos"].to_numpy().copy())
    rows = torch.arange(len(qp))
    t_k = torch.as_tensor(fr["t_K"].to_numpy().copy())
    t_v = torch.as_tensor(fr["t_V"].to_numpy().copy())
    names = model.hook_dict
    hooks = []
    for layer, spec in enumerate(model.dims.phase_specs):
        full = hooknames.pattern(layer) in names
        # a layer with entries but no phase (DeepSeek-V4.1's ratio-1 layers: one entry per token) is read
        # with stride-1 geometry: the key's entry is the key's own token
        entry_spec = spec if spec is not None or hooknames.pattern_entry(layer) not in names else PhaseSpec(1)
        hooks += _read_hooks(acc, layer, entry_spec, rows, qp, t_k, t_v, full)
        if spec is not None:
            for path, hname in hooknames.gates(layer, names):
                hooks.append((hname, _gate_hook(acc, layer, path, spec, t_k, t_v)))
    model_logits(model, run.batch.tokens[sl], qp, hooks)
    return acc


@public
def record(
    model: PhaseModel,
    task: Any = None,
    **options: Unpack[CommonOptions],
) -> PhaseRecording:
    """Record read-side attention and write-side gates at each item's query position.

    Args:
        model: a phaselens model.
        task: a task (``None``: the model's default task) or a prepared TaskBatch.
        phase, n_per_residue, residues, seed, batch_size, stride, progress, journal: the common options
            (docs/api.md); a journal holds each finished block's recorded values.

    Example:
        >>> rec = phaselens.record(phaselens.load("zoo:w4s4"), n_per_residue=32)  # doctest: +SKIP
        >>> rec.read["key_entries"].sel(layer=1).values  # [head, residue]  # doctest: +SKIP
    """
    arguments = arguments_of(record, locals())
    return run(Record.from_arguments(arguments), model, task, arguments)


def _read_hooks(acc, layer, spec, rows, qp, t_k, t_v, full_pattern: bool) -> list:
    """Hooks that keep the query row of each pattern. Query rows are relative to the call's first position
    (``hook.query_start``, nonzero only under chunked prefill)."""

    def qrow(pattern: Tensor, hook: HookContext) -> Tensor:
        _single_copy(hook)
        at = hook.rows(qp, pattern.shape[2]).to(pattern.device)
        return pattern[rows.to(pattern.device), :, at].float().cpu()

    if spec is None and full_pattern:
        def full(pattern: Tensor, hook: Any) -> None:
            row = qrow(pattern, hook)  # [b, H, keys]
            acc.add(acc.read, ("local", layer), row.sum(-1))
            acc.add(acc.read, ("sink", layer), 1 - row.sum(-1))
            acc.add(acc.read, ("key_token", layer), row[rows, :, t_k])
            acc.add(acc.read, ("value_token", layer), row[rows, :, t_v])
        return [(hooknames.pattern(layer), full)]
    def local(pattern: Tensor, hook: Any) -> None:
        acc.add(acc.read, ("local", layer), qrow(pattern, hook).sum(-1))

    def sink(pattern: Tensor, hook: Any) -> None:
        acc.add(acc.read, ("sink", layer), qrow(pattern, hook))

    out = [(hooknames.pattern_local(layer), local), (hooknames.pattern_sink(layer), sink)]
    if spec is None:  # sliding-only layer: no entries
        return out
    key_ents = torch.as_tensor(np.stack(spec.entries_containing(t_k.numpy())))
    val_ents = torch.as_tensor(np.stack(spec.entries_containing(t_v.numpy())))

    def entries(pattern: Tensor, hook: Any) -> None:
        row = qrow(pattern, hook)  # [b, H, E]
        E = row.shape[-1]
        # One column past the end absorbs entries that do not exist yet (a window still open at the query).
        onehot_k = torch.zeros(len(rows), E + 1, dtype=torch.bool).scatter_(1, key_ents.clamp(max=E), True)[:, :E]
        onehot_v = torch.zeros(len(rows), E + 1, dtype=torch.bool).scatter_(1, val_ents.clamp(max=E), True)[:, :E]
        total = row.sum(-1)
        k_mass = (row * onehot_k[:, None]).sum(-1)
        v_mass = (row * onehot_v[:, None]).sum(-1)
        union = (row * (onehot_k | onehot_v)[:, None]).sum(-1)
        acc.add(acc.read, ("key_entries", layer), k_mass)
        acc.add(acc.read, ("value_entries", layer), v_mass)
        acc.add(acc.read, ("other_entries", layer), total - union)
        acc.add(acc.read, ("entries", layer), total)

    return out + [(hooknames.pattern_entry(layer), entries)]


def _single_copy(hook: HookContext) -> None:
    if hook.row_shift is not None:
        raise NotApplicableError(
            "record() on a wrapper that runs shifted copies (phase repair) would mix copies in which the needle "
            "sits at different phases; record the wrapped model instead (ensemble.model)."
        )


def _window_concentration_sum(alpha: Tensor, rows: int = 16) -> Tensor:
    """Sum over items and entries of exp(H(alpha)) over offsets: ``[b, E, W, Hkv(, d)]`` -> ``[Hkv(, d)]``.

    Tiled over items so that each tile's temporaries stay in cache (about 2x faster than one pass on
    w8s4's gates); the log is taken in place.
    """
    # sum(0).sum(0), not sum((0, 1)): torch's CPU reduction over two leading axes of a strided view is
    # about 40x slower than two single-axis reductions.
    tiles = [(-t.clamp_min(1e-30).log_().mul_(t).sum(2)).exp_().sum(0).sum(0) for t in alpha.split(rows)]
    return torch.stack(tiles).sum(0)


def _gate_hook(acc, layer, path, spec: PhaseSpec, t_k: Tensor, t_v: Tensor):
    key_ents = torch.as_tensor(np.stack(spec.entries_containing(t_k.numpy())))
    key_offs = torch.as_tensor(np.stack(spec.offsets(t_k.numpy())))
    val_ents = torch.as_tensor(np.stack(spec.entries_containing(t_v.numpy())))
    val_offs = torch.as_tensor(np.stack(spec.offsets(t_v.numpy())))

    def fn(alpha: Tensor, hook: HookContext) -> None:
        _single_copy(hook)
        a = alpha.detach().float().cpu()
        if a.shape[1] == 0:
            return
        first = int(hook.first_entry or 0)  # nonzero when a cache already held earlier entries
        acc.add(acc.gate_item, ("key", layer, path), _target_gate(a, key_ents, key_offs, first))
        acc.add(acc.gate_item, ("value", layer, path), _target_gate(a, val_ents, val_offs, first))
        # skip entries that include slots before the origin: their weights are renormalised over fewer slots
        full = a[:, max(0, spec.blocks_per_window - 1 - first) :]
        if full.shape[1] == 0:
            return
        # reduce over the offset axis (dim 2) in place: no transposed copy of the [b, E, W, Hkv(, d)] gates
        key = (layer, path)
        prof = full.sum(0).sum(0).movedim(0, -1)  # [Hkv(, d), W]; see _window_concentration_sum
        per = _window_concentration_sum(full)
        acc.profile_sum.setdefault(key, []).append(prof)
        acc.entropy_sum.setdefault(key, []).append(per)
        acc.count[key] = acc.count.get(key, 0) + full.shape[0] * full.shape[1]

    return fn


def _assemble(acc: _Accumulator, frame: pd.DataFrame, specs, L: int, H: int, cfg: Any, batch: Any, stride: int,
              meta: dict[str, Any]) -> PhaseRecording:
    residue = frame["residue"].to_numpy()
    M = int(batch.modulus)
    n = len(frame)
    values: dict[str, np.ndarray] = {}
    coords = {"layer": np.arange(L), "head": np.arange(H), "residue": np.arange(M)}
    read: dict[str, Labelled] = {}
    names = READ_QUANTITIES + tuple(q for q in ("key_token", "value_token") if any(k[0] == q for k in acc.read))
    for q in names:
        per_layer = []
        for layer in range(L):
            vals = acc.read.get((q, layer))
            per_layer.append(torch.cat(vals).numpy() if vals else np.full((n, H), np.nan))
        arr = np.stack(per_layer, 1)  # [N, L, H]
        values[q] = arr
        m, lo, hi = residue_mean_ci(arr, residue, M)
        read[q] = Labelled(m, ("layer", "head", "residue"), coords, lo, hi, name=f"mass_{q}")
    comp_layers = [i for i, s in enumerate(specs) if s is not None]
    if not comp_layers or not acc.profile_sum:
        return PhaseRecording(read, None, None, None, None, stride, M, n, values, residue, meta)
    paths = sorted({p for (_, p) in acc.profile_sum})
    Hkv = int(cfg.n_key_value_heads)
    gk, gv = [], []
    for layer in comp_layers:
        for side, out in (("key", gk), ("value", gv)):
            per_path = [torch.cat(acc.gate_item[(side, layer, p)]).numpy() for p in paths if (side, layer, p) in acc.gate_item]
            # mean over the k/v paths: [N, Hkv]; NaN when no entry completed in any recorded call
            out.append(np.nanmean(np.stack(per_path), 0) if per_path else np.full((n, Hkv), np.nan))
    gcoords = {"layer": np.array(comp_layers), "kv_head": np.arange(Hkv), "residue": np.arange(M)}
    values["gate_key"], values["gate_value"] = np.stack(gk, 1), np.stack(gv, 1)
    mk, lk, hk = residue_mean_ci(values["gate_key"], residue, M)
    gate_key = Labelled(mk, ("layer", "kv_head", "residue"), gcoords, lk, hk, name="gate_key")
    mv, lv, hv = residue_mean_ci(values["gate_value"], residue, M)
    gate_value = Labelled(mv, ("layer", "kv_head", "residue"), gcoords, lv, hv, name="gate_value")
    W = max(s.window for s in specs if s is not None)
    prof = np.full((len(comp_layers), len(paths), Hkv, W), np.nan)
    conc = np.full((len(comp_layers), len(paths), Hkv, 2), np.nan)
    for li, layer in enumerate(comp_layers):
        for pi, path in enumerate(paths):
            key = (layer, path)
            if key not in acc.profile_sum:
                continue
            p = (_ordered_sum(acc.profile_sum[key]) / acc.count[key]).numpy()  # [Hkv, (d,) W]
            per = (_ordered_sum(acc.entropy_sum[key]) / acc.count[key]).numpy()  # [Hkv(, d)]
            static = np.exp(-(np.clip(p, 1e-12, None) * np.log(np.clip(p, 1e-12, None))).sum(-1))
            if p.ndim == 3:  # vector gates: average the per-channel profile and measures over channels
                static, per, p = static.mean(-1), per.mean(-1), p.mean(1)
            prof[li, pi, :, : p.shape[-1]] = p
            conc[li, pi, :, 0], conc[li, pi, :, 1] = static, per
    pcoords = {"layer": np.array(comp_layers), "path": np.array(paths), "kv_head": np.arange(Hkv), "offset": np.arange(W)}
    gate_profile = Labelled(prof, ("layer", "path", "kv_head", "offset"), pcoords, name="gate_profile")
    ccoords = {**{k: pcoords[k] for k in ("layer", "path", "kv_head")}, "measure": np.array(["static", "per_window"])}
    concentration = Labelled(conc, ("layer", "path", "kv_head", "measure"), ccoords, name="gate_concentration")
    return PhaseRecording(read, gate_key, gate_value, gate_profile, concentration, stride, M, n, values, residue, meta)
