"""The query engines' shared design: the per-slot engine every model kind subclasses, the loop over cells
(:class:`~phaselens.contract.cells.Cell`: one intervention each) by layer, and the engine for items whose query
positions differ.

An intervention on ``z`` at the query position changes nothing at earlier positions, so a model's *slot engine*
runs the clean prefix once into the model's own cache and then only the query rows per cell. The parts every
kind shares live here (:class:`SlotEngine`):

* the clean query step: the query row through every layer once, keeping each layer's input state and ``z``;
* a pass: ``C`` cells at one layer become ``C x n`` rows (row ``c * n + i`` is cell ``c`` on item ``i``), the
  clean input state of that layer repeated ``C`` times, and one ``hook_z`` replacement
  (:func:`cell_rows`, :func:`replace_z`);
* how many cells go into a pass (``rows_per_pass`` and a memory budget ``pass_bytes`` per pass);
* the prefix views repeated for a pass width, built once per width and shared by its passes (:meth:`SlotEngine.repeated`).

A model kind keeps only what truly differs: its prefill, its embedding of the query row, and
:meth:`SlotEngine.run_layers` (its layers from ``start`` on over a read-only, repeated view of its cache, with
the given hooks; :mod:`.cache_repeat` repeats a transformers cache). Every kind's engine subclasses
:class:`SlotEngine`: ``phaselens.models.compressed.engine.SuffixEngine``, ``...deepseek_v4.engine.V4SuffixEngine``,
``...deepseek_v41.engine.V41SuffixEngine`` and ``...causal_lm.engine.CausalSuffixEngine``; analyses reach them only
through the ``query_engine`` capability. This module imports no model.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from phaselens.contract.cells import PASS_BYTES, Cell
from phaselens.contract.hooknames import z as z_site
from phaselens.core import margins
from phaselens.errors import InputError

HookList = list[tuple[str, Callable[..., Tensor | None]]]
V = TypeVar("V")


def repeat_rows(value: Any, copies: int) -> Any:
    """``value`` repeated ``copies`` times along dim 0 (row ``c * n + i`` is copy ``c`` of row ``i``); tuples,
    lists and dicts of tensors element-wise; ``None`` and 0-d tensors as they are."""
    if isinstance(value, tuple | list):
        return type(value)(repeat_rows(v, copies) for v in value)
    if isinstance(value, dict):
        return {k: repeat_rows(v, copies) for k, v in value.items()}
    if not isinstance(value, Tensor) or copies == 1 or value.dim() == 0:
        return value
    return value.repeat(copies, *([1] * (value.dim() - 1)))


def cell_rows(cells: Sequence[Cell], z0: Tensor) -> tuple[Tensor, Tensor]:
    """The cells of one pass as rows over the ``n`` items of ``z0`` ``[n, H, d]`` (the clean ``z`` of the layer).

    Returns ``mask`` ``[C * n, 1, H, 1]`` (bool: which heads each row replaces) and ``replacement``
    ``[C * n, 1, H, d]`` (zeros where a cell gives none), on ``z0``'s device and in its dtype.
    """
    n, H, d = z0.shape
    C = len(cells)
    mask = torch.zeros(C, H, dtype=torch.bool)
    repl = torch.zeros(C, n, H, d, dtype=z0.dtype, device=z0.device)
    for c, cell in enumerate(cells):  # one small assignment per cell: the heads of a cell go in together
        heads = list(cell.heads)
        mask[c, heads] = True
        if cell.replacement is not None:
            r = cell.replacement.to(device=repl.device, dtype=repl.dtype)
            repl[c][:, heads] = r if r.dim() == 3 else r.expand(n, -1, -1)
    mask_rows = mask.repeat_interleave(n, 0)[:, None, :, None].to(z0.device)
    return mask_rows, repl.reshape(C * n, 1, H, d)


def replace_z(mask: Tensor, replacement: Tensor) -> Callable[..., Tensor]:
    """The hook of a pass: ``z`` ``[C * n, 1, H, d]`` with the masked heads replaced (:func:`cell_rows`)."""

    def intervene(z: Tensor, *, hook: Any) -> Tensor:
        return torch.where(mask, replacement, z)

    return intervene


def run_by_layer(cells: Sequence[Cell], per_pass: Callable[[int], int],
                 run: Callable[[int, list[Cell]], Any], progress: Any = None) -> Any:
    """Run ``cells`` grouped by layer, at most ``per_pass(layer)`` cells per ``run(layer, cells)`` call (which
    returns ``[c, N, V]``, or a tuple of tensors ``[c, ...]``); a query engine's shared loop. Returns ``[C, N, V]``
    (or the tuple, each stacked) in the cells' order."""
    out: list[Any] = [None] * len(cells)
    by_layer: dict[int, list[int]] = {}
    for i, c in enumerate(cells):
        by_layer.setdefault(int(c.layer), []).append(i)
    for layer, idxs in sorted(by_layer.items()):
        step = per_pass(layer)
        for j in range(0, len(idxs), step):
            chunk = idxs[j : j + step]
            got = run(layer, [cells[i] for i in chunk])
            for k, i in enumerate(chunk):
                out[i] = tuple(g[k] for g in got) if isinstance(got, tuple) else got[k]
            if progress is not None:
                progress.update(len(chunk))
    if out and isinstance(out[0], tuple):
        return tuple(torch.stack(part) for part in zip(*out))
    return torch.stack(out)


class SlotEngine:
    """A query-suffix engine for ``n`` items that share one query slot ``q``: the shared part of every kind's.

    A subclass implements :meth:`prefill` (the clean prefix into its model's cache, then :meth:`clean_step`
    with the query row's input to the first layer) and :meth:`run_layers` (and :meth:`row_bytes` when passes
    need a memory bound).

    Args:
        model: a model of the kind; tokens: ``[n, T]`` ids that share the query slot ``query_pos`` (checked by the
            model's ``_check_tokens``; only ``tokens[:, :q + 1]`` is read).
        rows_per_pass: at most this many rows (cells x items) per pass; pass_bytes: the memory budget of one.

    Attributes (after :meth:`clean_step`):
        n, q: items and query slot.
        clean_logits: ``[n, V]`` at the query slot.
        clean_z: per layer ``[n, H, d]``, the clean ``z`` at the query slot.
        resid_pre: per layer, the query row's input state to that layer (what the kind's layers take: a
            ``[n, 1, D]`` residual, ``[n, 1, hc, D]`` hyper-connection streams, or a tuple of tensors).
    """

    clean_logits: Tensor
    clean_z: list[Tensor]
    resid_pre: list[Any]
    # a kind whose model reports its discrete steps' rounding margins (phaselens.core.margins) sets
    # this: then every pass records them, and ``last_fragile`` says which cells' rows a rounding could flip
    measures_margins: bool = False
    layer_row_bytes: Sequence[int] = ()  # per layer, the bytes of one row of a pass from it (row_bytes)

    def __init__(self, model: Any, tokens: Tensor, query_pos: int, *, rows_per_pass: int = 4096,
                 pass_bytes: int = PASS_BYTES) -> None:
        tokens = model._check_tokens(tokens)
        self.model, self.n, self.q = model, int(tokens.shape[0]), int(query_pos)
        self.rows_per_pass, self.pass_bytes = int(rows_per_pass), int(pass_bytes)
        self._views: dict[tuple[Hashable, int], Any] = {}
        # [n] bool: items whose clean prefix or query step took a decision within rounding of flipping
        self.prefix_fragile: Tensor | None = None
        self.last_fragile: Tensor | None = None  # [C, n] after run(), where measured
        self.prefill(tokens)

    # ---- the kind's part -----------------------------------------------------------------------------
    def prefill(self, tokens: Tensor) -> None:
        """Run the clean prefix ``tokens[:, :q]`` (checked ids ``[n, T]``) into the model's cache, then
        :meth:`clean_step`."""
        raise NotImplementedError

    def run_layers(self, start: int, state: Any, copies: int, hooks: HookList, record: list[Any] | None = None
                   ) -> Tensor:
        """Run the query rows ``state`` (``copies * n`` rows: the input to layer ``start``) through layers
        ``start..L-1`` over the clean prefix (read, never written) with ``hooks`` active, appending each layer's
        input state to ``record`` when given; the logits ``[copies * n, V]`` at the query slot."""
        raise NotImplementedError

    def row_bytes(self, layer: int) -> int:
        """Memory of one row of a pass from ``layer``: :attr:`layer_row_bytes`, which a kind fills after its
        clean step (empty, 0: no bound but ``rows_per_pass``)."""
        return self.layer_row_bytes[layer] if self.layer_row_bytes else 0

    # ---- shared --------------------------------------------------------------------------------------
    def clean_step(self, state: Any, n_layers: int) -> None:
        """The clean query row from the first layer (``state``: its input): sets :attr:`resid_pre`,
        :attr:`clean_z` and :attr:`clean_logits`."""
        zs: dict[int, Tensor] = {}

        def keep(z: Tensor, *, hook: Any) -> None:
            zs[hook.layer()] = z[:, 0].clone()

        record: list[Any] = []
        self.clean_logits = self.run_layers(0, state, 1, [(z_site(i), keep) for i in range(n_layers)], record)
        self.resid_pre, self.clean_z = record, [zs[i] for i in range(n_layers)]

    @torch.no_grad()
    def run(self, cells: Sequence[Cell], *, progress: Any = None) -> Tensor:
        """Logits at the query slot under each cell: ``[C, n, V]``. Where the kind measures rounding margins,
        :attr:`last_fragile` ``[C, n]`` then flags each cell's items whose decisions (the prefix's, or the pass's
        own top-k picks and FP8 roundings) were within rounding of flipping."""
        if not self.measures_margins:
            self.last_fragile = None
            return run_by_layer(cells, self.cells_per_pass, self._pass, progress)
        logits, fragile = run_by_layer(cells, self.cells_per_pass, self._measured_pass, progress)
        if self.prefix_fragile is not None:
            fragile = fragile | self.prefix_fragile.to(fragile.device)
        self.last_fragile = fragile
        return logits

    def _measured_pass(self, layer: int, cells: Sequence[Cell]) -> tuple[Tensor, Tensor]:
        with margins.recording(len(cells) * self.n) as rec:
            logits = self._pass(layer, cells)
        return logits, rec.flags.view(len(cells), self.n)

    def cells_per_pass(self, layer: int) -> int:
        """Cells in one pass from ``layer``: rows bounded by ``rows_per_pass`` and by ``pass_bytes``."""
        rows, per_row = self.rows_per_pass, self.row_bytes(layer)
        if per_row > 0:
            rows = min(rows, self.pass_bytes // per_row)
        return max(1, rows // max(self.n, 1))

    def _pass(self, layer: int, cells: Sequence[Cell]) -> Tensor:
        """One pass: ``cells`` (all at ``layer``) as ``C x n`` rows from ``layer`` up; ``[C, n, V]``."""
        C = len(cells)
        mask, repl = cell_rows(cells, self.clean_z[layer])
        state = repeat_rows(self.resid_pre[layer], C)
        return self.run_layers(layer, state, C, [(z_site(layer), replace_z(mask, repl))]).view(C, self.n, -1)

    def repeated(self, key: Hashable, copies: int, build: Callable[[], V]) -> V:
        """The view ``build()`` of the prefix for passes of ``copies`` cells, built once per width and shared by
        every pass of it (a new width drops the old width's views). ``build`` must return state that passes
        only read."""
        if any(k[1] != copies for k in self._views):
            self._views = {k: v for k, v in self._views.items() if k[1] == copies}
        if (key, copies) not in self._views:
            self._views[(key, copies)] = build()
        return self._views[(key, copies)]


class QueryEngine:
    """The query-suffix engine for items whose query positions may differ.

    Rows are grouped by query slot (and a slot's rows split into pieces of at most ``batch_size``); each group
    gets one :class:`SlotEngine` (one clean prefix pass), and every cell runs on every group. Results come
    back in the items' order, so callers never see the groups.

    Args:
        model: a model with a per-slot engine (``slot_engine``).
        tokens: ``[N, T]``; query_pos: ``[N]`` the slot whose logits are scored in each row (``0..T-1``).
        slot_engine: builds the engine of one slot, ``slot_engine(model, tokens [n, T], q, rows_per_pass=...)``:
            a :class:`SlotEngine` of the model's kind.
        batch_size: at most this many rows per group, so per prefill call (``None``: a slot's rows together).
    """

    def __init__(self, model: Any, tokens: Tensor, query_pos: Tensor, *, rows_per_pass: int = 4096,
                 slot_engine: Callable[..., Any], batch_size: int | None = None) -> None:
        qp = torch.as_tensor(query_pos).long().cpu()
        if qp.dim() != 1 or len(qp) != tokens.shape[0]:
            raise InputError(f"query_pos must be [N] = [{tokens.shape[0]}], got {tuple(qp.shape)}.")
        if len(qp) and (int(qp.min()) < 0 or int(qp.max()) >= tokens.shape[-1]):
            raise InputError(f"query_pos must be slots in 0..{tokens.shape[-1] - 1}, got {qp.tolist()[:8]}.")
        self.N = len(qp)
        self.groups: list[tuple[Tensor, Any]] = []
        self.last_fragile: Tensor | None = None
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise InputError(f"batch_size must be a positive int or None, got {batch_size!r}.")
        for q in torch.unique(qp).tolist():
            slot_rows = torch.nonzero(qp == q).flatten()
            step = batch_size or len(slot_rows)
            for rows in slot_rows.split(step):
                self.groups.append((rows, slot_engine(model, tokens[rows], int(q), rows_per_pass=rows_per_pass)))
        if not bool(torch.isfinite(self.clean_logits).all()):  # a NaN/inf weight: never a map of NaN effects
            from phaselens.contract.finite import raise_nonfinite

            raise_nonfinite(model, lambda: model(tokens))

    @property
    def clean_logits(self) -> Tensor:
        """Clean logits at each item's query slot ``[N, V]``."""
        return self._scatter([eng.clean_logits for _, eng in self.groups], 0)

    def clean_z(self, layer: int) -> Tensor:
        """Clean per-head ``z`` at each item's query slot ``[N, H, d]``."""
        return self._scatter([eng.clean_z[layer] for _, eng in self.groups], 0)

    def run(self, cells: Sequence[Cell]) -> Tensor:
        """Logits at each item's query slot under each cell: ``[C, N, V]``.

        A cell's per-item replacement ``[N, h, d]`` is split among the groups by row.
        """
        outs, fragile = [], []
        for rows, eng in self.groups:
            sub = [c if c.replacement is None or c.replacement.dim() != 3 else
                   Cell(c.layer, c.heads, c.replacement[rows]) for c in cells]
            outs.append(eng.run(sub))
            fragile.append(getattr(eng, "last_fragile", None))
        # [C, N] bool where the slot engines measure rounding margins (SlotEngine.last_fragile), else None
        self.last_fragile = None if any(f is None for f in fragile) else self._scatter(fragile, 1)
        return self._scatter(outs, 1)

    def _scatter(self, parts: list[Tensor], dim: int) -> Tensor:
        if len(parts) == 1:
            return parts[0]
        shape = list(parts[0].shape)
        shape[dim] = self.N
        out = parts[0].new_empty(shape)
        for (rows, _), part in zip(self.groups, parts):
            out.index_copy_(dim, rows.to(out.device), part)
        return out


def query_engine(model: Any, engine: type[SlotEngine], tokens: Tensor, query_pos: Tensor, *, hooks_active: bool,
                 rows_per_pass: int = 4096, batch_size: int | None = None, pass_bytes: int = PASS_BYTES
                 ) -> QueryEngine:
    """Every kind's ``query_engine`` capability: a :class:`QueryEngine` over ``tokens`` ``[N, T]`` (checked ids)
    with query slots ``query_pos`` ``[N]``, one ``engine`` per query slot and piece of at most ``batch_size`` rows.

    Raises :class:`InputError` when ``hooks_active``: the engine runs the clean prefix without hooks and could not
    honour them.
    """
    if hooks_active:
        raise InputError("the query-suffix engine runs the clean prefix without hooks, so it cannot honour hooks "
                         "that are active on the model (model.hooks(...) or a knockout context); pass engine='full'.")

    def slot(m: Any, rows: Tensor, q: int, *, rows_per_pass: int) -> SlotEngine:
        return engine(m, rows, q, rows_per_pass=rows_per_pass, pass_bytes=pass_bytes)

    return QueryEngine(model, tokens, query_pos, rows_per_pass=rows_per_pass, slot_engine=slot, batch_size=batch_size)
