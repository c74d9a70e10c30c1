"""Phase repair's primitives: shifted copies of the inputs and the rules that combine their answers.

Inserting ``k`` single-token pads right after BOS moves every later token ``k`` slots, so the needle's phase
changes by ``k`` while its content does not. Shared by the phase-ensemble model
(:class:`~phaselens.repair.ensemble.PhaseEnsemble`) and the repair measurement
(:func:`~phaselens.repair.table.repair_table`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from phaselens.errors import InputError, PaddingError

Combine = Literal["max_conf", "vote", "mean_logprob", "mean_prob"]
COMBINES: tuple[str, ...] = ("max_conf", "vote", "mean_logprob", "mean_prob")


def resolve_shifts(shifts: Any, stride: int) -> tuple[int, ...]:
    """``"all"`` -> 0..S-1; ``"opposite"`` -> {0, S // 2}; or explicit shifts in 0..S-1."""
    if shifts == "all":
        return tuple(range(stride))
    if shifts == "opposite":
        return (0, stride // 2) if stride > 1 else (0,)
    if isinstance(shifts, str) or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool)
                                          for k in _iter(shifts)):
        raise InputError(f"shifts must be 'all', 'opposite' or a list of ints in 0..{stride - 1}, got {shifts!r} "
                         "(names are lower case; pads are whole tokens).")
    out = tuple(int(k) for k in shifts)
    bad = [k for k in out if not 0 <= k < stride]
    if bad or not out:
        raise InputError(f"shifts {list(bad or out)} must be a non-empty list in 0..{stride - 1} (the stride is "
                         f"{stride}), e.g. shifts=(0, {stride // 2}).")
    return tuple(sorted(set(out)))


def _iter(x: Any) -> Any:
    try:
        return list(x)
    except TypeError:
        return [None]


def default_pad_id(model: Any, tokenizer: Any = None, pad_unit: str | None = None, task: Any = None) -> int:
    """A single-token pad: from ``pad_unit`` (checked to be one token), else the filler of ``task`` or of the
    model's default task (a text task's padding unit)."""
    if pad_unit is not None:
        if tokenizer is None:
            raise PaddingError("pad_unit needs the tokenizer that encodes it.")
        ids = tokenizer.encode(pad_unit, add_special_tokens=False) if hasattr(tokenizer, "encode") else None
        ids = getattr(ids, "ids", ids)
        if ids is None or len(ids) != 1:
            raise PaddingError(f"pad unit {pad_unit!r} is {len(ids or [])} tokens, not one; pick a unit that "
                               "encodes to exactly one token (e.g. ' .').")
        return int(ids[0])
    for source in (task, model.default_task):
        filler = getattr(source, "filler_ids", None)
        if filler is not None and len(filler):
            return int(filler[0])
    raise PaddingError("no pad token known for this model: pass pad_id=..., or pad_unit=... with tokenizer=...")


def shifted_copies(tokens: Tensor, shifts: Sequence[int], pad_id: int, insert_at: int = 1) -> Tensor:
    """``[B, T] -> [K*B, T + max(shifts)]``: copy k has ``k`` pads after slot ``insert_at - 1`` (right-padded)."""
    B, T = tokens.shape
    kmax = max(shifts)
    out = torch.full((len(shifts), B, T + kmax), pad_id, dtype=tokens.dtype, device=tokens.device)
    for i, k in enumerate(shifts):  # a handful of copies, each one slice assignment
        out[i, :, :insert_at] = tokens[:, :insert_at]
        out[i, :, insert_at + k : T + k] = tokens[:, insert_at:]
    return out.view(len(shifts) * B, T + kmax)


def align(logits: Tensor, shifts: Sequence[int], B: int, rows: Tensor, insert_at: int = 1, first: int = 0) -> Tensor:
    """Per-copy logits ``[K*B, n, V]`` (inner rows ``first..first+n-1``) back onto the original ``rows``:
    ``[K, B, len(rows), V]``."""
    K = len(shifts)
    lg = logits.view(K, B, logits.shape[1], -1)
    shift = torch.as_tensor(shifts, device=lg.device)[:, None]  # [K, 1]
    r = rows.to(lg.device)[None]
    src = torch.where(r < insert_at, r, r + shift) - first  # [K, rows]
    return torch.stack([lg[i][:, src[i]] for i in range(K)])


def combine(per_copy: Tensor, rule: str) -> tuple[Tensor, Tensor]:
    """Combine per-copy logits ``[K, ..., V]`` into log-probabilities ``[..., V]``; also the chosen copy ``[...]``."""
    logp = per_copy.float().log_softmax(-1)
    conf = logp.max(-1).values  # [K, ...]
    chosen = conf.argmax(0)
    if rule == "max_conf":
        out = torch.gather(logp, 0, chosen[None, ..., None].expand(1, *logp.shape[1:])).squeeze(0)
    elif rule == "mean_logprob":
        out = logp.mean(0).log_softmax(-1)
    elif rule == "mean_prob":
        out = logp.exp().mean(0).clamp_min(1e-30).log()
    elif rule == "vote":
        votes = torch.nn.functional.one_hot(logp.argmax(-1), logp.shape[-1]).float().sum(0)
        # ties broken by the mean probability, a tiny secondary term
        out = (votes + 1e-3 * logp.exp().mean(0)).div(per_copy.shape[0]).clamp_min(1e-30).log()
    else:
        raise InputError(f"combine must be one of {COMBINES}, got {rule!r}.")
    return out, chosen
