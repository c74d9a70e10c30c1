"""nnsight backend: the module-boundary hook points as nnsight interventions.

``from_transformers(model, backend="nnsight")`` runs each hooked forward inside ``envoy.trace(...)``. The sites that
are one module's input or output (``hook_embed``, ``hook_resid_pre/mid/post``, ``attn.hook_q``,
``attn.hook_kv``, ``attn.hook_indexer_topk``, ``attn.hook_z``, ``hook_attn_out``, ``hook_mlp_out``) are
read and written through nnsight envoys, in execution order, with the same hook functions and the same
shapes as the torch backend. Derived sites (gates, payloads, entries, patterns) need values from inside
the forward; locally they run through the torch machinery in the same forward, remotely they are refused.

Lifecycle: ``nnsight.NNsight(model)`` installs a controller as every module's ``forward`` (and a state
object) and never takes them off. For a model we wrapped ourselves we take them off again in ``finally``,
so the transformers model is left exactly as it was. An envoy the user passed in (e.g. a
``nnsight.LanguageModel`` for NDIF) is the user's and is left alone.

``import nnsight`` mounts ``.save`` on every Python object, so it is imported here, lazily, and nothing in
phaselens duck-types on ``hasattr(x, "save")``.

**NDIF (``remote=True``): untested.** The same trace runs with ``remote=True`` on an envoy that supports it
(``nnsight.LanguageModel(repo_id)``); hook functions must then be serialisable by nnsight (see
``nnsight.register``), chunked prefill is unavailable (the cache would have to live on the server), and
only module sites can be hooked.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from phaselens.contract.hooknames import HookPoint
from phaselens.contract.protocol import HookFn
from phaselens.errors import InputError
from phaselens.models.deepseek_v4.sites import MODULE_SITES, module_view, site_order
from phaselens.models.parts.adapter_hooks import HookRun


def run_traced(
    model: nn.Module,
    envoy: Any,
    call_kwargs: dict[str, Any],
    plan: list[tuple[HookPoint, list[HookFn]]],
    run: HookRun,
    *,
    n_heads: int,
    remote: bool = False,
) -> Any:
    """One forward of ``model(**call_kwargs)`` under an nnsight trace that applies ``plan``.

    ``plan`` lists module-site hook points with their functions; it is visited in execution order, as
    nnsight requires. Returns the model's output.
    """
    import nnsight

    bad = [p.name for p, _ in plan if p.site not in MODULE_SITES]
    if bad:
        raise InputError(f"the nnsight backend reaches module sites only; {bad} are derived sites.")
    ordered = sorted(plan, key=lambda item: site_order(item[0]))
    owned = envoy is None
    before = {id(m): set(m.__dict__) for m in model.modules()} if owned else {}
    try:
        if owned:
            envoy = nnsight.NNsight(model)
        kwargs = dict(call_kwargs, remote=True) if remote else call_kwargs
        with envoy.trace(**kwargs):
            for point, fns in ordered:
                _intervene(envoy, point, fns, run, n_heads)
            output = nnsight.save(envoy.output)
        return output
    finally:
        if owned:
            strip(model, before)


def _intervene(envoy: Any, point: HookPoint, fns: list[HookFn], run: HookRun, n_heads: int) -> None:
    """Read one site inside the trace, run the hooks on our view of it, write back a replacement."""
    path, handle = MODULE_SITES[point.site]
    target = envoy
    for part in path.format(l=point.layer).split("."):  # paths start at the root (the causal-LM module)
        target = target[int(part)] if part.isdigit() else getattr(target, part)
    get, put = module_view(point.site, n_heads)
    x = target.input if handle == "input" else target.output
    value, replaced = run.hooks(point, fns, get(x))
    if replaced:
        setattr(target, handle, put(x, value))


def strip(model: nn.Module, before: dict[int, set[str]]) -> None:
    """Take off what nnsight put in module ``__dict__`` s (its controller ``forward`` and its state)."""
    for module in model.modules():
        known = before.get(id(module), set())
        for key in [k for k in module.__dict__ if k not in known]:
            if type(module.__dict__[key]).__module__.startswith("nnsight"):
                del module.__dict__[key]
