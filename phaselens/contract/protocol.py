"""The contract between analyses and models: :class:`PhaseModel`, the hook context, and capabilities.

Three kinds of model satisfy it: :class:`~phaselens.models.CompressedTransformer`, the DeepSeek-V4 adapter
from :func:`phaselens.from_hf`, and :class:`~phaselens.repair.ensemble.PhaseEnsemble` wrappers over either. Analyses
program against this module only: they never import a concrete model class or check ``isinstance``.

* Every hook function is called as ``fn(tensor, *, hook)`` where ``hook`` is a :class:`HookContext`: the
  hook's ``name``, ``layer()`` (a method, as in TransformerLens), and where this call sits (``query_start``,
  ``first_entry``, ``row_shift``, ``original_length``). Per-call state travels in the context, never as an
  attribute written onto a hook point.
* Model-specific powers are optional **capabilities** (:data:`CAPABILITIES`), methods a model may offer. An
  analysis asks with :func:`capability`; without it, the analysis takes its general path or raises
  :class:`~phaselens.errors.NotApplicableError` saying why.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from phaselens.contract.dims import ModelDims, ModelIdentity
from phaselens.errors import InputError, NotApplicableError, UnsupportedModelError

# analysis_metadata keys that record what runs observed (they grow as a model runs), not what the model is:
# results carry them, fingerprints leave them out (a journal must resume on the same model after a run).
OBSERVED_METADATA = frozenset(
    {"max_entries_seen", "index_topk_binding", "index_topk_fragile_picks", "candidate_filter_binding",
     "served_endpoint", "served_traffic"}
)


HookFn = Callable[..., Tensor | None]
FwdHooks = Iterable[tuple[Any, HookFn]]

# name -> what the capability does (docs/api.md lists them)
CAPABILITIES: dict[str, str] = {
    "query_engine": "model.query_engine(tokens [N, T], query_pos [N], rows_per_pass=, batch_size=) -> QueryEngine: "
                    "runs many query-row interventions over one cached clean prefix (engine='suffix')",
    "cycle_gates": "model.cycle_gates(delta) -> a copy with its offset-specific gate parameters rolled by delta",
    "estimate_memory": "model.estimate_memory(tokens, batch=, query_len=, logits=) -> contract.memory.MemoryEstimate: bytes of a "
                       "forward from the model's sizes (used by phaselens.plan and by every run's price)",
    "answer_queries": "model.answer_queries(tokens [N, T], query_pos [N], answer [N], wrong [N], progress=) -> "
                      "contract.answers.Answers: the greedy answer after each prompt tokens[i, :query_pos[i] + 1], "
                      "with the log-probabilities the model reports (a black-box model's way to be scored)",
    "query_engine_support": "model.query_engine_support() -> str | None: why this model's query-suffix engine "
                            "cannot run it (an architecture the engine does not support), None when it can; "
                            "engine='auto' then runs full forwards and records why",
}
ENGINES = ("auto", "suffix", "full")


@runtime_checkable
class PhaseModel(Protocol):
    """What phaselens needs from a model: every member an analysis may use, and nothing else.

    * ``dims``: sizes and phase geometry as one value (:class:`~phaselens.contract.dims.ModelDims`);
    * ``name``: what results call the model;
    * ``default_task``: the task a model card's numbers came from, or ``None``;
    * ``analysis_metadata``: what a result must carry to be read correctly (a dict; may be empty); keys that
      record what runs observed rather than what the model is (e.g. the longest input seen) are named in
      :data:`OBSERVED_METADATA`, so a model's fingerprint does not change when it runs;
    * ``identity()``: what determines the numbers (:class:`~phaselens.contract.dims.ModelIdentity`: kind,
      config, the module with the weights), for fingerprints;
    * ``__call__(tokens [B, T], *, logits="all" | "query", query_len=n)``: logits ``[B, T, vocab]``, or only the
      last ``n`` rows ``[B, n, vocab]`` with ``logits="query"``; ``returns_query_logits`` says whether
      analyses should ask for the query rows only (a model that prefills in chunks);
    * ``hooks(fwd_hooks=...)``: a context manager that applies ``(name_or_filter, fn)`` hooks to every forward
      inside it and removes them in ``finally``; ``run_with_hooks(tokens, fwd_hooks=...)``; ``hook_dict``:
      every hook name (names from the table in :mod:`phaselens.contract.hooknames`);
    * optional capabilities (:data:`CAPABILITIES`), asked for with :func:`capability`.

    Models keep their own configuration (``cfg``, ``phase_specs``, ...) for their users; analyses read
    ``dims`` instead (``tests/contract/test_strict_model.py`` runs every analysis on a model that exposes
    only these members).
    """

    @property
    def dims(self) -> ModelDims: ...

    @property
    def name(self) -> str: ...

    default_task: Any

    @property
    def analysis_metadata(self) -> dict[str, Any]: ...

    def identity(self) -> ModelIdentity: ...

    @property
    def returns_query_logits(self) -> bool: ...

    @property
    def hook_dict(self) -> dict[str, Any]: ...

    def hooks(self, fwd_hooks: FwdHooks = ...) -> contextlib.AbstractContextManager[Any]: ...

    def run_with_hooks(self, tokens: Tensor, *, fwd_hooks: FwdHooks = ..., **kwargs: Any) -> Tensor: ...

    def __call__(self, tokens: Tensor, *args: Any, **kwargs: Any) -> Any: ...


# The members above, by name (what the strict-model contract test allows an analysis to touch).
MEMBERS = ("dims", "name", "default_task", "analysis_metadata", "identity", "returns_query_logits", "hook_dict",
           "hooks", "run_with_hooks", "__call__")


# ---- the hook context ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallState:
    """Per-call facts a wrapper announces to the hooks of the model it calls.

    ``row_shift`` ``[rows]``: how many slots each row of the call was shifted right (phase repair's copies);
    ``original_length``: the length of the inputs before shifting.
    """

    row_shift: Tensor | None = None
    original_length: int | None = None


_NO_CALL = CallState()
_CALL: contextvars.ContextVar[CallState | None] = contextvars.ContextVar("phaselens_call", default=None)


@contextlib.contextmanager
def call_state(*, row_shift: Tensor | None = None, original_length: int | None = None) -> Iterator[CallState]:
    """Announce per-call facts to every hook fired inside the block (restored in ``finally``)."""
    token = _CALL.set(CallState(row_shift, original_length))
    try:
        yield current_call()
    finally:
        _CALL.reset(token)


def current_call() -> CallState:
    return _CALL.get() or _NO_CALL


@dataclass(frozen=True, eq=False)
class HookContext:
    """What a hook function receives as ``hook``.

    Attributes:
        name: the hook name, e.g. ``blocks.1.attn.hook_z``.
        query_start: the cache slot of row 0 of this call (0 for a plain forward; the first slot of the query
            chunk under chunked prefill, or of the query rows in the query-suffix engine).
        first_entry: for compressor hooks (gates, payloads, entries): index of the first new entry.
        row_shift: ``[rows]`` slots each row was shifted right by a wrapper (phase repair), else ``None``.
        original_length: the inputs' length before such a shift, else ``None``.
        point: the model's own hook point (a TransformerLens ``HookPoint`` or the adapter's); attributes this
            class lacks are read from it, so TransformerLens-style hooks keep working.
    """

    name: str
    layer_index: int | None = None
    query_start: int = 0
    first_entry: int | None = None
    row_shift: Tensor | None = None
    original_length: int | None = None
    point: Any = field(default=None, repr=False)

    def layer(self) -> int:
        """The block index (a method, as TransformerLens's ``HookPoint.layer()``)."""
        if self.layer_index is None:
            raise InputError(f"{self.name} belongs to no layer.")
        return self.layer_index

    def __getattr__(self, attr: str) -> Any:
        point = self.__dict__.get("point")
        if point is None or attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(point, attr)

    def rows(self, slots: Tensor, n: int) -> Tensor:
        """Row indices of this call that hold absolute ``slots`` ``[b]`` of the original input.

        Under chunked prefill rows start at ``query_start``; a wrapper's ``row_shift`` (``[b * copies]``)
        moves each copy's rows, and ``slots`` repeat once per copy. Raises :class:`InputError` when a slot
        is not among this call's ``n`` rows.
        """
        slots = slots.long()
        if self.row_shift is not None:
            shift = self.row_shift.to(slots.device)
            if slots.numel() and len(shift) % slots.numel() == 0:
                slots = slots.repeat(len(shift) // slots.numel())
            if slots.shape != shift.shape:
                raise InputError(f"{len(slots)} positions for a call of {len(shift)} shifted rows.")
            slots = slots + shift
        rows = slots - self.query_start
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            bad = int(slots.min()) if int(rows.min()) < 0 else int(slots.max())
            raise InputError(
                f"slot {bad} is outside this call's rows {self.query_start}..{self.query_start + n - 1} "
                "(chunked prefill hooks see only the query chunk); use a longer query_len or chunk=None."
            )
        return rows


def hook_pairs(hooks: Any) -> list[tuple[Any, HookFn]]:
    """``hooks`` as checked ``(name_or_filter, fn)`` pairs: a clear :class:`InputError` for anything else."""
    out = []
    for item in hooks or ():
        try:
            name, fn = item
        except (TypeError, ValueError):
            raise InputError(f"hooks are (name_or_filter, fn) pairs, got {item!r}.") from None
        if not callable(fn):
            raise InputError(f"the hook for {name!r} is not callable: {fn!r}.")
        out.append((name, fn))
    return out


def hook_context(point: Any, name: str, layer: int | None, *, query_start: int = 0,
                 first_entry: int | None = None) -> HookContext:
    """A :class:`HookContext` for one hook call, with the wrapper's per-call state filled in."""
    st = current_call()
    return HookContext(name, layer, query_start, first_entry, st.row_shift, st.original_length, point)


# ---- capabilities and engines --------------------------------------------------------------------------
def capability(model: Any, name: str) -> Callable[..., Any] | None:
    """The model's ``name`` capability (a bound method), or ``None`` when it does not offer it."""
    if name not in CAPABILITIES:
        raise InputError(f"unknown capability {name!r}; known: {sorted(CAPABILITIES)}.")
    fn = getattr(model, name, None)
    return fn if callable(fn) else None


def require(model: Any, name: str, why: str) -> Callable[..., Any]:
    """The ``name`` capability, or :class:`NotApplicableError` explaining ``why`` it is needed."""
    fn = capability(model, name)
    if fn is None:
        raise NotApplicableError(f"{model_name(model)} does not offer {name!r}: {why}")
    return fn


def choose_engine(model: Any, engine: str) -> str:
    """``"suffix"`` or ``"full"``: honours an explicit request or raises.

    ``"auto"`` is the fastest exact engine the model can run: the query-suffix engine when the model has the
    ``query_engine`` capability and its architecture is one the engine supports (:func:`suffix_unsupported`),
    else full forwards (the result's metadata says why: :func:`engine_record`). ``"suffix"`` that cannot run
    raises :class:`~phaselens.errors.EngineError`, naming why and ``engine='full'``.
    """
    if engine not in ENGINES:
        raise InputError(f"engine must be one of {ENGINES}, got {engine!r}.")
    why = suffix_unsupported(model)
    if engine == "suffix" and why is not None:
        from phaselens.errors import EngineError

        raise EngineError(f"engine='suffix' cannot run here: {why}; use engine='full' (one full forward per cell, "
                          "exact on any model) or engine='auto' (picks it for you).")
    return "suffix" if engine == "suffix" or (engine == "auto" and why is None) else "full"


def suffix_unsupported(model: Any) -> str | None:
    """Why the query-suffix engine cannot run on ``model`` (``None``: it can): the model has no such engine, or
    its ``query_engine_support`` capability names an architecture the engine does not support."""
    if capability(model, "query_engine") is None:
        return f"{model_name(model)} has no query-suffix engine"
    support = capability(model, "query_engine_support")
    return None if support is None else support()


def engine_record(model: Any, arguments: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """What a result records of an ``engine="auto"`` that ran full forwards because the query-suffix engine
    cannot run on the model: ``engine_reason`` (empty when no engine was chosen, or the suffix engine ran)."""
    if arguments.get("engine") != "auto" or metadata.get("engine") != "full":
        return {}
    why = suffix_unsupported(model)
    return {} if why is None else {"engine_reason": f"engine='auto' ran full forwards: {why}"}


def is_black_box(model: Any) -> bool:
    """Whether ``model`` only answers prompts (``dims.black_box``: a served endpoint)."""
    return bool(getattr(model.dims, "black_box", False))


def refuse_black_box(model: Any, what: str) -> None:
    """Raise :class:`NotApplicableError` in one line when ``model`` is a black box and ``what`` needs its
    logits or hooks."""
    if is_black_box(model):
        raise NotApplicableError(
            f"{what} needs hooks or logits inside the model, but {model_name(model)} is a served model that only "
            "answers prompts; run evaluate, repair_table or a PaddingProbe on it, or load the weights in-process "
            "(phaselens.load('hf:DIR')) for this analysis."
        )


def model_name(model: Any) -> str:
    """What results and progress bars call ``model``."""
    return str(model.name)


def metadata_of(model: Any, **arguments: Any) -> dict[str, Any]:
    """A result's ``metadata``: the model's name and ``analysis_metadata``, and the exact ``arguments``."""
    return {"model": model_name(model), **dict(model.analysis_metadata), "arguments": dict(arguments)}


def check_model(model: Any) -> Any:
    """Refuse what is not a model (a name, a path, None) before anything reads from it."""
    if callable(model) and callable(getattr(model, "identity", None)) and hasattr(model, "dims"):
        return model
    if isinstance(model, str):
        raise UnsupportedModelError(f"model is the string {model!r}, not a model; load it first: "
                                    f"model = phaselens.load({model!r}).")
    raise UnsupportedModelError(
        f"{type(model).__name__} is not a phaselens model (it needs dims, identity() and a forward); pass a "
        "model from phaselens.load(...), a CompressedTransformer, or phaselens.from_hf(...). A transformers "
        "causal LM, an nnsight envoy or a TransformerLens bridge is adapted by phaselens.load(obj, stride=4) (the "
        "stride a model without compression is analysed at) and by every analysis (pass stride=)."
    )


def module_of(model: Any) -> Any:
    """The ``torch.nn.Module`` with a model's weights (``model.identity().module``; a bare module is its own),
    or ``None``."""
    import torch

    if isinstance(model, torch.nn.Module) and not callable(getattr(model, "identity", None)):
        return model
    ident = getattr(model, "identity", None)
    return ident().module if callable(ident) else None
