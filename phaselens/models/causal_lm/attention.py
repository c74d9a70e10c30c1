"""Attention probabilities of a transformers causal LM, and the state a forward borrows from the user's model.

SDPA and flash kernels never materialise the probabilities, so a forward with ``hook_pattern`` hooks runs
under transformers' attention interface as :data:`IMPLEMENTATION`, registered here once (in transformers'
global ``AttentionInterface`` and ``AttentionMaskInterface``; no model is touched by the registration):

* the mask is transformers' own ``eager_mask`` (the additive float mask of eager attention);
* the attention is the model's **own** ``eager_attention_forward`` (from its modeling module), so sinks, scaling
  and dtype handling stay the model's; its probabilities ``[B, H, n, keys]`` go to the layer's pattern hooks.
  A hook that returns a replacement ``P'`` changes the layer's output to ``P' @ V`` (values repeated over the
  query heads that share them), so ``hook_pattern`` is editable, as in TransformerLens; with gradients on, the
  output is ``P @ V`` of the hooked tensor too, so gradients reach it.

:func:`borrowed` switches the model to that implementation and to ``eval()`` only for the duration of one
forward and restores the config's implementation (and every sub-config's) and each module's ``training``
flag in ``finally``, whatever raises: the user's object is left exactly as it was. Forwards without pattern
hooks keep the model's own implementation (SDPA by default).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from phaselens.errors import UnsupportedModelError

IMPLEMENTATION = "phaselens_eager"
PatternFn = Callable[[Tensor], Tensor]  # probabilities [B, H, n, keys] -> the probabilities to go on with
_TAP: contextvars.ContextVar[dict[int, PatternFn] | None] = contextvars.ContextVar("phaselens_causal_tap",
                                                                                      default=None)
_REGISTERED = False


def _generic_eager(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   scaling: float | None = None, dropout: float = 0.0, **_: Any) -> tuple[Tensor, Tensor]:
    """Plain eager attention (for a modeling module without its own ``eager_attention_forward``): query
    ``[B, H, n, d]``, key / value ``[B, Hkv, keys, d]`` -> output ``[B, n, H, d]``, probabilities
    ``[B, H, n, keys]``."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, k.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, v).transpose(1, 2).contiguous(), probs


def _eager_of(module: nn.Module) -> Callable[..., tuple[Tensor, Tensor | None]]:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else _generic_eager


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """The registered attention: the model's own eager attention, then the layer's pattern hooks."""
    out, probs = _eager_of(module)(module, query, key, value, attention_mask, *args, **kwargs)
    taps = _TAP.get()
    tap = taps.get(id(module)) if taps else None
    if tap is None:
        return out, probs
    if probs is None:
        raise UnsupportedModelError(f"{type(module).__name__}'s eager attention returned no probabilities, so "
                                    "hook_pattern cannot be read on this model.")
    new = tap(probs)
    if new is probs and not (torch.is_grad_enabled() and probs.requires_grad):
        return out, probs  # read only: the model's own output (with gradients on, it goes through P below)
    groups = new.shape[1] // value.shape[1]
    v = value.repeat_interleave(groups, 1) if groups > 1 else value  # query head h reads KV head h // groups
    return torch.matmul(new.to(v.dtype), v).transpose(1, 2).contiguous(), new


def register() -> None:
    """Register :data:`IMPLEMENTATION` in transformers' attention and mask interfaces (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)
    _REGISTERED = True


def _configs(config: Any) -> list[Any]:
    """A config and its sub-configs, recursively (the implementation is set on each)."""
    out, todo = [], [config]
    while todo:
        c = todo.pop()
        if c is None or any(c is o for o in out):
            continue
        out.append(c)
        todo += [getattr(c, key, None) for key in getattr(c, "sub_configs", {}) or {}]
    return out


def attn_implementation(model: nn.Module) -> Any:
    """The model's attention implementation as its config holds it (what :func:`borrowed` restores)."""
    config = getattr(model, "config", None)
    return None if config is None else config.__dict__.get("_attn_implementation_internal",
                                                           getattr(config, "_attn_implementation", None))


@contextlib.contextmanager
def borrowed(model: nn.Module, *, eager: bool, taps: dict[int, PatternFn] | None = None) -> Iterator[None]:
    """For one forward: every module in ``eval()`` mode and, with ``eager``, :data:`IMPLEMENTATION` as the
    attention (``taps``: ``{id(attention module): pattern hook}``). Restored in ``finally``."""
    training = [m for m in model.modules() if m.training]
    configs = _configs(getattr(model, "config", None)) if eager else []
    saved = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    token = _TAP.set(taps or {})
    try:
        for m in training:
            m.training = False
        if eager:
            register()
            for c in configs:
                c.__dict__["_attn_implementation_internal"] = IMPLEMENTATION
        yield
    finally:
        _TAP.reset(token)
        for c, value in saved:
            c.__dict__["_attn_implementation_internal"] = value
        for m in training:
            m.training = True
