"""Phase repair: test-time phase ensembling.

Inserting ``k`` single-token pads right after BOS moves every later token ``k`` slots, so the needle's phase
becomes ``(p + k) mod S`` while the content is unchanged. Running shifted copies and combining their
answers covers the weak phases. ``phase_ensemble`` wraps a model so that ``evaluate``, ``ablate`` and the
report run on the repaired model unchanged; ``repair_table`` compares shift sets and combining rules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phaselens.contract.dims import ModelDims, ModelIdentity
from phaselens.contract.protocol import PhaseModel, call_state, check_model
from phaselens.core.checks import as_int
from phaselens.errors import ContextLengthError, InputError
from phaselens.repair.shifts import (
    COMBINES,
    align,
    combine,
    default_pad_id,
    resolve_shifts,
    shifted_copies,
)


class PhaseEnsemble:
    """A model-like wrapper that answers with shifted copies of every input combined (see module docs).

    Attributes:
        shifts: the pad counts of the copies; ``cost`` = forward-pass multiple (``len(shifts)``).
        last_choice: after each call, the copy chosen at every position ``[B, T]`` (``max_conf``; the most
            confident copy for other rules).
    """

    def __init__(self, model: Any, shifts: Any = "all", combine: str = "max_conf", pad_id: int | None = None, *,
                 tokenizer: Any = None, pad_unit: str | None = None, insert_at: int = 1) -> None:
        check_model(model)
        if not isinstance(combine, str) or combine not in COMBINES:
            raise InputError(f"combine must be one of {COMBINES}, got {combine!r}.")
        insert_at = as_int("insert_at", insert_at, minimum=0, fix="It is the slot the pads go before (1: after BOS).")
        self.model = model
        self.shifts = resolve_shifts(shifts, model.analysis_spec.stride)
        self.rule = combine
        self.pad_id = (as_int("pad_id", pad_id, minimum=0) if pad_id is not None
                       else default_pad_id(model, tokenizer, pad_unit))
        vocab = getattr(model.cfg, "d_vocab", None)
        if isinstance(vocab, int) and self.pad_id >= vocab:
            raise InputError(f"pad_id={self.pad_id} is not a token of this model (ids 0..{vocab - 1}); pass a "
                             "single-token pad inside the vocabulary.")
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
    def dims(self) -> ModelDims:
        """The wrapped model's sizes, ``copies`` forwards per input."""
        return self.model.dims.with_copies(self.cost)

    def identity(self) -> ModelIdentity:
        """The wrapped model's config and weights (the shifts and rule are in ``analysis_metadata``)."""
        inner = self.model.identity()
        return ModelIdentity(type(self).__qualname__, inner.config, inner.module)

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
        q = T if logits == "all" or query_len is None else as_int("query_len", query_len)
        if not 1 <= q <= T:
            raise InputError(f"query_len must lie in 1..{T}, got {query_len}.")
        if self.insert_at >= T:
            raise InputError(f"insert_at={self.insert_at} is not before any of the {T} tokens, so no token would "
                             f"move; pass insert_at < {T} (1: right after BOS).")
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
        from phaselens.contract.protocol import require

        inner = require(self.model, "cycle_gates", "the wrapped model's gates cannot be cycled.")(delta)
        return PhaseEnsemble(inner, self.shifts, self.rule, self.pad_id, insert_at=self.insert_at)

    def __repr__(self) -> str:
        return f"PhaseEnsemble({self.name}, cost {self.cost}x forward)"


def phase_ensemble(model: PhaseModel, *, shifts: Any = "all", combine: str = "max_conf", pad_id: int | None = None,
                   tokenizer: Any = None, pad_unit: str | None = None, insert_at: int = 1) -> PhaseEnsemble:
    """Wrap ``model`` so that every input runs as shifted copies combined by ``combine``.

    Args:
        shifts: ``"all"`` (0..S-1, S x cost), ``"opposite"`` ({0, S/2}, 2 x cost) or explicit shifts in 0..S-1.
        combine: ``"max_conf"`` (the most confident copy), ``"vote"``, ``"mean_logprob"`` or ``"mean_prob"``.
        pad_id: the single-token pad; default: ``pad_unit`` checked with ``tokenizer``, or the task's filler.
        tokenizer, pad_unit: a text model's tokenizer and the pad's text (checked to be one token).
        insert_at: the slot the pads go before (1: right after BOS).

    Example:
        >>> fixed = phaselens.phase_ensemble(phaselens.load("zoo:w4s4"))  # doctest: +SKIP
        >>> phaselens.evaluate(fixed).gap  # doctest: +SKIP
    """
    return PhaseEnsemble(model, shifts, combine, pad_id, tokenizer=tokenizer, pad_unit=pad_unit, insert_at=insert_at)
