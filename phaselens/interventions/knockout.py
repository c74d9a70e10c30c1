"""Head knockouts at the input of the output projection (per-head ``z``), as a context manager.

    with phaselens.knockout(model, ["L1H2", "L0KV1"], method="mean", calibration=cal) as ko:
        logits = model(tokens)          # knocked out at the query (last) position

Methods: ``"zero"``; ``"mean"`` (the mean ``z`` of each head over a disjoint calibration set, at the same
position, as the paper does); ``"resample"`` (``z`` of a random calibration item). Hooks are removed in
``finally``, whatever raises inside the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from phaselens.errors import InputError, PhaseLensError
from phaselens.heads import Head, by_layer, parse_heads
from phaselens.protocol import resolve_task
from phaselens.scoring import model_logits

Method = Literal["mean", "zero", "resample"]
CALIBRATION_SEED = 7_919  # calibration items are built with this seed, disjoint from evaluation seeds


def z_name(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_z"


def query_rows(hook: Any, slots: Tensor, n: int) -> Tensor:
    """Rows of this call that hold absolute ``slots`` ``[b]``.

    Under chunked prefill (DeepSeek-V4 adapter) hooks fire for the last chunk only, which starts at
    ``hook.query_start``; a slot before it cannot be reached there.
    """
    start = int(getattr(hook, "query_start", 0))
    rows = slots.long() - start
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise InputError(
            f"slot {int(slots.min()) if int(rows.min()) < 0 else int(slots.max())} is outside this call's rows "
            f"{start}..{start + n - 1} (chunked prefill hooks see only the last chunk); use a longer query_len "
            "or chunk=None."
        )
    return rows


@torch.no_grad()
def capture_z(model: Any, tokens: Tensor, query_pos: Tensor, layers: list[int], *, batch_size: int = 64) -> dict[int, Tensor]:
    """Per-head ``z`` at each row's query position: ``{layer: [N, H, d]}``."""
    out: dict[int, list[Tensor]] = {layer: [] for layer in layers}
    for i in range(0, tokens.shape[0], batch_size):
        qp = query_pos[i : i + batch_size]
        rows = torch.arange(len(qp))

        def grab(z: Tensor, hook: Any, _qp: Tensor = qp, _rows: Tensor = rows) -> None:
            layer = int(hook.name.split(".")[1])
            at = query_rows(hook, _qp, z.shape[1]).to(z.device)
            out[layer].append(z[_rows.to(z.device), at].detach().float().cpu())

        model_logits(model, tokens[i : i + batch_size], qp, [(z_name(layer), grab) for layer in layers])
    return {layer: torch.cat(v) for layer, v in out.items()}


@dataclass
class Calibration:
    """Per-head query-position ``z`` of calibration items: ``{layer: [N, H, d]}``."""

    z: dict[int, Tensor]
    source: str = "calibration"

    def mean(self, layer: int) -> Tensor:
        return self.z[layer].mean(0)


def calibrate(model: Any, calibration: Any, layers: list[int], *, task: Any = None, n: int = 256) -> Calibration:
    """Collect calibration ``z`` from a TaskBatch, a ``[N, T]`` token tensor (last position), or the task."""
    if calibration is None:
        from phaselens.tasks.residues import check_modulus

        task = resolve_task(model, task)
        modulus = check_modulus(model.analysis_spec, getattr(task, "modulus", None))
        calibration = task.build(model.analysis_spec, n_per_residue=max(1, n // modulus), seed=CALIBRATION_SEED)
    if isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, Tensor):
        tokens = calibration
        qp = torch.full((tokens.shape[0],), tokens.shape[1] - 1)
        source = f"{tokens.shape[0]} token rows"
    else:
        tokens, qp = calibration.tokens, calibration.query_pos
        source = f"{len(qp)} task items"
    return Calibration(capture_z(model, tokens, qp, layers), source)


@dataclass
class Knockout:
    """A live knockout. Set ``positions`` between calls to knock out other positions.

    ``positions``: ``"query"`` / ``"last"`` (the last position of every row), ``"all"``, an int, or a
    LongTensor ``[batch]`` of per-row positions.
    """

    heads: tuple[Head, ...]
    method: Method
    positions: Any = "query"
    calibration: Calibration | None = None
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    calls: int = 0

    def replacement(self, layer: int, z: Tensor, heads: list[int], rows: int) -> Tensor:
        """Values ``[rows, len(heads), d]`` that replace the knocked-out heads."""
        d = z.shape[-1]
        if self.method == "zero":
            return z.new_zeros(rows, len(heads), d)
        assert self.calibration is not None
        cal = self.calibration.z[layer][:, heads].to(z.device, z.dtype)  # [N, h, d]
        if self.method == "mean":
            return cal.mean(0).expand(rows, -1, -1)
        idx = torch.randint(0, cal.shape[0], (rows,), generator=self.generator)
        return cal[idx.to(cal.device)]

    def hook(self, layer: int, heads: list[int]):
        index = torch.tensor(heads)

        def fn(z: Tensor, hook: Any) -> Tensor:
            self.calls += 1
            B, n = z.shape[:2]
            z = z.clone()
            pos = self.positions
            if isinstance(pos, str) and pos == "all":
                repl = self.replacement(layer, z, heads, B * n).view(B, n, len(heads), -1)
                z[:, :, index] = repl
                return z
            # A wrapper that runs shifted copies (phase repair) tells where each row's original slot 0 went.
            shift = getattr(hook, "row_shift", None)
            length = int(getattr(hook, "original_length", n))
            if isinstance(pos, str):
                if pos not in ("query", "last"):
                    raise InputError(f"positions must be 'query', 'last', 'all', an int or a tensor, got {pos!r}.")
                pos_t = torch.full((B,), length - 1)
            elif isinstance(pos, int):
                pos_t = query_rows(hook, torch.full((B,), pos), n)
            else:
                try:
                    pos_t = torch.as_tensor(pos).long()
                except (TypeError, RuntimeError, ValueError):
                    raise InputError(
                        f"positions must be 'query', 'last', 'all', an int or a [batch] tensor, got {pos!r}."
                    ) from None
                if shift is not None and pos_t.dim() == 1 and len(pos_t) and B % len(pos_t) == 0:
                    pos_t = pos_t.repeat(B // len(pos_t))  # the same items, once per copy
                if pos_t.shape != (B,):
                    raise InputError(
                        f"knockout positions has shape {tuple(pos_t.shape)} but the batch has {B} rows; "
                        "set ko.positions to a [batch] tensor for each call."
                    )
                pos_t = query_rows(hook, pos_t, n)
            if shift is not None:
                pos_t = pos_t + shift.to(pos_t.device)
            if int(pos_t.max()) >= n or int(pos_t.min()) < 0:
                raise InputError(f"knockout position {int(pos_t.max())} is outside this call's {n} positions.")
            rows = torch.arange(B, device=z.device)
            z[rows[:, None], pos_t.to(z.device)[:, None], index.to(z.device)[None, :]] = self.replacement(layer, z, heads, B)
            return z

        return fn


@contextmanager
def knockout(
    model: Any,
    heads: Any,
    method: Method = "mean",
    positions: Any = "query",
    calibration: Any = None,
    *,
    task: Any = None,
    seed: int = 0,
) -> Iterator[Knockout]:
    """Knock out ``heads`` for every forward inside the ``with`` block.

    Args:
        model: a phaselens model (hook names ``blocks.{l}.attn.hook_z``).
        heads: ``(layer, head)``, ``"L2H3"``, ``"L2"``, ``"L2KV0"``, or a list of these.
        method: ``"mean"``, ``"zero"`` or ``"resample"``.
        positions: where to knock out (see :class:`Knockout`); ``"query"`` is each row's last position.
        calibration: for ``mean`` / ``resample``: a TaskBatch, a ``[N, T]`` token tensor, or a
            :class:`Calibration`; default: items of the model's task built with a disjoint seed.
    """
    if method not in ("mean", "zero", "resample"):
        raise PhaseLensError(f"method must be 'mean', 'zero' or 'resample', got {method!r}.")
    parsed = parse_heads(heads, model.cfg)
    layers = by_layer(parsed)
    cal = None
    if method != "zero":
        cal = calibrate(model, calibration, sorted(layers), task=task)
    ko = Knockout(parsed, method, positions, cal, torch.Generator().manual_seed(seed))
    fwd_hooks = [(z_name(layer), ko.hook(layer, hs)) for layer, hs in layers.items()]
    with model.hooks(fwd_hooks=fwd_hooks):
        yield ko
