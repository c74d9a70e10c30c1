"""Head knockouts at the input of the output projection (per-head ``z``).

A :class:`Knockout` (:func:`knocked_out`) is a pure hook factory: ``ko.fwd_hooks(positions)`` returns the
``(name, fn)`` pairs that knock its heads out at ``positions`` of one call, on any input; nothing about a call is
stored on it. The ``with`` block is sugar for interactive use::

    from phaselens.analyses import knocked_out
    ko = knocked_out(model, ["L1H2", "L0KV1"], method="mean", positions="last")
    with ko:
        logits = model(tokens)                     # knocked out at the last position of every row
    logits = model.run_with_hooks(tokens, fwd_hooks=ko.fwd_hooks(query_pos))   # at explicit slots [B]

Methods: ``"zero"``; ``"mean"`` (the mean ``z`` of each head over a disjoint calibration set, at the same
position, as the paper does); ``"resample"`` (``z`` of a random calibration item). Hooks are removed in
``finally``, whatever raises inside the block.

The analysis ``phaselens.analyses.knocked_out(model, heads, task)`` evaluates the task's items with the heads knocked out
(a ``PhaseEval``: :mod:`phaselens.analyses.knockout_evaluation`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from phaselens.analyses.items import is_batch, resolve_task
from phaselens.analyses.scoring import model_logits
from phaselens.contract import hooknames
from phaselens.contract.protocol import HookContext, PhaseModel
from phaselens.core.heads import Head, by_layer, parse_heads
from phaselens.errors import InputError

Method = Literal["mean", "zero", "resample"]
METHODS = ("mean", "zero", "resample")
CALIBRATION_SEED = 7_919  # calibration items are built with this seed, disjoint from evaluation seeds


def z_name(layer: int) -> str:
    """The per-head ``z`` hook of ``layer`` (the contract's hook table)."""
    return hooknames.z(layer)


def check_method(method: Any, allowed: tuple[str, ...] = METHODS) -> str:
    if not isinstance(method, str) or method not in allowed:
        raise InputError(f"method must be one of {allowed}, got {method!r}.")
    return str(method)


@torch.no_grad()
def capture_z(model: Any, tokens: Tensor, query_pos: Tensor, layers: list[int], *, batch_size: int = 64) -> dict[int, Tensor]:
    """Per-head ``z`` at each item's query slot: ``{layer: [N, copies, H, d]}`` (float32, CPU).

    ``copies`` is 1 for a plain model; a wrapper that runs shifted copies (phase repair) gives one ``z`` per
    copy, in the order of the copies.
    """
    out: dict[int, list[Tensor]] = {layer: [] for layer in layers}
    for i in range(0, tokens.shape[0], batch_size):
        qp = query_pos[i : i + batch_size]

        def grab(z: Tensor, hook: HookContext, _qp: Tensor = qp) -> None:
            at = hook.rows(_qp, z.shape[1]).to(z.device)
            got = z[torch.arange(len(at), device=z.device), at].detach().float().cpu()  # [copies * b, H, d]
            out[hook.layer()].append(got.view(-1, len(_qp), *got.shape[1:]).transpose(0, 1))

        model_logits(model, tokens[i : i + batch_size], qp, [(z_name(layer), grab) for layer in layers])
    return {layer: torch.cat(v) for layer, v in out.items()}


@dataclass(frozen=True)
class Calibration:
    """Per-head query-position ``z`` of calibration items: ``{layer: [N, H, d]}``."""

    z: dict[int, Tensor]
    source: str = "calibration"

    def mean(self, layer: int) -> Tensor:
        return self.z[layer].mean(0)


CALIBRATION_ITEMS = 256  # items calibrate builds from the task by default


def calibration_items(method: str, calibration: Any, modulus: int, n: int = CALIBRATION_ITEMS) -> int:
    """Items :func:`calibrate` forwards for a ``method`` knockout given ``calibration`` (``None``: ``n``
    items of the task, rounded down to whole residues mod ``modulus``; 0 for zero knockouts and for a
    :class:`Calibration` already computed)."""
    if method == "zero" or isinstance(calibration, Calibration):
        return 0
    if calibration is None:
        return max(1, n // modulus) * modulus
    if isinstance(calibration, Tensor):
        return int(calibration.shape[0])
    return len(calibration.query_pos) if hasattr(calibration, "query_pos") else 0


def calibrate(model: Any, calibration: Any, layers: list[int], *, task: Any = None, n: int = CALIBRATION_ITEMS,
              batch_size: int = 64) -> Calibration:
    """Collect calibration ``z`` from a TaskBatch, a ``[N, T]`` token tensor (last position), or the task
    (``n`` items), ``batch_size`` items per forward."""
    if isinstance(calibration, Calibration):
        missing = sorted(set(layers) - set(calibration.z))
        if missing:
            raise InputError(f"the calibration holds layers {sorted(calibration.z)}, not {missing}; calibrate "
                             "on every layer you knock out.")
        return calibration
    if calibration is None:
        from phaselens.tasks.residues import check_modulus

        task = resolve_task(model, task)
        modulus = check_modulus(model.dims.analysis_spec, getattr(task, "modulus", None))
        calibration = task.build(model.dims.analysis_spec, n_per_residue=max(1, n // modulus), seed=CALIBRATION_SEED)
    if isinstance(calibration, Tensor):
        if calibration.dim() != 2 or calibration.shape[0] == 0 or calibration.shape[1] == 0:
            raise InputError(f"a calibration tensor is [N, T] token ids with N, T >= 1, got {tuple(calibration.shape)}.")
        tokens = calibration
        qp = torch.full((tokens.shape[0],), tokens.shape[1] - 1)
        source = f"{tokens.shape[0]} token rows"
    elif is_batch(calibration):
        if len(calibration) == 0:
            raise InputError("the calibration batch is empty; build it with n_per_residue >= 1.")
        tokens, qp = calibration.tokens, calibration.query_pos
        source = f"{len(qp)} task items"
    else:
        raise InputError(f"calibration must be a TaskBatch, a [N, T] token tensor or a Calibration, got "
                         f"{type(calibration).__name__}.")
    z = capture_z(model, tokens, qp, layers, batch_size=batch_size)
    return Calibration({layer: v.flatten(0, 1) for layer, v in z.items()}, source)


@dataclass(frozen=True, eq=False)
class Knockout:
    """A knockout of ``heads``: a factory of forward hooks (see the module docs).

    ``positions`` is the default of :meth:`fwd_hooks` and of the ``with`` block: ``"last"`` (the last
    position of every row), ``"all"``, an int slot, or a LongTensor ``[batch]`` of per-row slots.
    """

    model: Any
    heads: tuple[Head, ...]
    method: str
    positions: Any = "last"
    calibration: Calibration | None = None
    seed: int = 0
    _generator: torch.Generator = field(default_factory=torch.Generator, repr=False)
    _stack: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._generator.manual_seed(self.seed)

    def replacement(self, layer: int, heads: list[int], like: Tensor, rows: int, items: Tensor | None) -> Tensor:
        """Values ``[rows, len(heads), d]`` that replace the knocked-out heads.

        ``resample`` draws calibration item ``randint(seed)[item]`` for each of ``items`` (global item indices,
        so every engine and batching draws the same values), or from the generator without them.
        """
        d = like.shape[-1]
        if self.method == "zero":
            return like.new_zeros(rows, len(heads), d)
        assert self.calibration is not None
        cal = self.calibration.z[layer][:, heads].to(like.device, like.dtype)  # [Ncal, h, d]
        if self.method == "mean":
            return cal.mean(0).expand(rows, -1, -1)
        if items is not None:
            idx = resample_index(cal.shape[0], int(items.max()) + 1, self.seed)[items.cpu()]
            if len(idx) != rows:  # shifted copies: the same items once per copy
                idx = idx.repeat(rows // len(idx))
        else:
            idx = torch.randint(0, cal.shape[0], (rows,), generator=self._generator)
        return cal[idx.to(cal.device)]

    def fwd_hooks(self, positions: Any = None, *, items: Tensor | None = None) -> list[tuple[str, Any]]:
        """``(name, fn)`` pairs that knock the heads out at ``positions`` (default: ``self.positions``).

        Args:
            positions: ``"last"``, ``"all"``, an int slot or a ``[batch]`` LongTensor of slots of the original
                input (a wrapper's shifted copies and a chunked prefill's query rows are mapped through the
                hook context).
            items: ``[batch]`` global item indices (``resample`` draws by item).
        """
        pos = self.positions if positions is None else positions
        pos = check_positions(pos)
        return [(z_name(layer), self._hook(layer, hs, pos, items)) for layer, hs in by_layer(self.heads).items()]

    def _hook(self, layer: int, heads: list[int], pos: Any, items: Tensor | None):
        index = torch.tensor(heads)

        def fn(z: Tensor, hook: HookContext) -> Tensor:
            B, n = z.shape[:2]
            z = z.clone()
            idx = index.to(z.device)
            if isinstance(pos, str) and pos == "all":
                z[:, :, idx] = self.replacement(layer, heads, z, B * n, None).view(B, n, len(heads), -1)
                return z
            if isinstance(pos, str):  # "last": the last slot of each original row
                length = hook.original_length or hook.query_start + n
                slots = torch.full((B,), length - 1)
            elif isinstance(pos, int):
                slots = torch.full((B,), pos)
            else:
                slots = pos
            at = hook.rows(slots, n).to(z.device)
            if at.shape != (B,):
                raise InputError(f"knockout positions cover {len(at)} rows but the call has {B}; pass a "
                                 "[batch] tensor of slots for this call.")
            rows = torch.arange(B, device=z.device)
            z[rows[:, None], at[:, None], idx[None, :]] = self.replacement(layer, heads, z, B, items)
            return z

        return fn

    # ---- interactive sugar ---------------------------------------------------------------------------------
    def __enter__(self) -> Knockout:
        ctx = self.model.hooks(fwd_hooks=self.fwd_hooks())
        ctx.__enter__()
        self._stack.append(ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        heads = ", ".join(map(str, self.heads[:6])) + ("..." if len(self.heads) > 6 else "")
        return f"Knockout({heads}; {self.method}; positions={self.positions!r})"


def resample_index(n_cal: int, n_items: int, seed: int) -> Tensor:
    """The calibration item each of ``n_items`` items draws under ``resample``: ``[n_items]``."""
    return torch.randint(0, n_cal, (n_items,), generator=torch.Generator().manual_seed(seed))


def check_positions(pos: Any) -> Any:
    if isinstance(pos, str):
        if pos == "query":
            raise InputError("positions='query' is gone: it meant the last position of each row. Pass 'last' "
                             "for that, or each row's query slots as a [batch] tensor (batch.query_pos).")
        if pos not in ("last", "all"):
            raise InputError(f"positions must be 'last', 'all', an int or a [batch] tensor, got {pos!r}.")
        return pos
    if isinstance(pos, numbers.Integral) and not isinstance(pos, bool):
        if pos < 0:
            raise InputError(f"positions={pos} is not a slot; slots count from 0 (use 'last' for each row's last "
                             "position).")
        return int(pos)
    try:
        t = torch.as_tensor(pos)
    except (TypeError, RuntimeError, ValueError):
        raise InputError(f"positions must be 'last', 'all', an int or a [batch] tensor, got {pos!r}.") from None
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise InputError(f"positions must be a 1-D integer tensor [batch], got {t.dtype} {tuple(t.shape)}.")
    return t.long()


def knocked_out(
    model: PhaseModel,
    heads: Any,
    *,
    method: Method = "mean",
    positions: Any = "last",
    calibration: Any = None,
    task: Any = None,
    seed: int = 0,
) -> Knockout:
    """A :class:`Knockout` of ``heads`` over any input: use it as a ``with`` block (the model's calls inside it
    run with the heads knocked out) or ask it for ``fwd_hooks(positions)``. To evaluate a task with the heads
    knocked out, call the analysis ``phaselens.analyses.knocked_out(model, heads, task)`` instead.

    Args:
        model: a phaselens model (hook names ``blocks.{l}.attn.hook_z``).
        heads: ``(layer, head)``, ``"L2H3"``, ``"L2"``, ``"L2KV0"``, or a list of these.
        method: ``"mean"``, ``"zero"`` or ``"resample"``.
        positions: where the ``with`` block knocks out: ``"last"`` (each row's last position), ``"all"``, an
            int slot or a ``[batch]`` tensor of slots.
        calibration: for ``mean`` / ``resample``: a TaskBatch, a ``[N, T]`` token tensor, or a
            :class:`Calibration`; default: items of ``task`` (the model's task) built with a disjoint seed.
        seed: the draws of ``resample``.
    """
    from phaselens.contract.protocol import check_model, refuse_black_box
    from phaselens.core.checks import MAX_SEED, as_int

    check_model(model)
    refuse_black_box(model, "knocked_out")
    method = check_method(method)
    seed = as_int("seed", seed, minimum=0, maximum=MAX_SEED)
    parsed = parse_heads(heads, model.dims)
    cal = None if method == "zero" else calibrate(model, calibration, sorted(by_layer(parsed)), task=task)
    return Knockout(model, parsed, method, check_positions(positions), cal, seed)
