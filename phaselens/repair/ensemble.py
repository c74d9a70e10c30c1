"""Phase repair: test-time phase ensembling.

Inserting ``k`` single-token pads right after BOS moves every later token ``k`` slots, so the needle's phase
becomes ``(p + k) mod S`` while the content is unchanged. Running shifted copies and combining their
answers covers the weak phases. ``phase_ensemble`` wraps a model so that ``evaluate``, ``ablate`` and the
report run on the repaired model unchanged; ``repair_table`` compares shift sets and combining rules.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from phaselens.errors import ContextLengthError, InputError, PaddingError, PhaseLensError
from phaselens.protocol import PhaseModel, call_state

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
        raise PhaseLensError(f"shifts must be 'all', 'opposite' or a list of ints, got {shifts!r}.")
    out = tuple(int(k) for k in shifts)
    bad = [k for k in out if not 0 <= k < stride]
    if bad or not out:
        raise PhaseLensError(f"shifts {bad or out} must lie in 0..{stride - 1} (the stride is {stride}).")
    return tuple(sorted(set(out)))


def _iter(x: Any) -> Any:
    try:
        return list(x)
    except TypeError:
        return [None]


def default_pad_id(model: Any, tokenizer: Any = None, pad_unit: str | None = None) -> int:
    """A single-token pad: from ``pad_unit`` (checked to be one token), or the default task's filler."""
    if pad_unit is not None:
        if tokenizer is None:
            raise PaddingError("pad_unit needs the tokenizer that encodes it.")
        ids = tokenizer.encode(pad_unit, add_special_tokens=False) if hasattr(tokenizer, "encode") else None
        ids = getattr(ids, "ids", ids)
        if ids is None or len(ids) != 1:
            raise PaddingError(f"pad unit {pad_unit!r} is {len(ids or [])} tokens, not one; pick a unit that "
                               "encodes to exactly one token (e.g. ' .').")
        return int(ids[0])
    task = getattr(model, "default_task", None)
    filler = getattr(task, "filler_ids", None)
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
        raise PhaseLensError(f"combine must be one of {COMBINES}, got {rule!r}.")
    return out, chosen


class PhaseEnsemble:
    """A model-like wrapper that answers with shifted copies of every input combined (see module docs).

    Attributes:
        shifts: the pad counts of the copies; ``cost`` = forward-pass multiple (``len(shifts)``).
        last_choice: after each call, the copy chosen at every position ``[B, T]`` (``max_conf``; the most
            confident copy for other rules).
    """

    def __init__(self, model: Any, shifts: Any = "all", combine: str = "max_conf", pad_id: int | None = None, *,
                 tokenizer: Any = None, pad_unit: str | None = None, insert_at: int = 1) -> None:
        if combine not in COMBINES:
            raise PhaseLensError(f"combine must be one of {COMBINES}, got {combine!r}.")
        if isinstance(insert_at, bool) or not isinstance(insert_at, numbers.Integral) or insert_at < 0:
            raise PhaseLensError(f"insert_at must be an int >= 0 (the slot the pads go before), got {insert_at!r}.")
        self.model = model
        self.shifts = resolve_shifts(shifts, model.analysis_spec.stride)
        self.rule = combine
        self.pad_id = pad_id if pad_id is not None else default_pad_id(model, tokenizer, pad_unit)
        self.insert_at = insert_at
        self.default_task = getattr(model, "default_task", None)
        self.last_choice: Tensor | None = None
        self.name = f"{getattr(model, 'name', type(model).__name__)}+repair({combine}, shifts {list(self.shifts)})"

    @property
    def cfg(self) -> Any:
        return self.model.cfg

    @property
    def phase_specs(self) -> list:
        return self.model.phase_specs

    @property
    def analysis_spec(self) -> Any:
        return self.model.analysis_spec

    @property
    def cost(self) -> int:
        return len(self.shifts)

    @property
    def analysis_metadata(self) -> dict[str, Any]:
        inner = dict(getattr(self.model, "analysis_metadata", None) or {})
        return {**inner, "repair": {"shifts": list(self.shifts), "combine": self.rule, "forward_multiple": self.cost,
                           "pad_id": self.pad_id}}

    def max_input_length(self) -> int:
        return int(self.model.cfg.n_ctx) - max(self.shifts)

    def __call__(self, tokens: Tensor, *, logits: str = "all", query_len: int | None = None) -> Tensor:
        """Combined log-probabilities ``[B, T, V]`` (usable as logits) for ``tokens`` ``[B, T]``; with
        ``logits="query"`` only the last ``query_len`` rows ``[B, query_len, V]`` (each copy is asked for the
        rows it needs only)."""
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise InputError(f"tokens must be [batch, pos] with batch, pos >= 1, got {tuple(tokens.shape)}.")
        if logits not in ("all", "query"):
            raise InputError(f"logits must be 'all' or 'query', got {logits!r}.")
        B, T = tokens.shape
        q = T if logits == "all" or query_len is None else int(query_len)
        if not 1 <= q <= T:
            raise InputError(f"query_len must lie in 1..{T}, got {query_len}.")
        if T + max(self.shifts) > int(self.model.cfg.n_ctx):
            raise ContextLengthError(
                f"shifting by up to {max(self.shifts)} pads makes {T + max(self.shifts)} tokens, over the model's "
                f"context {self.model.cfg.n_ctx}; inputs may be at most {self.max_input_length()} tokens."
            )
        copies = shifted_copies(tokens, self.shifts, self.pad_id, self.insert_at)
        first = T - q
        inner_first = first + min(self.shifts) if first >= self.insert_at else first
        n_inner = copies.shape[1] - inner_first
        shift = torch.as_tensor(self.shifts).repeat_interleave(B)
        with call_state(row_shift=shift, original_length=T):
            out_inner = self.model(copies, logits="query", query_len=n_inner)
        per_copy = align(out_inner, self.shifts, B, torch.arange(first, T), self.insert_at, inner_first)
        out, chosen = combine(per_copy, self.rule)
        self.last_choice = chosen
        return out

    # ---- hooks pass through to the wrapped model -------------------------------------------------------
    @property
    def hook_dict(self) -> dict[str, Any]:
        return self.model.hook_dict

    def hooks(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's hook context; hooks see the ``[copies * batch, ...]`` rows of each call."""
        return self.model.hooks(*args, **kwargs)

    def run_with_hooks(self, tokens: Tensor, *, fwd_hooks: Any = (), **kwargs: Any) -> Tensor:
        """``self(tokens, **kwargs)`` with ``fwd_hooks`` on the wrapped model for that call (removed after)."""
        with self.model.hooks(fwd_hooks=list(fwd_hooks)):
            return self(tokens, **kwargs)

    @property
    def returns_query_logits(self) -> bool:
        return bool(getattr(self.model, "returns_query_logits", False))

    # ---- capabilities ------------------------------------------------------------------------------
    def cycle_gates(self, delta: int) -> PhaseEnsemble:
        """The same ensemble over the wrapped model with its gates cycled by ``delta``."""
        from phaselens.protocol import require

        inner = require(self.model, "cycle_gates", "the wrapped model's gates cannot be cycled.")(delta)
        return PhaseEnsemble(inner, self.shifts, self.rule, self.pad_id, insert_at=self.insert_at)

    def __repr__(self) -> str:
        return f"PhaseEnsemble({self.name}, cost {self.cost}x forward)"


def phase_ensemble(model: PhaseModel, shifts: Any = "all", combine: str = "max_conf", pad_id: int | None = None,
                   **kwargs: Any) -> PhaseEnsemble:
    """Wrap ``model`` so that every input runs as shifted copies combined by ``combine``.

    Args:
        shifts: ``"all"`` (0..S-1, S x cost), ``"opposite"`` ({0, S/2}, 2 x cost) or explicit shifts in 0..S-1.
        combine: ``"max_conf"`` (the most confident copy), ``"vote"``, ``"mean_logprob"`` or ``"mean_prob"``.
        pad_id: the single-token pad; default: ``pad_unit`` checked with ``tokenizer``, or the task's filler.

    Example:
        >>> fixed = phaselens.phase_ensemble(phaselens.load("zoo:w4s4"))  # doctest: +SKIP
        >>> phaselens.evaluate(fixed).gap  # doctest: +SKIP
    """
    return PhaseEnsemble(model, shifts, combine, pad_id, **kwargs)
