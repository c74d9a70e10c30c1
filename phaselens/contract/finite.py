"""Non-finite logits: refuse them with a :class:`NonFiniteError` that names where NaN/inf first appears.

A NaN or inf weight makes every analysis quietly return NaN effects; :func:`check_query_logits` runs on
every scored forward (``phaselens.analyses.scoring.model_logits``) and, only when the logits are not finite, runs
the pass again with a forward hook on every submodule to find the first one whose output is non-finite.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from phaselens.contract.protocol import module_of
from phaselens.errors import NonFiniteError


def _first_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple | list):
        for x in out:
            t = _first_tensor(x)
            if t is not None:
                return t
        return None
    if isinstance(out, dict) or hasattr(out, "values"):  # dicts and transformers ModelOutputs
        try:
            return _first_tensor(list(out.values()))
        except Exception:
            return None
    return None


def first_nonfinite(model: Any, run: Callable[[], Any]) -> str | None:
    """Run ``run()`` and return the name of the first submodule (in completion order) whose output holds
    NaN or inf, or ``None`` (no module, or every output finite)."""
    module = module_of(model)
    if module is None:
        return None
    names = {id(m): n for n, m in module.named_modules()}
    found: list[str] = []

    def hook(mod: torch.nn.Module, args: Any, out: Any) -> None:
        if found:
            return
        t = _first_tensor(out)
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            found.append(names.get(id(mod), type(mod).__name__) or "the model")

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        with torch.no_grad():
            run()
    except Exception:
        pass  # locating is best effort; the error is raised by the caller either way
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def _where(name: str | None) -> str:
    if name is None:
        return "the submodule could not be located"
    m = re.search(r"(?:^|\.)(?:blocks|layers|h|layer)\.(\d+)(?:\.|$)", name)
    if m:
        return f"the first non-finite output is layer {m.group(1)}'s ({name})"
    return f"the first non-finite output is {name!r} (before the first layer)" if "embed" in name else (
        f"the first non-finite output is {name!r}")


def check_query_logits(
    model: Any, logits: Tensor, n_tokens: int, query_pos: Tensor, run_clean: Callable[[], Any],
    run_hooked: Callable[[], Any] | None,
) -> None:
    """Raise :class:`NonFiniteError` unless the logits ``[b, T', vocab]`` at the query rows are finite.

    The logits are the last ``T'`` of ``n_tokens`` positions and ``query_pos`` ``[b]`` index the full
    sequence; ``run_clean`` repeats the pass without hooks, ``run_hooked`` with the analysis's hooks (``None``
    when there were none).
    """
    at = (query_pos.long() - (n_tokens - int(logits.shape[1]))).to(logits.device)
    rows = logits[torch.arange(logits.shape[0], device=logits.device), at]
    if not bool(torch.isfinite(rows).all()):
        raise_nonfinite(model, run_clean, run_hooked)


def raise_nonfinite(model: Any, run_clean: Callable[[], Any], run_hooked: Callable[[], Any] | None = None) -> None:
    """Raise the :class:`NonFiniteError` for logits found non-finite, locating the first non-finite output by
    repeating the pass (``run_clean`` without the analysis's hooks, ``run_hooked`` with them)."""
    context = _hooks_active(model)  # hooks a context manager (knockout, patch) left on the model
    where = first_nonfinite(model, run_clean)
    if not context and (where is not None or run_hooked is None):
        raise NonFiniteError(f"the model's logits hold NaN or inf on a clean forward pass: {_where(where)}. "
                             + _cause(model))
    if run_hooked is not None:
        where = first_nonfinite(model, run_hooked)
    raise NonFiniteError(
        f"the logits hold NaN or inf under this analysis's hooks: {_where(where)}. If the model is finite "
        "without them, check the intervention's replacement values (e.g. a calibration holding NaN); otherwise "
        "check the weights (e.g. `torch.isfinite(p).all()` for each parameter)."
    )


def _cause(model: Any) -> str:
    """Why a clean pass is not finite: the non-finite weights by name, or, with every weight finite, an
    overflow of a narrow dtype (float16 tops out at 65504), or else the values the weights produce."""
    module = module_of(model)
    if module is None:
        return "Check the weights (e.g. `torch.isfinite(p).all()` for each parameter)."
    bad = [n for n, t in [*module.named_parameters(), *module.named_buffers()]
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        return (f"These weights hold NaN/inf: {bad[:4]}{' and more' if len(bad) > 4 else ''}; check the "
                "checkpoint or the code that edited them. Analyses of such a model would return NaN effects.")
    dtypes = {t.dtype for t in module.parameters() if t.is_floating_point()}
    if torch.float16 in dtypes:
        return ("Every weight is finite, so an activation overflowed: float16 holds values up to 65504 only. Run "
                "the model in float32 (model.float()) or bfloat16 (model.to(torch.bfloat16)).")
    return ("Every weight is finite, so the activations themselves overflowed or became NaN (very large weights "
            "or inputs); check the weights' scale, or run in float32 (model.float()).")


def _hooks_active(model: Any) -> bool:
    module = module_of(model)
    return module is not None and any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
